"""`KVEventSubscriber`: a service's KV events read as a KV-aware router reads them, for the soak
and for whoever wants to watch a running service's prefix cache.

It subscribes plain (a Unix-socket stream) or with the CURVE keys derived from the events secret
(`server.contract.routing.authenticate_subscriber`), applies each ``KVEventBatch`` in sequence
order, and fills a gap in the sequence from the replay socket (`server.service.events.stream`
says how replays are asked for, answered and refused). It keeps the set of cached block hashes
and counts what it saw: batches, gaps, batches replayed, replay refusals, batches lost (neither
received nor replayable any more) and anomalies (events that contradict the view: a removal of a
hash it never saw stored, a hash stored twice, a parent it does not hold, a frame it cannot read).
Given the namespaces (`server.contract.routing.worker_salt`), it also checks what a
router computing hashes relies on: every block stored from a chain's root hashes, over its token
ids, as in one of those namespaces (`allocator.capacity.kv_events.router_hashes`).

Invariant: ``last_seq`` is the last batch applied, and batches are applied in order, each once;
so with no batch lost and no anomaly, ``cached`` is the publisher's cache as of batch
``last_seq``. ZeroMQ sockets are not thread-safe: create, use and close one subscriber on one
thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq
from kvalloc.allocator import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    router_hashes,
)
from kvalloc.server.contract.errors import HandshakeFailed
from kvalloc.server.contract.routing import authenticate_subscriber
from kvalloc.server.service.events.stream import (
    DEFAULT_REPLAY_RATE,
    DEFAULT_TOPIC,
    END_OF_REPLAY,
    REPLAY_REFUSED,
)
from zmq.utils.monitor import recv_monitor_message

SEQ_BYTES = 8
ANOMALIES_KEPT = 10  # the first few are described; the rest are only counted


# How a connection's handshake can end, as ZeroMQ's monitor reports it.
HANDSHAKE_REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass
class EventCounts:
    batches: int = 0  # applied, live or replayed
    # The first live batch: the service publishes batch 0 (AllBlocksCleared) as it starts, so a
    # subscriber joins late and replays what came before. None until one arrives.
    joined_at: int | None = None
    gaps: int = 0  # later live batches that arrived past the next expected one
    replayed: int = 0  # batches applied from a replay
    refusals: int = 0  # replay requests the publisher refused (asked again later)
    lost: int = 0  # batches skipped: neither received nor still held for replay
    roots_checked: int = 0  # blocks stored from a chain's root whose hashes a namespace gives
    anomalies: int = 0
    described: list[str] = field(default_factory=list)  # the first ANOMALIES_KEPT anomalies

    def anomaly(self, text: str) -> None:
        self.anomalies += 1
        if len(self.described) < ANOMALIES_KEPT:
            self.described.append(text)


class KVEventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *,
                 secret: str | None = None, topic: str = DEFAULT_TOPIC,
                 replay_timeout_s: float = 10.0,
                 namespaces: Iterable[bytes] | None = None) -> None:
        """Connect to ``endpoint`` (the PUB socket) and ``replay_endpoint`` (none: gaps are
        counted as lost); ``secret``: the events secret (none: a plain stream).
        ``replay_timeout_s`` bounds one replay, retries after refusals included. ``namespaces``
        (every namespace whose blocks the stream may carry; ``b""`` for a stream of hashes over
        content alone): check the hashes of blocks stored from a root (none: no check)."""
        self._namespaces = None if namespaces is None else list(namespaces)
        self._context = zmq.Context()
        self._secret = secret
        self._topic = topic.encode()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._monitors: list[zmq.Socket] = []
        self._sub = self._socket(zmq.SUB, endpoint, monitored=True)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._replay = (self._socket(zmq.DEALER, replay_endpoint, monitored=True)
                        if replay_endpoint else None)
        self.cached: set[int] = set()
        self.last_seq = -1
        self.counts = EventCounts()

    def _socket(self, kind: int, endpoint: str, monitored: bool = False) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.linger = 0
        if self._secret is not None:
            authenticate_subscriber(socket, self._secret)
        if monitored:  # before connecting, or the handshake's end may come unseen
            events = zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_REFUSED
            self._monitors.append(socket.get_monitor_socket(events))
        socket.connect(endpoint)
        return socket

    def wait_connected(self, timeout_s: float) -> None:
        """Return once every socket completed its handshake with the publisher; raise
        `HandshakeFailed` if one was refused or none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for monitor in self._monitors:
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not monitor.poll(left_ms):
                    raise HandshakeFailed(f"no handshake with the KV event sockets within "
                                          f"{timeout_s:g}s: is the service publishing there?")
                event = recv_monitor_message(monitor)["event"]
                if event & HANDSHAKE_REFUSED:
                    raise HandshakeFailed("the KV event sockets refused the handshake: the "
                                          "subscriber needs the events secret")
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    break

    def receive(self, timeout_ms: int) -> bool:
        """Apply the next live batch (after replaying a gap before it); False when none came
        within ``timeout_ms``."""
        if not self._sub.poll(timeout_ms):
            return False
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or frames[0] != self._topic or len(frames[1]) != SEQ_BYTES:
            self.counts.anomaly(f"a live message of {len(frames)} frames that is not "
                                f"[topic, seq, payload] (after batch {self.last_seq})")
            return True
        seq = int.from_bytes(frames[1], "big")
        if self.counts.joined_at is None:
            self.counts.joined_at = seq
        elif seq > self.last_seq + 1:
            self.counts.gaps += 1
        if seq > self.last_seq + 1:
            self.counts.replayed += self._replay_from(self.last_seq + 1)
        self._take(seq, frames[2])
        return True

    def catch_up(self) -> int:
        """Replay everything published after the last batch applied: once the publisher is
        quiet, the view is then complete whatever the live socket still holds. The number of
        batches it applied."""
        return self._replay_from(self.last_seq + 1)

    def close(self) -> None:
        """Close the sockets; ``cached`` and ``counts`` stay readable."""
        for socket in (*self._monitors, self._sub, self._replay):
            if socket is not None:
                socket.close()
        self._context.term()

    def _take(self, seq: int, payload: bytes) -> bool:
        """Apply batch ``seq`` unless it was applied already; what lies between is lost."""
        if seq <= self.last_seq:
            return False
        self.counts.lost += seq - self.last_seq - 1
        self.last_seq = seq
        self.counts.batches += 1
        self._apply(seq, payload)
        return True

    def _replay_from(self, first: int) -> int:
        """Ask for every buffered batch from ``first`` on and apply them; the number applied.
        A refusal (the publisher's rate bound) is asked again after a token's worth of time."""
        if self._replay is None:
            return 0
        deadline = time.monotonic() + self._replay_timeout_s
        self._replay.send_multipart([b"", first.to_bytes(SEQ_BYTES, "big")])
        applied = 0
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if not self._replay.poll(left_ms):
                break
            frames = self._replay.recv_multipart()
            marker = frames[1] if len(frames) == 3 else b""
            if marker == END_OF_REPLAY:
                return applied
            if marker == REPLAY_REFUSED:
                self.counts.refusals += 1
                time.sleep(1 / DEFAULT_REPLAY_RATE)
                self._replay.send_multipart([b"", first.to_bytes(SEQ_BYTES, "big")])
            elif len(marker) == SEQ_BYTES:
                applied += self._take(int.from_bytes(marker, "big"), frames[2])
            else:
                self.counts.anomaly(f"a replay message of {len(frames)} frames that is not "
                                    "[empty, seq, payload]")
        self.counts.anomaly(f"no end of the replay from batch {first} within "
                            f"{self._replay_timeout_s:g}s")
        self._reconnect_replay()  # its late answers must not end the next replay early
        return applied

    def _reconnect_replay(self) -> None:
        assert self._replay is not None and self._replay_endpoint is not None
        self._replay.close()
        self._replay = self._socket(zmq.DEALER, self._replay_endpoint)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            self.counts.anomaly(f"batch {seq} is no KVEventBatch: {exc}")
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(seq, event)
            elif isinstance(event, BlockRemoved):
                self._remove(seq, event)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.cached.clear()

    def _store(self, seq: int, event: BlockStored) -> None:
        parent = event.parent_block_hash
        if parent is not None and parent not in self.cached:
            self.counts.anomaly(f"batch {seq}: BlockStored under parent {parent:#x}, not cached")
        if parent is None and self._namespaces is not None:
            self._check_root(seq, event)
        again = self.cached.intersection(event.block_hashes)
        if again:
            self.counts.anomaly(f"batch {seq}: BlockStored of {len(again)} hashes cached "
                                "already")
        self.cached.update(event.block_hashes)

    def _remove(self, seq: int, event: BlockRemoved) -> None:
        unknown = set(event.block_hashes) - self.cached
        if unknown:
            self.counts.anomaly(f"batch {seq}: BlockRemoved of {len(unknown)} hashes never "
                                "stored")
        self.cached.difference_update(event.block_hashes)

    def _check_root(self, seq: int, event: BlockStored) -> None:
        tokens = np.asarray(event.token_ids, dtype=np.int64)
        for namespace in self._namespaces or []:
            if router_hashes(tokens, event.block_size, namespace=namespace) == event.block_hashes:
                self.counts.roots_checked += 1
                return
        self.counts.anomaly(f"batch {seq}: BlockStored from the root whose hashes no known "
                            "namespace gives")
