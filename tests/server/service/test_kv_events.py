"""KV events on real ZeroMQ sockets, read by a subscriber that knows only vLLM's published wire
shape (raw msgpack: ``[ts, [event, ...], rank]``, each event an array tagged by its class name;
three frames ``topic, seq (8 bytes big-endian), payload``; replay ``[b"", start]`` ->
``[b"", seq, payload]`` ... ``[b"", -1, b""]``). It rebuilds the set of cached block hashes,
which must equal the manager's, including after it was dropped and filled the gap by replay."""

from __future__ import annotations

import time

import numpy as np
from kv_event_subscriber import Subscriber

from allocator import KVCacheManager, PoolConfig, StepPlan
from allocator.capacity.kv_events import external_hash
from server.service.event_publisher import KVEventPublisher


def test_a_subscriber_rebuilds_the_cached_set_and_replay_fills_a_gap():
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="cpu", num_blocks=40,
                     tokens_per_block=4, max_seq_len=64, max_draft_len=2, max_batch_size=6)
    manager = KVCacheManager(cfg, prefix_caching=True, kv_events=True)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    sub = Subscriber(publisher.endpoint, publisher.replay_endpoint)
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
            publisher.publish(manager.drain_kv_events())

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
    assert sub.cached == {external_hash(h) for h in manager.cache.block_of}
