"""`EventStreams`: which stream each KV event goes on.

Routers model one stream per engine: every block a stream announces is one its engine can hit.
With ``{worker}`` in the endpoints (``ipc:///run/kv/events-{worker}``) each worker has its own
stream, opened when it registers and closed when its session ends, and carries the events of its
namespace alone: its own blocks, or its cache group's (every member's stream announces a
group's block). Batch 0 of a worker's stream is ``AllBlocksCleared`` and a ``BlockStored`` for
each block its namespace already holds, so a router that starts from it holds what the service
does. Without the placeholder the service has one stream carrying every namespace's events, for a
router in front of one engine.
"""

from __future__ import annotations

from collections.abc import Callable

from kvalloc.allocator import AllBlocksCleared, BlockStored, KVCacheEvent, NamespacedEvent
from kvalloc.server.service.events.access import EventAccess
from kvalloc.server.service.events.sender import Endpoints, EventSender
from kvalloc.server.service.events.stream import StreamFormat

WORKER_FIELD = "{worker}"
SERVICE_STREAM = ""


def per_worker(endpoint: str) -> bool:
    return WORKER_FIELD in endpoint


class EventStreams:
    def __init__(self, events: str, replay: str | None, form: StreamFormat,
                 events_access: EventAccess,
                 stored: Callable[[bytes], list[BlockStored]]) -> None:
        """``events``/``replay``: the endpoints, each with ``{worker}`` or neither;
        ``stored(namespace)``: what a new stream of that namespace starts with."""
        self.events, self.replay = events, replay
        self.per_worker = per_worker(events)
        self._stored = stored
        self._namespaces: dict[str, bytes] = {}  # worker id -> namespace, per-worker streams
        self.sender = EventSender(form, events_access)
        if not self.per_worker:
            try:
                # Its batch 0 is the cache's own AllBlocksCleared, published as the service starts.
                self.sender.open(SERVICE_STREAM, events, replay, [])
            except Exception:
                self.sender.close()
                raise

    def publish(self, events: list[NamespacedEvent]) -> None:
        if not events:  # most steps change no cached block
            return
        if not self.per_worker:
            self.sender.publish(SERVICE_STREAM, [e.event for e in events])
            return
        for worker_id, namespace in self._namespaces.items():
            self.sender.publish(worker_id, [e.event for e in events
                                            if e.namespace in (None, namespace)])

    def open_worker(self, worker_id: str, namespace: bytes) -> Endpoints | None:
        """Open ``worker_id``'s stream (per-worker streams; None otherwise). The caller has
        published every event drained before this call, and publishes after it only those
        drained later: the stream starts from the namespace's blocks as they are now."""
        if not self.per_worker:
            return None
        self.close_worker(worker_id)
        first: list[KVCacheEvent] = [AllBlocksCleared(), *self._stored(namespace)]
        endpoints = self.sender.open(worker_id, self.events.replace(WORKER_FIELD, worker_id),
                                     None if self.replay is None
                                     else self.replay.replace(WORKER_FIELD, worker_id), first)
        self._namespaces[worker_id] = namespace
        return endpoints

    def close_worker(self, worker_id: str) -> None:
        if self._namespaces.pop(worker_id, None) is not None:
            self.sender.close_stream(worker_id)

    def endpoints(self) -> dict[str, Endpoints]:
        """The bound streams: the service's under ``""``, else each worker's under its id."""
        return self.sender.endpoints()

    def close(self) -> None:
        self.sender.close()
