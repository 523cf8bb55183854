"""`KVEventPublisher`: the manager's KV events on ZeroMQ, as vLLM publishes them.

Every step that cached or evicted blocks becomes one msgpack
`allocator.capacity.kv_events.KVEventBatch`, sent on a PUB socket as three frames: the topic, an
8-byte big-endian sequence number (0, 1, ...) and the payload. A subscriber that sees a gap in the
sequence asks the replay socket (ROUTER) for everything from a sequence number on: it sends ``[b"",
start (8 bytes, big-endian)]`` (a REQ or DEALER socket) and receives ``[b"", seq, payload]`` for
each batch still buffered, then ``[b"", -1 (8 bytes, signed), b""]``. The first batch is
``AllBlocksCleared``: a new service (a new epoch) starts with an empty cache.

With a ``token`` both sockets are CURVE servers (`server.contract.routing.curve_keys`) that admit
the subscriber key alone: whoever lacks the token completes no handshake and reads nothing.
Replays are bounded: a request larger than ``PEER_MESSAGE_BYTES`` drops its connection (ZeroMQ
never buffers it), one of another shape, or beyond ``replay_rate`` a second, is answered
``[b"", -2 (8 bytes, signed), reason]`` and nothing else.

The sockets live on one background thread (ZeroMQ sockets are not thread-safe); ``publish`` only
hands the events over, so a step never waits on the network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq
from kvalloc.allocator import KVCacheEvent, KVEventBatch
from kvalloc.server.contract.routing import curve_keys
from pydantic import SecretStr
from zmq.auth.thread import ThreadAuthenticator

DEFAULT_TOPIC = "kv-events"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_REFUSED = (-2).to_bytes(8, "big", signed=True)
# A replay request is [b"", start], a subscription the topic: far less. The bound holds for the
# handshake too, whose CURVE messages take a few hundred bytes.
PEER_MESSAGE_BYTES = 1024
REPLAY_FRAMES = 2
DEFAULT_REPLAY_RATE = 10.0


class _SubscriberKey:
    """The ZAP check of a CURVE client: its public key is the subscriber key."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


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


class KVEventPublisher:
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str = DEFAULT_TOPIC, buffer_batches: int = 10_000,
                 data_parallel_rank: int | None = None, token: SecretStr | None = None,
                 replay_rate: float = DEFAULT_REPLAY_RATE) -> None:
        """Bind ``endpoint`` (PUB) and ``replay_endpoint`` (ROUTER) now, so a bad address fails
        at start; ``buffer_batches`` bounds what a replay can still return; ``token``: only
        subscribers holding it connect (none: anyone who reaches the endpoints)."""
        self._context = zmq.Context()
        self._auth = self._authenticator(token)
        self._pub = self._context.socket(zmq.PUB)
        self._replay = self._context.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            for socket in (self._pub, self._replay):
                if socket is not None:
                    self._secure(socket, token)
            self._pub.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._budget = ReplayBudget(replay_rate)
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

    def _authenticator(self, token: SecretStr | None) -> ThreadAuthenticator | None:
        """ZeroMQ's ZAP handler on this context, admitting the subscriber key alone."""
        if token is None:
            return None
        auth = ThreadAuthenticator(self._context)
        auth.start()
        subscriber = curve_keys(token.get_secret_value()).subscriber_public
        auth.configure_curve_callback("*", credentials_provider=_SubscriberKey(subscriber))
        return auth

    @staticmethod
    def _secure(socket: zmq.Socket, token: SecretStr | None) -> None:
        # A peer's message above the bound drops its connection before ZeroMQ buffers it.
        socket.maxmsgsize = PEER_MESSAGE_BYTES
        if token is not None:
            keys = curve_keys(token.get_secret_value())
            socket.curve_server = True
            socket.curve_secretkey = keys.server_secret
            socket.curve_publickey = keys.server_public

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
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _request(self) -> list[bytes]:
        """The peer's identity and the first frames of its message, the rest discarded: a
        request of many frames costs no more memory than one of three."""
        frames = [self._replay.recv()]
        while self._replay.rcvmore:
            frame = self._replay.recv()
            if len(frames) <= REPLAY_FRAMES + 1:
                frames.append(frame)
        return frames

    def _refuse(self, identity: bytes, reason: str) -> None:
        self._replay.send_multipart((identity, b"", REPLAY_REFUSED, reason.encode()))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=1000)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
