"""The IPC transport's frames over a plain Unix stream socket (``stream:///path``).

ZeroMQ hands every message to a background I/O thread on each side, so one round trip wakes
four threads besides the two that send and receive; where waking an idle thread is slow (virtual
machines), that is most of what a local round trip costs (`benchmarks/bench_round_trip.py`).
Here the caller's thread writes to the socket and the serving thread reading it wakes: one
wake-up each way. The messages are the IPC transport's, byte for byte: the frames
``[seq, token, op, payload]`` and ``[seq, status, payload]``, msgpack-encoded as one array of
byte strings and prefixed with its length (4 bytes, little-endian).

Each connection has its own serving thread (a worker keeps one connection open); the core's lock
serialises them with the other transports. Bounds: at most ``max_connections`` connections
(more are closed at once), a first frame within ``HANDSHAKE_S`` of connecting, a frame complete
within ``HANDSHAKE_S`` of its first byte, and no frame longer than ``max_frame_bytes`` (answered
with an error, then the connection closes: the rest of it is never read).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec

from . import wire
from .addresses import claim_socket_path
from .errors import BodyTooLarge, MalformedBody, describe
from .operations import ERROR

log = logging.getLogger("kvalloc.stream")

HANDSHAKE_S = 5.0
_POLL_S = 0.1  # how often an idle serving thread looks at its stop flag
LENGTH = struct.Struct("<I")
_FRAMES = msgspec.msgpack.Decoder(list[bytes])
_encode = msgspec.msgpack.Encoder().encode

Handle = Callable[[list[bytes]], list[bytes]]


def pack(frames: list[bytes]) -> bytes:
    """Frames as one length-prefixed message."""
    body = _encode(frames)
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes) -> list[bytes]:
    """A message's frames; `MalformedBody` if it is not an array of byte strings."""
    try:
        return _FRAMES.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedBody(f"frames: not a msgpack array of byte strings ({exc})",
                            field="frames") from None


def read_exactly(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from ``conn``; None if the peer closed before the first one."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ConnectionError("peer closed inside a message")
            return None
        buf += chunk
    return bytes(buf)


class StreamListener:
    """Serves ``handle`` on a Unix stream socket at ``path`` (created 0600)."""

    def __init__(self, path: Path, handle: Handle, *, max_frame_bytes: int,
                 max_connections: int) -> None:
        self.path = path
        self.handle = handle
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, name="kvalloc-stream", daemon=True)
        self._bound = False  # the socket file is ours to remove

    @property
    def endpoint(self) -> str:
        return f"stream://{self.path}"

    def start(self) -> str:
        claim_socket_path(self.path)
        old = os.umask(0o177)
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._bound = True
        self._sock.listen(64)
        self._sock.settimeout(_POLL_S)
        self._acceptor.start()
        return self.endpoint

    def stop(self) -> None:
        """Finish the messages in hand, close every connection, remove the socket file (only if
        this listener made it: a path another service holds is never touched)."""
        self._stop.set()
        if self._acceptor.is_alive():
            self._acceptor.join()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()
        self._sock.close()
        if self._bound:
            self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under us, or out of descriptors: try again shortly
                self._stop.wait(_POLL_S)
                continue
            with self._lock:
                if len(self._threads) >= self.max_connections:
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(conn,),
                                          name="kvalloc-stream-conn", daemon=True)
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._converse(conn)
        except OSError:
            pass  # the peer went away or stalled inside a message: drop it
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _converse(self, conn: socket.socket) -> None:
        first = True
        while not self._stop.is_set():
            header = self._next_header(conn, patient=not first)
            if header is None:
                return
            first = False
            conn.settimeout(HANDSHAKE_S)  # the rest of the message comes now or never
            size = LENGTH.unpack(header)[0]
            if size > self.max_frame_bytes:
                too_big = BodyTooLarge(f"body: {size} bytes, more than {self.max_frame_bytes}")
                conn.sendall(pack([b"", ERROR, wire.encode_msgpack(describe(too_big))]))
                return
            body = read_exactly(conn, size)
            if body is None:
                return
            try:
                reply = self.handle(unpack(body))
            except MalformedBody as exc:
                reply = [b"", ERROR, wire.encode_msgpack(describe(exc))]
            conn.sendall(pack(reply))

    def _next_header(self, conn: socket.socket, *, patient: bool) -> bytes | None:
        """The next message's length; between messages a connection may idle as long as it
        likes (``patient``), a new one must speak within ``HANDSHAKE_S``."""
        conn.settimeout(_POLL_S)
        waited = 0.0
        while not self._stop.is_set():
            try:
                first = conn.recv(1)
            except TimeoutError:
                waited += _POLL_S
                if not patient and waited >= HANDSHAKE_S:
                    return None
                continue
            if not first:
                return None
            conn.settimeout(HANDSHAKE_S)
            rest = read_exactly(conn, LENGTH.size - 1)
            if rest is None:
                raise ConnectionError("peer closed inside a message")
            return first + rest
        return None
