"""What keeps the network from killing the service: a descriptor budget and REST connection limits.

A connection the service accepts costs one file descriptor until it closes, and ZeroMQ aborts the
whole process when its IPC listener cannot accept for lack of descriptors. So:

- at start RLIMIT_NOFILE is raised to its hard limit (`raise_nofile_limit`);
- REST may hold at most ``max_connections`` connections, chosen so that REST connections, the
  ones accepted but not yet refused, and a reserve (`FD_RESERVE`: IPC peers, shared-memory
  segments, log files, Python's own) never reach the limit; a connection over the bound is
  answered 503 with Retry-After and closed at once;
- a connection must deliver its request line and headers within ``header_timeout_s`` of opening
  (or of its previous response) and its body within ``body_timeout_s``, or it is closed: a peer
  that opens connections and never finishes a request cannot hold them.

Why a protocol subclass: uvicorn's h11 protocol arms no timer until its first response (its
keep-alive timer), and ``limit_concurrency`` answers 503 only once a complete request arrived;
neither bounds a connection that never sends its headers. The subclass adds exactly that and
keeps everything else of uvicorn's protocol.
"""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Descriptors kept out of REST's reach for ZeroMQ's peers and listeners, shared-memory segments,
# socket files, logs and the interpreter's own files.
FD_RESERVE = 256
# The listen backlog, which is also how many connections asyncio accepts per wakeup before any
# of them reaches the protocol. A refused connection's descriptor is closed a loop turn or two
# later, so up to a few batches are open beyond the connections counted: the budget leaves room
# for ACCEPT_BATCHES of them.
ACCEPT_BACKLOG = 64
ACCEPT_BATCHES = 4

OVERLOADED_RETRY_AFTER_S = 1


class LimitsError(ValueError):
    """The descriptor limit is too small to serve REST with the reserve kept."""


@dataclass(frozen=True)
class RestLimits:
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_in_flight: int = 64  # requests past their headers at once; more are answered 503


DEFAULT_LIMITS = RestLimits()


def raise_nofile_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def connection_budget(requested: int, nofile: int) -> int:
    """REST connections allowed under a descriptor limit of ``nofile``: ``requested``, lowered so
    that `FD_RESERVE` descriptors stay free for everything else even while batches of refused
    connections wait to be closed."""
    budget = min(requested, nofile - FD_RESERVE - ACCEPT_BATCHES * ACCEPT_BACKLOG)
    if budget < 1:
        raise LimitsError(f"max_connections: RLIMIT_NOFILE is {nofile}, no room for REST "
                          f"connections beside the {FD_RESERVE} descriptors kept in reserve")
    return budget


def bounded_protocol(limits: RestLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits``' connection bound and header deadline."""
    return type("BoundedH11Protocol", (_BoundedH11Protocol,), {"limits": limits})


_OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\n"
               b"retry-after: %d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
               b"connection: close\r\n\r\n%s")


def overloaded_response() -> bytes:
    body = (b'{"status":503,"code":"overloaded","field":"connection",'
            b'"message":"connection: too many open connections; retry later"}')
    return _OVERLOADED % (OVERLOADED_RETRY_AFTER_S, len(body), body)


class _BoundedH11Protocol(H11Protocol):
    limits: RestLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(overloaded_response())
            transport.close()
            return
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole request line and headers arrived
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request on this connection gets its own

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.limits.header_timeout_s,
                                                     self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
