"""Prefix caching through the service: a prompt sent with token ids reuses the blocks of a
cached prefix once the commit wrote them, the reply says how many prompt tokens are already in
the pool and schedules the rest from there, cached blocks keep their K/V while other requests
decode next to them, and the KV events a router would read go out on a real ZeroMQ socket."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.capacity.kv_events import router_hashes
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import RemoteError
from kvalloc.server.contract.routing import worker_salt
from kvalloc.server.devtools.loadgen import SimulatedWorker, Workload, drive
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from service_harness import replayed_events, stage_pattern

SYSTEM = np.arange(700, 716)  # four full blocks of 4 tokens


def make_core(num_blocks: int = 64, **service: object) -> ServiceCore:
    pool = PoolConfig(num_layers=2, num_kv_heads=2, head_dim=8, device="cpu",
                      num_blocks=num_blocks,
                      tokens_per_block=4, max_seq_len=64, max_draft_len=2, max_batch_size=8)
    return ServiceCore(ServiceConfig(pool=pool, max_step_tokens=64, prefix_caching=True,
                                     **service))


def blocks_of(core: ServiceCore, row: int, n: int) -> list[int]:
    return core.manager.table.host[row, :n].tolist()


def test_a_prompt_reuses_a_written_prefix_and_is_scheduled_past_it():
    core = make_core()
    try:
        kv = Client.in_process(core, worker_id="w")
        kv.register()
        staging = kv.pool.staging
        first = kv.step(new=(["a"], [20]), prompt_token_ids=np.concatenate([SYSTEM, [1] * 4]))
        assert first.cached_tokens.tolist() == [0]
        stage_pattern(staging, 20, tag=1)  # "a"'s prefill forward
        # Scheduled, not yet written: "b" cannot share it in the step that commits it.
        second = kv.step(new=(["b"], [18]), prompt_token_ids=np.concatenate([SYSTEM, [2, 2]]))
        assert second.cached_tokens.tolist() == [0]
        stage_pattern(staging, 18, tag=2)
        third = kv.step(new=(["c"], [19]), prompt_token_ids=np.concatenate([SYSTEM, [3] * 3]))
        assert third.cached_tokens.tolist() == [16]
        s = third.scheduled
        assert (s.start_positions.tolist(), s.num_tokens.tolist()) == ([16], [3])
        row_a, row_c = first.scheduled.rows[0], s.rows[0]
        shared = blocks_of(core, row_a, 4)
        assert blocks_of(core, row_c, 4) == shared
        kv_pool = core.pool.storage.kv  # [L, 2, blocks, tpb, H, D]
        before = kv_pool[:, :, shared].clone()
        assert (before[..., 0] == 1).all()  # "a"'s prefill, written by the commit
        stage_pattern(staging, 3, tag=3)
        kv.step(grants=(third.admitted, [2]))  # commits "c"'s 3 prefill tokens
        assert torch.equal(kv_pool[:, :, shared], before)
        assert core.pool.committer.writes.metrics().protected_refusals == 0
        assert core.manager.counters.prefix_hit_tokens == 16
    finally:
        core.close()


def test_token_ids_that_do_not_cover_the_prompts_are_refused():
    core = make_core()
    try:
        kv = Client.in_process(core, worker_id="w")
        kv.register()
        with pytest.raises(RemoteError, match="prompt_token_ids"):
            kv.step(new=(["a", "b"], [4, 4]), prompt_token_ids=[1, 2, 3, 4])
        assert core.manager.num_requests == 0
    finally:
        core.close()


def test_the_service_publishes_kv_events_a_router_can_read(zmq_context):
    core = make_core(kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*",
                     kv_events_plaintext=True)
    replay = zmq_context.socket(zmq.DEALER)
    try:
        replay.connect(core.kv_events.endpoints()[""].replay)
        kv = Client.in_process(core, worker_id="w")
        kv.register()
        first = kv.step(new=(["a"], [20]),
                        prompt_token_ids=np.concatenate([SYSTEM, [1] * 4]))
        kv.step()  # the commit writes "a"'s prompt: its five blocks are stored
        events = replayed_events(replay)  # a router that joins late asks from the start
        assert events[0] == {"type": "AllBlocksCleared"}
        stored = [e for e in events if e["type"] == "BlockStored"]
        hashes = [h for e in stored for h in e["block_hashes"]]
        prompt = core.manager.cache.prompts[int(first.scheduled.rows[0])]
        assert hashes == router_hashes(prompt.tokens, 4, namespace=worker_salt("w", {}))
        assert [t for e in stored for t in e["token_ids"]] == prompt.tokens.tolist()
    finally:
        replay.close(linger=0)
        core.close()


def test_an_evicted_block_is_writable_by_its_next_owner_in_the_next_commit():
    """The device mask forgets an evicted block before the commit that writes its new content,
    even when the step that evicted it committed nothing (a worker's first call)."""
    core = make_core(num_blocks=20)
    try:
        one = Client.in_process(core, worker_id="one")
        one.register()
        first = one.step(new=(["a"], [32]), prompt_token_ids=np.arange(32))
        stage_pattern(one.pool.staging, 32, tag=1)
        one.step()  # "a"'s prompt written: 8 cached blocks
        one.step(finished=first.admitted)  # parked
        assert core.manager.pool.num_parked == 8
        two = Client.in_process(core, worker_id="two")
        two.register()
        big = two.step(new=(["b"], [60]))  # 15 blocks: 12 free, 3 evicted
        assert core.manager.counters.evicted_blocks == 3
        stage_pattern(two.pool.staging, 60, tag=2)
        two.step()
        assert core.pool.committer.writes.metrics().protected_refusals == 0
        row = int(big.scheduled.rows[0])
        blocks = core.manager.table.host[row, :15].tolist()
        assert (core.pool.storage.kv[:, :, blocks][..., 0] == 2).all()
    finally:
        core.close()


def test_loadgen_shares_a_system_prompt_under_block_pressure_without_a_protocol_error():
    core = make_core(num_blocks=48)
    try:
        worker = SimulatedWorker(Workload(draft_len=2, arrival_rate=1.0, prompt_len=(1, 12),
                                          output_len=(4, 16), shared_prefix=24),
                                 max_draft_len=2, max_step_tokens=64)
        client = Client.in_process(core, worker_id="loadgen")
        client.register(attach=False)
        report = drive(client, worker, steps=300, duration_s=None, step_interval_s=0,
                       progress=False)
        assert report.errors == {}
        assert worker.stats["cached_tokens"] > worker.stats["prompt_tokens"] // 3
        assert core.manager.counters.prefix_hit_tokens == worker.stats["cached_tokens"]
        assert core.manager.counters.evicted_blocks > 0, "the pool ran short of free blocks"
        core.manager.check_invariants()
        worker.w = Workload(arrival_rate=0.0, output_len=(4, 16))
        drive(client, worker, steps=200, duration_s=None, step_interval_s=0, progress=False)
        pool = core.manager.pool
        assert not worker.live and pool.num_free + pool.num_parked == pool.num_blocks
    finally:
        core.close()
