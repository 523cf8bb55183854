"""KV events on real ZeroMQ sockets, read by a subscriber that knows only vLLM's published wire
shape (raw msgpack: ``[ts, [event, ...], rank]``, each event a map tagged ``"type"``; three
frames ``topic, seq (8 bytes big-endian), payload``; replay ``[b"", start]`` -> ``[b"", seq,
payload]`` ... ``[b"", -1, b""]``). It rebuilds the set of cached block hashes, which must equal
the manager's, including after it was dropped and filled the gap by replay. With the events
secret, TCP sockets admit only subscribers holding it (CURVE), and replay requests are bounded in
size, shape and rate, each refusal typed."""

from __future__ import annotations

import time

import numpy as np
import zmq
from event_stream import OneStream
from kv_event_subscriber import HANDSHAKE_FAILURES, Subscriber, handshake, watch
from kvalloc.allocator import KVCacheManager, PoolConfig, StepPlan
from kvalloc.allocator.capacity.kv_events import AllBlocksCleared
from kvalloc.server.contract.routing import authenticate_subscriber
from kvalloc.server.service.events.stream import END_OF_REPLAY, REPLAY_REFUSED, ReplayBudget


def test_a_subscriber_rebuilds_the_cached_set_and_replay_fills_a_gap(zmq_context):
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="cpu", num_blocks=40,
                     tokens_per_block=4, max_seq_len=64, max_draft_len=2, max_batch_size=6)
    manager = KVCacheManager(cfg, prefix_caching=True, kv_events=True)
    publisher = OneStream()
    sub = Subscriber(zmq_context, publisher.endpoint, publisher.replay_endpoint)
    time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
    rng = np.random.default_rng(3)
    system = rng.integers(0, 1000, 24)

    def run_steps(n: int) -> None:
        for _ in range(n):
            live = manager.live_rows
            finished = live[: rng.integers(0, 2)] if live.size > 3 else live[:0]
            tokens = np.concatenate([system[: rng.integers(4, 25)], rng.integers(0, 1000, 8)])
            manager.step(StepPlan(finished_rows=finished, prompt_lens=[tokens.size],
                                  prompt_tokens=[tokens]))
            publisher.publish([e.event for e in manager.drain_kv_events()])

    run_steps(15)
    while sub.receive(500):
        pass
    sub.drop()
    run_steps(15)  # published while the subscriber is gone
    time.sleep(0.3)
    sub.connect()
    time.sleep(0.3)
    run_steps(15)
    while sub.receive(1000):
        pass
    publisher.close()
    assert manager.counters.evicted_blocks > 0 and manager.counters.prefix_hit_tokens > 0
    assert sub.replayed > 0
    assert sub.cached == {origin.route for origin in manager.cache.origin.values()}


SECRET = "the-events-secret"
# Handshakes on loopback take about a millisecond; a loaded two-core machine may take far longer.
HANDSHAKE_MS = 10_000


def secured_publisher(**form: object) -> OneStream:
    return OneStream(SECRET, **form)


def connect(context: zmq.Context, kind: int, endpoint: str,
            secret: str | None) -> tuple[zmq.Socket, zmq.Socket]:
    socket = context.socket(kind)
    if secret is not None:
        authenticate_subscriber(socket, secret)
    monitor = watch(socket)
    if kind == zmq.SUB:
        socket.subscribe(b"")
    socket.connect(endpoint)
    return socket, monitor


def test_only_a_subscriber_holding_the_events_secret_completes_a_handshake(zmq_context):
    publisher = secured_publisher()
    sockets = []
    try:
        outcomes = {}
        for name, secret in [("holder", SECRET), ("another secret", "guessed"), ("no CURVE", None)]:
            for kind, endpoint in [(zmq.SUB, publisher.endpoint),
                                   (zmq.DEALER, publisher.replay_endpoint)]:
                socket, monitor = connect(zmq_context, kind, endpoint, secret)
                sockets += [socket, monitor]
                outcomes[name, kind] = handshake(monitor, HANDSHAKE_MS)
        assert {k: v for k, v in outcomes.items() if k[0] == "holder"} == {
            ("holder", zmq.SUB): zmq.EVENT_HANDSHAKE_SUCCEEDED,
            ("holder", zmq.DEALER): zmq.EVENT_HANDSHAKE_SUCCEEDED}
        assert all(v in HANDSHAKE_FAILURES for k, v in outcomes.items() if k[0] != "holder")
        holder = sockets[0]
        publisher.publish([AllBlocksCleared()])
        assert holder.poll(HANDSHAKE_MS) and holder.recv_multipart()[0] == b"kv-events"
    finally:
        for socket in sockets:
            socket.close(linger=0)
        publisher.close()


def replay(socket: zmq.Socket, *frames: bytes) -> list[bytes]:
    socket.send_multipart([b"", *frames])
    assert socket.poll(HANDSHAKE_MS)
    return socket.recv_multipart()


def test_replay_requests_are_bounded_in_size_shape_and_rate(zmq_context):
    publisher = secured_publisher(replay_rate=3)
    dealer, monitor = connect(zmq_context, zmq.DEALER, publisher.replay_endpoint, SECRET)
    try:
        assert handshake(monitor, HANDSHAKE_MS) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        start = (0).to_bytes(8, "big")
        refused = REPLAY_REFUSED
        assert replay(dealer, b"xx")[1:] == [refused, b"a replay request is two frames: empty, "
                                             b"then the first sequence number wanted (8 bytes, "
                                             b"big-endian)"]
        assert replay(dealer, start, b"more")[1] == refused
        # A burst: the bucket holds 3, and refills 3 a second while the burst is answered.
        began = time.monotonic()
        answers = [replay(dealer, start)[1] for _ in range(12)]
        elapsed = time.monotonic() - began
        assert answers[:3] == [END_OF_REPLAY] * 3
        assert refused in answers
        assert answers.count(END_OF_REPLAY) <= 3 + int(3 * elapsed) + 1
        # A message past the bound costs its sender the connection, before ZeroMQ buffers it.
        dealer.send_multipart([b"", b"x" * (1 << 20)])
        assert handshake(monitor, HANDSHAKE_MS) == zmq.EVENT_DISCONNECTED
    finally:
        dealer.close(linger=0)
        monitor.close(linger=0)
        publisher.close()


def test_the_replay_budget_refills_at_its_rate_and_holds_one_second_of_it():
    now = [0.0]
    budget = ReplayBudget(4, clock=lambda: now[0])
    assert [budget.take() for _ in range(5)] == [True] * 4 + [False]
    now[0] += 0.5  # two more
    assert [budget.take() for _ in range(3)] == [True, True, False]
    now[0] += 60  # idle for long: still four at most
    assert sum(budget.take() for _ in range(10)) == 4
    slow = ReplayBudget(0.5, clock=lambda: now[0])
    assert [slow.take(), slow.take()] == [True, False]
    now[0] += 2
    assert slow.take()
