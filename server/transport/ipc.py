"""The IPC transport: a ZeroMQ ROUTER socket carrying msgpack-encoded `server.contract.wire` structs
(the step's columns as raw int64 buffers).

Frames, client (DEALER) -> service: ``[seq, token, op, payload]``; the ROUTER adds the peer's
identity in front, so many workers share one socket. Reply: ``[seq, b"ok" | b"error", payload]``
where payload is the op's reply struct or an `ErrorBody`. ``seq`` is echoed so a client that
timed out and retried can drop a late reply to its earlier attempt.

One thread owns the socket (ZeroMQ sockets are not thread-safe) and calls the core, whose lock
serialises it with the REST transport. Works over ``ipc://`` (socket file created 0600) and
``tcp://`` (for containers; bind loopback unless told otherwise). A ``stream:///path`` endpoint
carries the same messages over a plain Unix stream socket instead (`server.transport.stream`): the
fastest local path, without ZeroMQ's I/O threads.
"""

from __future__ import annotations

import functools
import hmac
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq
from kvalloc.server.contract import wire
from kvalloc.server.contract.addresses import claim_socket_path, stream_path
from kvalloc.server.contract.errors import (
    INTERNAL,
    BodyTooLarge,
    MalformedBody,
    Unauthorized,
    UnknownOperation,
    describe,
)
from kvalloc.server.contract.operations import ERROR, OK, OPERATIONS
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.transport.polling import CallPacer, Wait, wait_for
from kvalloc.server.transport.stream import Frame, StreamListener
from pydantic import SecretStr

log = logging.getLogger("kvalloc.ipc")

_POLL_MS = 100  # how often the serving thread looks at its stop flag
_HANDSHAKE_MS = 5000


class IpcServer:
    def __init__(self, core: ServiceCore, addresses: Sequence[str], *,
                 token: SecretStr | None = None) -> None:
        self.core = core
        self.addresses = list(addresses)
        self._token = token.get_secret_value().encode() if token is not None else None
        self._limit = core.config.max_body_bytes
        self._spin_s = core.config.ipc_spin_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvalloc-ipc", daemon=True)
        self._streams = [
            StreamListener(path, functools.partial(self.handle, transport="stream"),
                           max_frame_bytes=4 * self._limit,
                           max_connections=2 * core.config.max_workers + 8,
                           spin_s=self._spin_s, token=self._token)
            for path in map(stream_path, self.addresses) if path is not None]
        self.endpoints: list[str] = []

    def start(self) -> list[str]:
        """Bind every address (errors surface here) and start serving; returns the endpoints."""
        sock = self._sock
        sock.setsockopt(zmq.LINGER, 0)
        # Far larger than any valid message: a hard cap on memory before our own clear check.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self._limit)
        # A peer that connects and never completes ZeroMQ's greeting is dropped (default 30 s):
        # idle half-open connections must not accumulate descriptors.
        sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        old = os.umask(0o177)  # ipc:// socket files are created 0600
        try:
            for address in self.addresses:
                if stream_path(address) is not None:
                    continue
                if address.startswith("ipc://"):
                    claim_socket_path(Path(address.removeprefix("ipc://")))
                sock.bind(address)
                self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        finally:
            os.umask(old)
        self.endpoints += [stream.start() for stream in self._streams]
        self._thread.start()
        return self.endpoints

    def stop(self) -> None:
        """Finish the message in hand, close the socket, remove ipc:// socket files."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for stream in self._streams:
            stream.stop()
        self._sock.close()
        self._ctx.term()
        for endpoint in self.endpoints:
            if endpoint.startswith("ipc://"):
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)

    def _serve(self) -> None:
        sock = self._sock
        # One pacer for the socket: its calls come from every ZeroMQ worker, in turn.
        pacer = CallPacer(self._spin_s)
        while not self._stop.is_set():
            if not self._call_came(pacer.next_wait()):
                continue
            frames = sock.recv_multipart()
            pacer.arrived()
            reply = self.handle(frames[1:])
            sock.send_multipart([frames[0], *reply])
            pacer.answered(ok=reply[1] == OK)

    def _call_came(self, wait: Wait) -> bool:
        """Whether a message came, waiting as told, or else within _POLL_MS (so that the stop
        flag is seen)."""
        return (wait_for(wait, lambda s: bool(self._sock.poll(int(s * 1e3))), self._arrived,
                         self._stop)
                or bool(self._sock.poll(_POLL_MS)))

    def _arrived(self) -> bool:
        return bool(self._sock.poll(0))

    def handle(self, frames: Sequence[Frame], transport: str = "ipc") -> list[Frame]:
        """One message (without the identity frame) -> its reply frames; ``transport`` labels
        the step's service time."""
        start = time.perf_counter()
        seq = frames[0] if frames else b""
        op_name = ""
        try:
            if len(frames) != 4:
                raise MalformedBody("frames: expected [seq, token, op, payload]", field="frames")
            _, token, op, payload = frames
            self._authorize(token)
            if len(payload) > self._limit:
                raise BodyTooLarge(f"body: {len(payload)} bytes, more than max_body_bytes="
                                   f"{self._limit}")
            op_name = str(op, "utf-8", "replace")
            operation = OPERATIONS.get(op_name)
            if operation is None:
                raise UnknownOperation(f"op: {op_name!r} is not one of {sorted(OPERATIONS)}")
            request = operation.to_core(_decode(payload, operation.request_struct(binary=True)))
            value = getattr(self.core, op_name)(request)
            reply = [seq, OK, wire.encode_msgpack(operation.from_core(value, binary=True))]
        except Exception as exc:
            body = describe(exc)
            if body.status == INTERNAL:  # a typed refusal (503, 507) is no bug
                log.error("internal error: %s", body.message, exc_info=exc)
            reply = [seq, ERROR, wire.encode_msgpack(body)]
        if op_name == "step":
            self.core.observe_step(transport, time.perf_counter() - start)
        return reply

    def _authorize(self, token: bytes) -> None:
        if self._token is not None and not hmac.compare_digest(token, self._token):
            raise Unauthorized("authorization: missing or wrong token")


def _decode(payload: Frame, struct: type[wire.S]) -> wire.S:
    try:
        return wire.decode(payload, struct)
    except msgspec.ValidationError as exc:
        where = wire.error_field(exc)
        raise MalformedBody(f"{where}: {exc}", field=where) from None
    except msgspec.DecodeError as exc:
        raise MalformedBody(f"body: not msgpack ({exc})", field="body") from None
