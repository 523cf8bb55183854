"""`KVEventPublisher`: the manager's KV events on ZeroMQ, as vLLM publishes them.

Every step that cached or evicted blocks becomes one msgpack
`allocator.capacity.kv_events.KVEventBatch`, sent on a PUB socket as three frames: the topic, an
8-byte big-endian sequence number (0, 1, ...) and the payload. A subscriber that sees a gap in the
sequence asks the replay socket (ROUTER) for everything from a sequence number on: it sends ``[b"",
start (8 bytes, big-endian)]`` (a REQ or DEALER socket) and receives ``[b"", seq, payload]`` for
each batch still buffered, then ``[b"", -1 (8 bytes, signed), b""]``. The first batch is
``AllBlocksCleared``: a new service (a new epoch) starts with an empty cache.

The sockets live on one background thread (ZeroMQ sockets are not thread-safe); ``publish`` only
hands the events over, so a step never waits on the network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from allocator.capacity.kv_events import KVCacheEvent, KVEventBatch

DEFAULT_TOPIC = "kv-events"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str = DEFAULT_TOPIC, buffer_batches: int = 10_000,
                 data_parallel_rank: int | None = None) -> None:
        """Bind ``endpoint`` (PUB) and ``replay_endpoint`` (ROUTER) now, so a bad address fails
        at start; ``buffer_batches`` bounds what a replay can still return."""
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = self._context.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if self._replay is not None else None)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._queue: queue.SimpleQueue[list[KVCacheEvent] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvalloc-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send ``events`` as one batch (nothing when empty)."""
        if events:
            self._queue.put(events)

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                try:
                    events = self._queue.get(timeout=0.02)
                except queue.Empty:
                    events = []
                if events is None:
                    return
                if events:
                    self._send(events)
                if self._replay is not None and poller.poll(0):
                    # A replay covers everything published before it was asked for.
                    while True:
                        try:
                            events = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if events is None:
                            return
                        self._send(events)
                    self._answer_replay()
        finally:
            self._close_sockets()

    def _send(self, events: list[KVCacheEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self._rank))
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, start = frames[0], frames[-1]
        first = int.from_bytes(start, "big") if len(start) == 8 else self._next_seq
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=1000)
        self._context.term()
