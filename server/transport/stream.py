"""The IPC transport's frames over a plain Unix stream socket (``stream:///path``).

ZeroMQ hands every message to a background I/O thread on each side, so one round trip wakes
four threads besides the two that send and receive; where waking an idle thread is slow (virtual
machines), that is most of what a local round trip costs (`benchmarks/bench_round_trip.py`).
Here the caller's thread writes to the socket and the serving thread reading it wakes: one
wake-up each way. The messages are the IPC transport's, byte for byte: the frames
``[seq, token, op, payload]`` and ``[seq, status, payload]``, msgpack-encoded as one array of
byte strings and prefixed with its length (4 bytes, little-endian).

Both ends read through an `Inbox`: blocking sockets with a kernel receive timeout
(``SO_RCVTIMEO``) instead of Python's per-call ``poll``, so one ``recv`` usually brings a whole
message. A caller may also ``spin``: poll without sleeping for a while before it blocks, which
saves its own wake-up (and the sender's work to wake it) when the answer is due soon.

Each connection has its own serving thread (a worker keeps one connection open); the core's lock
serialises them with the other transports. Bounds: at most ``max_connections`` connections
(when full, a new one evicts the oldest that has not shown the token yet, else it is closed at
once), a first message begun within ``HANDSHAKE_S`` of connecting, every message complete within
``HANDSHAKE_S`` of its first byte, no message longer than ``max_frame_bytes`` (answered with an
error, then the connection closes: the rest of it is never read), and with a token, nothing
buffered past the usual inbox before a message showed it; a wrong token closes the connection.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
from kvalloc.server.contract import wire
from kvalloc.server.contract.addresses import claim_socket_path
from kvalloc.server.contract.errors import (
    BodyTooLarge,
    MalformedBody,
    MessageTooLarge,
    Unauthorized,
    describe,
)
from kvalloc.server.contract.operations import ERROR, OK
from kvalloc.server.transport.gate import sequence_of, token_verified
from kvalloc.server.transport.polling import BLOCK, CallPacer, Wait, wait_for

log = logging.getLogger("kvalloc.stream")

HANDSHAKE_S = 5.0
_POLL_S = 0.1  # how often the accepting thread looks at its stop flag
LENGTH = struct.Struct("<I")
_INBOX_BYTES = 1 << 16  # a batch-256 step's messages are ~10 KB: one recv each
# Frames are decoded as views of the received bytes, not copies: a step's columns are copied
# once, out of the message (`columns._unpacked`).
_FRAMES = msgspec.msgpack.Decoder(list[memoryview])
_encode_into = msgspec.msgpack.Encoder().encode_into

Frame = bytes | memoryview
Handle = Callable[[list[memoryview]], list[Frame]]


def pack_into(buffer: bytearray, frames: list[Frame]) -> None:
    """Make ``buffer`` the frames as one length-prefixed message, encoded in place (one copy of
    each frame, and no new buffer once ``buffer`` has grown to a message's size)."""
    _encode_into(frames, buffer, LENGTH.size)
    LENGTH.pack_into(buffer, 0, len(buffer) - LENGTH.size)


def pack(frames: list[Frame]) -> bytes:
    """Frames as one length-prefixed message."""
    buffer = bytearray()
    pack_into(buffer, frames)
    return bytes(buffer)


def unpack(body: bytes | memoryview) -> list[memoryview]:
    """A message's frames, views of ``body``; `MalformedBody` if it is not an array of byte
    strings."""
    try:
        return _FRAMES.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedBody(f"frames: not a msgpack array of byte strings ({exc})",
                            field="frames") from None


def set_timeouts(conn: socket.socket, seconds: float) -> None:
    """Make ``conn`` blocking, a receive or send giving up after ``seconds`` without progress
    (`BlockingIOError`): the kernel keeps the time, so a receive is one system call (Python's
    own timeout polls before each)."""
    conn.settimeout(None)
    whole = int(seconds)
    limit = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


class Outbox:
    """Length-prefixed messages to one socket, each encoded into one buffer kept between them
    and sent with one ``sendall``."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self._buffer = bytearray()

    def send(self, frames: list[Frame]) -> None:
        pack_into(self._buffer, frames)
        self.conn.sendall(self._buffer)


class Inbox:
    """Length-prefixed messages from one socket set up by `set_timeouts`. Reads as much
    as the socket holds into one buffer, so a message usually costs one ``recv``; bytes past a
    message stay for the next. A message's frames are views of that buffer, valid until the
    next message is read (copy what must outlive it)."""

    def __init__(self, conn: socket.socket, *, max_bytes: int | None = None) -> None:
        self.conn = conn
        self.max_bytes = max_bytes
        self._buffer = bytearray(_INBOX_BYTES)
        self._start = self._end = 0  # unread bytes: _buffer[_start:_end]
        self._peer_closed = False  # what the last receive that did not wait saw
        self._poller: select.poll | None = None

    def next_message(self, *, wait: Wait = BLOCK, within_s: float | None = None,
                     idle_ok: bool = False,
                     vet: Callable[[memoryview, bool], bool] | None = None
                     ) -> list[memoryview] | None:
        """The next message's frames; None if the peer closed between messages.

        ``wait``: how to wait for its first bytes before blocking (`polling.wait_for`).
        ``within_s``: the whole message must arrive within that long of its first byte.
        ``idle_ok``: a receive timeout before the first byte means only an idle peer (keep
        waiting); otherwise it raises
        `TimeoutError`, as it always does inside a message. A peer that closes inside a message
        raises `ConnectionError`; a length over ``max_bytes`` raises `MessageTooLarge`.
        ``vet``: called with the message's first bytes (and whether they are all of it) until it
        returns True, before the buffer grows past its usual size for the rest; it must decide
        (True, or raise) once they are all of it. What it raises propagates, the rest of the
        message unread (`gate.token_verified` is one)."""
        if self._end - self._start == 0 and not self._first_bytes(wait, idle_ok):
            return None
        began = time.monotonic()
        while self._end - self._start < LENGTH.size:
            self._more(began, within_s)
        size = LENGTH.unpack_from(self._buffer, self._start)[0]
        if self.max_bytes is not None and size > self.max_bytes:
            raise MessageTooLarge(size)
        if vet is not None:
            self._vet(vet, size, began, within_s)
        if self._start + LENGTH.size + size > len(self._buffer):
            self._make_room(LENGTH.size + size)
        end = self._start + LENGTH.size + size
        while self._end < end:
            self._more(began, within_s)
        start, self._start = self._start + LENGTH.size, end  # consumed, even if malformed
        with memoryview(self._buffer) as view:
            frames = unpack(view[start:end])
        if self._start == self._end:  # nothing unread: start over, at the usual size
            self._start = self._end = 0
            if len(self._buffer) > _INBOX_BYTES:
                self._buffer = bytearray(_INBOX_BYTES)
        return frames

    def _vet(self, vet: Callable[[memoryview, bool], bool], size: int, began: float,
             within_s: float | None) -> None:
        while True:
            start = self._start + LENGTH.size
            have = min(self._end - start, size)
            with memoryview(self._buffer) as view:
                if vet(view[start:start + have], have == size):
                    return
            self._more(began, within_s)

    def close(self) -> None:
        """Close the socket it reads."""
        self.conn.close()

    def _first_bytes(self, wait: Wait, idle_ok: bool) -> bool:
        """Wait for the next message to begin; False if the peer closed."""
        if wait_for(wait, self._readable_within, self._ready):
            return not self._peer_closed
        while True:
            try:
                return self._receive() > 0
            except BlockingIOError:  # the receive timeout
                if not idle_ok:
                    raise TimeoutError("no message within the receive timeout") from None

    def _readable_within(self, seconds: float) -> bool:
        """Whether bytes (or the peer's close) came within ``seconds``, waiting in the kernel
        (to the millisecond below); what came is received, as `_arrived` does."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.conn, select.POLLIN)
        return bool(self._poller.poll(int(seconds * 1e3))) and self._arrived()

    def _ready(self) -> bool:
        """Whether bytes (or the peer's close) are there, without waiting; what came is
        received. Asks the kernel with a ``poll`` first: a receive that finds nothing raises,
        which costs a polling loop several times as much per look, and so the reply that much
        later on average."""
        return self._readable_within(0.0)

    def _arrived(self) -> bool:
        """One receive that does not wait: whether bytes, or the peer's close, came."""
        try:
            self._peer_closed = self._receive(socket.MSG_DONTWAIT) == 0
        except BlockingIOError:
            return False
        return True

    def _more(self, began: float, within_s: float | None) -> None:
        if within_s is not None and time.monotonic() - began > within_s:
            raise TimeoutError(f"a message not complete within {within_s:g} s")
        try:
            received = self._receive()
        except BlockingIOError:
            raise TimeoutError("no more of the message within the receive timeout") from None
        if received == 0:
            raise ConnectionError("peer closed inside a message")

    def _receive(self, flags: int = 0) -> int:
        if self._end == len(self._buffer):
            self._make_room(self._end - self._start + 1)
        with memoryview(self._buffer) as view:
            received = self.conn.recv_into(view[self._end:], 0, flags)
        self._end += received
        return received

    def _make_room(self, size: int) -> None:
        """Move the unread bytes to the front of the buffer, grown to at least ``size`` bytes if
        smaller (doubling, so a message read in pieces is copied a bounded number of times)."""
        unread = self._buffer[self._start: self._end]
        if size > len(self._buffer):
            self._buffer = bytearray(max(size, 2 * len(self._buffer)))
        self._buffer[: len(unread)] = unread
        self._start, self._end = 0, len(unread)


class StreamListener:
    """Serves ``handle`` on a Unix stream socket at ``path`` (created 0600)."""

    def __init__(self, path: Path, handle: Handle, *, max_frame_bytes: int,
                 max_connections: int, spin_s: float = 0.0, token: bytes | None = None) -> None:
        """``spin_s``: how long a connection polls for its next message without sleeping, around
        when it is due (`CallPacer`), after answering one successfully. ``token``: what every
        message must carry (None: nothing); a connection that has not sent a message with it
        yet is *unverified*."""
        self.path = path
        self.handle = handle
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.spin_s = spin_s
        self.token = token
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._stop = threading.Event()
        # Serving thread -> its connection: stop() ends a thread's wait by shutting its
        # connection's reading side.
        self._served: dict[threading.Thread, socket.socket] = {}
        # The unverified ones among them, oldest first: a full listener evicts the oldest for a
        # new connection, so peers without the token cannot hold the slots workers need.
        self._unverified: dict[threading.Thread, socket.socket] = {}
        self._evicted: set[threading.Thread] = set()  # shut down, their threads still ending
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # a serving thread ended
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
        # As deep as the kernel allows (net.core.somaxconn caps it): a Unix socket's full
        # backlog refuses a connect at once, so a burst of peers that never send a message must
        # not fill it before the acceptor has shed them.
        self._sock.listen(socket.SOMAXCONN)
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
            served = list(self._served.items())
        for thread, conn in served:
            # A waiting thread sees the end of its stream; one mid-message still answers. The
            # connection may be closed already by its thread.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
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
                if not self._room():
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(conn,),
                                          name="kvalloc-stream-conn", daemon=True)
                self._served[thread] = conn
                self._unverified[thread] = conn
            thread.start()

    def _room(self) -> bool:
        """Whether a new connection may be served, evicting the oldest unverified one if that
        makes room (under ``_lock``). Evicted threads still ending count against a second bound
        of as many again, so a flood cannot pile up threads either: at that bound the acceptor
        waits for one to end (they were shut down, so that is soon) and the kernel's backlog
        holds the new peers meanwhile, rather than closing a worker's connection for a flood."""
        while len(self._served) >= 2 * self.max_connections and not self._stop.is_set():
            self._ended.wait(_POLL_S)
        if len(self._served) - len(self._evicted) < self.max_connections:
            return True
        if not self._unverified:
            return False
        oldest = next(iter(self._unverified))
        conn = self._unverified.pop(oldest)
        self._evicted.add(oldest)
        with contextlib.suppress(OSError):  # its thread may be closing it right now
            conn.shutdown(socket.SHUT_RDWR)
        return True

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._converse(conn)
        except OSError:
            pass  # the peer went away or stalled inside a message: drop it
        finally:
            me = threading.current_thread()
            with self._lock:
                del self._served[me]
                self._unverified.pop(me, None)
                self._evicted.discard(me)
                self._ended.notify()

    def _verified(self) -> None:
        with self._lock:
            self._unverified.pop(threading.current_thread(), None)

    def _converse(self, conn: socket.socket) -> None:
        # One kernel timeout serves every bound: the first message must begin within it, any
        # message must end within it of its first byte; between messages a verified connection
        # may idle as long as it likes (each expiry of the timeout then just renews the wait).
        # With a token, a connection's first message shows it in its first bytes before more
        # than the usual inbox is buffered for it (`gate`), and any refusal before then closes
        # the connection; later messages are checked by ``handle`` (a verified peer already
        # held the token, and the hot path pays nothing twice), a refused token closing it too.
        set_timeouts(conn, HANDSHAKE_S)
        inbox = Inbox(conn, max_bytes=self.max_frame_bytes)
        outbox = Outbox(conn)
        pacer = CallPacer(self.spin_s)
        verified = False  # a message came (with the token, if there is one)
        refused: list[bytes] = []  # the sequence frame of a message the vet refused
        vet = None if self.token is None else functools.partial(self._vet, refused=refused)
        while not self._stop.is_set():
            try:
                frames = inbox.next_message(wait=pacer.next_wait(), within_s=HANDSHAKE_S,
                                            idle_ok=verified, vet=None if verified else vet)
            except MessageTooLarge as exc:
                too_big = BodyTooLarge(f"body: {exc.size} bytes, more than "
                                       f"{self.max_frame_bytes}")
                outbox.send([b"", ERROR, wire.encode_msgpack(describe(too_big))])
                return
            except (MalformedBody, Unauthorized) as exc:
                # Echoed, so that the client takes the refusal as its call's answer.
                seq = refused[0] if refused else b""
                outbox.send([seq, ERROR, wire.encode_msgpack(describe(exc))])
                if vet is not None and not verified:
                    return
                pacer.answered(ok=False)
                continue
            if frames is None:
                return
            pacer.arrived()
            if not verified:
                verified = True
                self._verified()
            reply = self.handle(frames)
            outbox.send(reply)
            if reply[1] != OK and _refused_token(reply):
                return
            pacer.answered(ok=reply[1] == OK)

    def _vet(self, prefix: memoryview, complete: bool, *, refused: list[bytes]) -> bool:
        assert self.token is not None
        try:
            shown = token_verified(prefix, complete, self.token)
        except (MalformedBody, Unauthorized):
            refused.append(sequence_of(prefix))
            raise
        if shown:  # from now on never evicted, however long the rest of the message takes
            self._verified()
        return shown


def _refused_token(reply: list[Frame]) -> bool:
    """Whether an error reply refused the message's token."""
    try:
        return wire.decode(reply[2], wire.ErrorBody).code == Unauthorized.code
    except msgspec.DecodeError:  # a handle whose error replies carry no ErrorBody
        return False
