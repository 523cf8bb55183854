"""`EventStream`: one stream of KV events, as vLLM publishes them: a PUB socket and a replay
socket with their own sequence numbers.

Every batch is one msgpack `allocator.capacity.kv_events.KVEventBatch`, sent on the PUB socket as
three frames: the topic, an 8-byte big-endian sequence number (0, 1, ...) and the payload. A
subscriber that sees a gap asks the replay socket (ROUTER) for everything from a sequence number
on: it sends ``[b"", start (8 bytes, big-endian)]`` (a REQ or DEALER socket) and receives ``[b"",
seq, payload]`` for each batch still buffered, then ``[b"", -1 (8 bytes, signed), b""]``. Batch 0
is ``AllBlocksCleared`` followed by what the stream's engine already holds: a subscriber that
starts from it holds what the service does.

Replays are bounded: a request larger than ``PEER_MESSAGE_BYTES`` drops its connection (ZeroMQ
never buffers it), one of another shape, or beyond ``replay_rate`` a second, is answered ``[b"",
-2 (8 bytes, signed), reason]`` and nothing else.

A stream's sockets are used on the sender's thread alone (`server.service.events.sender`):
ZeroMQ sockets are not thread-safe.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from kvalloc.allocator import KVCacheEvent, WireShape, encode_batch, event_encoder

DEFAULT_TOPIC = "kv-events"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_REFUSED = (-2).to_bytes(8, "big", signed=True)
# A replay request is [b"", start], a subscription the topic: far less. The bound holds for the
# handshake too, whose CURVE messages take a few hundred bytes.
PEER_MESSAGE_BYTES = 1024
REPLAY_FRAMES = 2
DEFAULT_REPLAY_RATE = 10.0


class ReplayBudget:
    """A token bucket: ``rate`` (above 0) replays a second, a second's worth at once at most
    (one at least, so a rate below one a second still answers)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.burst = max(1.0, rate)
        self.tokens, self.last = self.burst, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass(frozen=True)
class StreamFormat:
    """What every stream of a service shares: its topic, wire shape, rank and bounds."""

    topic: str = DEFAULT_TOPIC
    shape: WireShape = WireShape.MAPS
    data_parallel_rank: int | None = None
    buffer_batches: int = 10_000
    replay_rate: float = DEFAULT_REPLAY_RATE


class EventStream:
    def __init__(self, pub: zmq.Socket, replay: zmq.Socket | None, form: StreamFormat) -> None:
        """Over bound sockets; ``buffer_batches`` bounds what a replay can still return."""
        self.pub, self.replay, self.form = pub, replay, form
        self._topic = form.topic.encode()
        self._encoder = event_encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=form.buffer_batches)
        self._budget = ReplayBudget(form.replay_rate)
        self.next_seq = 0

    def send(self, events: list[KVCacheEvent]) -> None:
        payload = encode_batch(self._encoder, time.time(), events, self.form.data_parallel_rank,
                               self.form.shape)
        seq = self.next_seq
        self.next_seq += 1
        self.pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def answer_replay(self) -> None:
        """Answer the request waiting on the replay socket."""
        frames = self._request()
        identity = frames[0]
        if len(frames) != REPLAY_FRAMES + 1 or frames[1] or len(frames[2]) != 8:
            self._refuse(identity, "a replay request is two frames: empty, then the first "
                                   "sequence number wanted (8 bytes, big-endian)")
            return
        if not self._budget.take():
            self._refuse(identity, f"more than {self._budget.rate:g} replay requests a second; "
                                   "ask again later")
            return
        first = int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self.replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _request(self) -> list[bytes]:
        """The peer's identity and the first frames of its message, the rest discarded: a
        request of many frames costs no more memory than one of three."""
        frames = [self.replay.recv()]
        while self.replay.rcvmore:
            frame = self.replay.recv()
            if len(frames) <= REPLAY_FRAMES + 1:
                frames.append(frame)
        return frames

    def _refuse(self, identity: bytes, reason: str) -> None:
        self.replay.send_multipart((identity, b"", REPLAY_REFUSED, reason.encode()))

    def close(self) -> None:
        for socket in (self.pub, self.replay):
            if socket is not None:
                socket.close(linger=1000)
