"""What keeps the network from killing the service: a descriptor budget and REST connection limits.

A connection the service accepts costs one file descriptor until it closes, and ZeroMQ aborts the
whole process when its IPC listener cannot accept for lack of descriptors. So:

- at start RLIMIT_NOFILE is raised to its hard limit (`raise_nofile_limit`);
- REST may hold at most ``max_connections`` connections, chosen so that REST connections, the
  ones accepted but not yet refused, and a reserve (`FD_RESERVE`: IPC peers, shared-memory
  segments, log files, Python's own) never reach the limit. A connection over the bound evicts
  the one that has waited longest for a request's headers (half-open, or idle between
  requests); only when every connection is inside a request is it answered 503 with Retry-After
  and closed at once. So a flood of half-open connections only ever replaces itself, and a
  probe, whose request follows its connection at once, is answered whatever such traffic does;
- a connection must deliver its request line and headers within ``header_timeout_s`` of opening
  (or of its previous response) and its body within ``body_timeout_s``, or it is closed: a peer
  that opens connections and never finishes a request cannot hold them.

Why protocol subclasses: uvicorn's HTTP protocols arm no timer until their first response (the
keep-alive timer), and ``limit_concurrency`` answers 503 only once a complete request arrived;
neither bounds a connection that never sends its headers. `_Bounded` adds exactly that to
uvicorn's httptools protocol (a C parser: the one served when httptools is installed) or, without
httptools, to its pure-Python h11 protocol, and keeps everything else of the protocol.
"""

from __future__ import annotations

import asyncio
import functools
import resource
from dataclasses import dataclass
from typing import Any

import h11
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import LimitsError, Overloaded, describe
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


def http_parsers() -> tuple[str, ...]:
    """The parsers `bounded_protocol` takes here: ``auto`` (httptools when installed, else h11),
    ``httptools`` where it is installed, ``h11``."""
    try:
        _bounded_httptools()
    except ImportError:
        return ("auto", "h11")
    return ("auto", "httptools", "h11")


def bounded_protocol(limits: RestLimits, parser: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol for ``parser`` (one of `http_parsers`) with ``limits``'
    connection bound and header deadline."""
    parsers = http_parsers()
    if parser not in parsers:
        raise ValueError(f"parser: {parser!r} is not one of {parsers}")
    h11_only = parser == "h11" or "httptools" not in parsers
    base = _BoundedH11Protocol if h11_only else _bounded_httptools()
    return type(f"Bounded{base.__name__.removeprefix('_Bounded')}", (base,),
                {"limits": limits, "awaiting": {}})


_OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\n"
               b"retry-after: %d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
               b"connection: close\r\n\r\n%s")


@functools.cache
def overloaded_response() -> bytes:
    body = wire.encode_json(describe(Overloaded(
        "connection: too many open connections; retry later", field="connection")))
    return _OVERLOADED % (OVERLOADED_RETRY_AFTER_S, len(body), body)


class _Bounded:
    """The bounds, over either uvicorn protocol (first base after this one). The header deadline
    runs whenever the connection waits for a request's headers: from the connection's opening,
    and again from each response's end; it closes the connection only if by then no request's
    headers arrived (`_awaiting_headers`), so a request in progress is never cut.

    ``awaiting`` holds the server's connections in the order their deadlines were armed, oldest
    first: every one that waits for headers is in it, and so may be some that since got theirs
    (dropped when eviction meets them; they enter again at their next deadline)."""

    limits: RestLimits
    awaiting: dict[_Bounded, None]  # one per server: `bounded_protocol` makes the class
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    _header_deadline: asyncio.TimerHandle | None = None

    def _awaiting_headers(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.limits.max_connections and not self._evict_oldest():
            transport.write(overloaded_response())
            transport.close()
            return
        self._arm_header_deadline()

    def _evict_oldest(self) -> bool:
        """Close the connection that has waited longest for headers; False if none waits."""
        while self.awaiting:
            oldest = next(iter(self.awaiting))
            del self.awaiting[oldest]
            if oldest._awaiting_headers() and not oldest.transport.is_closing():
                oldest.transport.close()
                return True
        return False

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and self._awaiting_headers():
            self._arm_header_deadline()  # the next request on this connection gets its own

    def connection_lost(self, exc: Exception | None) -> None:
        self.awaiting.pop(self, None)
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._header_deadline = self.loop.call_later(self.limits.header_timeout_s,
                                                     self._headers_too_slow)
        self.awaiting.pop(self, None)  # to the newest end
        self.awaiting[self] = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()


class _BoundedH11Protocol(_Bounded, H11Protocol):
    def _awaiting_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE


@functools.cache
def _bounded_httptools() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # needs httptools

    class _BoundedHttpToolsProtocol(_Bounded, HttpToolsProtocol):
        def _awaiting_headers(self) -> bool:
            # A request's cycle starts when its headers are complete; the latest one is
            # ``cycle``.
            return self.cycle is None or self.cycle.response_complete

    return _BoundedHttpToolsProtocol
