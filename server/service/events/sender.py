"""`EventSender`: every KV event stream of a service on one background thread.

The service hands events over (``publish``) and never waits on the network, nor wakes the
thread: a batch goes on a deque the thread drains every ``TICK_S`` (waking a waiting thread from
the step costs it far more than the append, on a busy machine most of all). Opening and closing a
stream wait for the thread, so a bad or taken endpoint fails the call that asked for it.
ZeroMQ sockets are not thread-safe: only the thread makes, uses and closes them. With an events
secret the context runs ZeroMQ's ZAP handler, admitting the events' subscriber key alone.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq
from kvalloc.allocator import KVCacheEvent
from kvalloc.server.contract.errors import NotReady
from kvalloc.server.contract.routing import curve_keys
from kvalloc.server.service.events import access
from kvalloc.server.service.events.access import EventAccess
from kvalloc.server.service.events.stream import PEER_MESSAGE_BYTES, EventStream, StreamFormat
from zmq.auth.thread import ThreadAuthenticator

# How long a batch waits at most before the thread sends it; routers see events this late.
TICK_S = 0.02


@dataclass(frozen=True)
class Endpoints:
    """Where a stream was bound: its PUB endpoint and its replay endpoint (None: no replay)."""

    events: str
    replay: str | None


@dataclass
class _Command:
    run: Callable[[], Any]
    done: Future[Any] = field(default_factory=Future)

    def execute(self) -> None:
        try:
            self.done.set_result(self.run())
        except Exception as exc:  # the caller's thread raises it
            self.done.set_exception(exc)


_STOP = _Command(lambda: None)  # the thread's last command: it sends what is left and ends


class _SubscriberKey:
    """The ZAP check of a CURVE client: its public key is the subscriber key."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class EventSender:
    def __init__(self, form: StreamFormat, events_access: EventAccess) -> None:
        self.form, self.access = form, events_access
        self._context = zmq.Context()
        self._auth = self._authenticator(events_access)
        self._streams: dict[str, tuple[EventStream, Endpoints]] = {}
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._batches: deque[tuple[str, list[KVCacheEvent]]] = deque()
        self._thread = threading.Thread(target=self._run, name="kvalloc-kv-events", daemon=True)
        self._thread.start()

    def _authenticator(self, events_access: EventAccess) -> ThreadAuthenticator | None:
        if events_access.secret is None:
            return None
        auth = ThreadAuthenticator(self._context)
        auth.start()
        subscriber = curve_keys(events_access.secret.get_secret_value()).subscriber_public
        auth.configure_curve_callback("*", credentials_provider=_SubscriberKey(subscriber))
        return auth

    # ------------------------------------------------------------------ any thread

    def open(self, key: str, events: str, replay: str | None,
             first: list[KVCacheEvent]) -> Endpoints:
        """Bind a stream under ``key`` and send ``first`` (when not empty) as its batch 0;
        `AddressError` (and nothing bound) when an endpoint cannot be bound."""
        return self._call(lambda: self._open(key, events, replay, first))

    def publish(self, key: str, events: list[KVCacheEvent]) -> None:
        """Send ``events`` as one batch on ``key``'s stream (nothing when empty)."""
        if events:
            self._batches.append((key, events))

    def close_stream(self, key: str) -> None:
        """Send what is queued for ``key``, then close its stream and remove its socket files."""
        self._call(lambda: self._close(key))

    def flush(self) -> None:
        """Return once every batch published before the call is sent."""
        self._call(lambda: None)

    def endpoints(self) -> dict[str, Endpoints]:
        return self._call(lambda: {k: bound for k, (_, bound) in self._streams.items()})

    def close(self) -> None:
        """Send what is queued, then close every stream. Idempotent."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout=5)

    def _call(self, run: Callable[[], Any]) -> Any:
        if not self._thread.is_alive():
            raise NotReady("KV events: the sender has stopped (the service is closing)")
        command = _Command(run)
        self._commands.put(command)
        return command.done.result()

    # ------------------------------------------------------------------ the sender's thread

    def _run(self) -> None:
        try:
            while (command := self._next_command()) is not _STOP:
                # Batches first: a command (a close, say) comes after what was published before.
                self._send_batches()
                if command is not None:
                    command.execute()
                self._answer_replays()
            self._send_batches()
        finally:
            for key in list(self._streams):
                self._close(key)
            if self._auth is not None:
                self._auth.stop()
            self._context.term()

    def _next_command(self) -> _Command | None:
        """The next command, or None after a tick without one."""
        try:
            return self._commands.get(timeout=TICK_S)
        except queue.Empty:
            return None

    def _send_batches(self) -> None:
        while self._batches:
            key, events = self._batches.popleft()
            if key in self._streams:  # a stream closed since is sent nothing
                self._streams[key][0].send(events)

    def _answer_replays(self) -> None:
        """Answer waiting replays, after everything published before they were asked for."""
        waiting = [stream for stream, _ in self._streams.values()
                   if stream.replay is not None and stream.replay.poll(0)]
        if waiting:
            self._send_batches()
        for stream in waiting:
            stream.answer_replay()

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        # A peer's message above the bound drops its connection before ZeroMQ buffers it.
        sock.maxmsgsize = PEER_MESSAGE_BYTES
        return sock

    def _open(self, key: str, events: str, replay: str | None,
              first: list[KVCacheEvent]) -> Endpoints:
        pub = self._socket(zmq.PUB)
        router = self._socket(zmq.ROUTER) if replay is not None else None
        bound: list[str] = []
        try:
            bound.append(access.bind(pub, events, self.access))
            if router is not None:
                bound.append(access.bind(router, replay, self.access))
        except Exception:
            for sock in (pub, router):
                if sock is not None:
                    sock.close(linger=0)
            for endpoint in bound:
                access.release(endpoint)
            raise
        endpoints = Endpoints(bound[0], bound[1] if router is not None else None)
        stream = EventStream(pub, router, self.form)
        if first:
            stream.send(first)
        self._streams[key] = (stream, endpoints)
        return endpoints

    def _close(self, key: str) -> None:
        entry = self._streams.pop(key, None)
        if entry is None:
            return
        stream, endpoints = entry
        stream.close()
        for endpoint in (endpoints.events, endpoints.replay):
            if endpoint is not None:
                access.release(endpoint)
