"""A windowed pool (`PoolConfig.window`) through the service core: the registration says so,
the released columns (-2) reach every copy of the table, a detached worker's deltas (through
both wire encodings) and every shard's mirror, the warm-up runs it, and the combinations it
cannot serve are refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepResult
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.service.warmup import warm_up
from named_worker import NamedWorker
from pydantic import ValidationError

WINDOW = 8


def windowed(**overrides: object) -> PoolConfig:
    return PoolConfig(**{"num_blocks": 96, "tokens_per_block": 4, "num_layers": 1,
                         "num_kv_heads": 2, "head_dim": 8, "device": "cpu",
                         "max_batch_size": 8, "max_seq_len": 120, "max_draft_len": 3,
                         "overlap_scheduler": True, "window": WINDOW, **overrides})


def through_the_wire(reply: StepResult) -> list[StepResult]:
    """``reply`` as IPC's msgpack and REST's JSON carry it, decoded with their bounds."""
    return [StepResult.from_wire(wire.decode(wire.encode_msgpack(reply.to_wire(True)),
                                             wire.StepReplyBinary)),
            StepResult.from_wire(wire.decode(wire.encode_json(reply.to_wire(False)),
                                             wire.StepReply, "json"))]


def test_the_registration_names_the_window() -> None:
    for pool, window in ((windowed(), WINDOW), (windowed(window=None), None)):
        core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=64))
        try:
            layout = Client.in_process(core, worker_id="w").register().layout
            assert layout.window == window
            assert wire.decode(wire.encode_json(layout), wire.PoolLayout, "json") == layout
        finally:
            core.close()
    without = {k: v for k, v in wire.msgspec.structs.asdict(layout).items() if k != "window"}
    assert wire.decode(wire.encode_json(without), wire.PoolLayout, "json").window is None


def test_a_detached_worker_replays_the_released_columns_from_the_replies() -> None:
    """Requests that live up to 20 steps of 1 + 3 tokens slide past their window of 8: the
    deltas carry RELEASED through both encodings and replay to the service's table, and a
    verify finds every invariant."""
    core = ServiceCore(ServiceConfig(pool=windowed(), max_step_tokens=64))
    try:
        client = Client.in_process(core, worker_id="w")
        client.register(attach=False)
        w = NamedWorker(client)
        mirror = np.full(core.manager.table.host.shape, -1, dtype=np.int64)
        rng = np.random.default_rng(0)
        born: dict[str, int] = {}
        ran: set[str] = set()
        for step in range(60):
            done = [r for r, t in born.items() if rng.random() < 0.05 or step - t > 20]
            keep = [r for r in born if r not in done]
            new = {f"r{step}": int(rng.integers(1, 20))} if len(keep) < 6 else {}
            reply = w.step(results={r: int(rng.integers(0, 4)) for r in ran if r in keep},
                           finished=done, grants={r: 3 for r in keep}, new=new)
            for carried in through_the_wire(reply):
                assert carried.tables == reply.tables
            reply.tables.apply(mirror)
            assert (mirror == core.manager.table.host).all(), step
            ran = {name for name, *_ in w.scheduled(reply)} & set(keep)
            admitted = {w.name(h) for h in reply.admitted.tolist() if h >= 0}
            born = {r: born[r] for r in keep} | {r: step for r in new if r in admitted}
        assert (mirror == RELEASED).any()
        assert core.get_pool(wire.PoolQuery(verify=True)).invariants == "ok"
    finally:
        core.close()


def test_every_shard_reads_the_released_columns() -> None:
    """Two shards of one windowed pool: each shard's copy of the table is the host's."""
    core = ServiceCore(ServiceConfig(pool=windowed(), max_step_tokens=64,
                                     devices=["cpu", "cpu"], tensor_parallel=2))
    try:
        w = NamedWorker(Client.in_process(core, worker_id="w"))
        w.client.register()
        w.step(new={"a": 30})
        for _ in range(5):
            w.step(grants={"a": 3})
            w.step(results={"a": 3})
        assert (core.manager.table.host == RELEASED).any()
        for shard in core.pool.shards:
            assert (shard.table.numpy() == core.manager.table.host).all()
    finally:
        core.close()


def test_the_warm_up_runs_a_windowed_pool() -> None:
    assert warm_up(ServiceConfig(pool=windowed(), max_step_tokens=64)) > 0


@pytest.mark.parametrize("cache", [
    {"prefix_caching": True},
    {"prefix_caching": True, "host_tier_bytes": 1 << 20},
    {"prefix_caching": True, "kv_events": "inproc://windowed-events"}])
def test_a_windowed_pool_keeps_no_prefix_cache(cache: dict) -> None:
    with pytest.raises(ValidationError, match="prefix_caching: a windowed pool"):
        ServiceConfig(pool=windowed(), max_step_tokens=64, **cache)
