"""A windowed pool (`PoolConfig.window`) through the service core: the registration says so,
the released columns (-2) reach every copy of the table, a detached worker's deltas (through
both wire encodings) and every shard's mirror, the warm-up runs it, its prefix cache parks
the cached blocks its windows pass, and a host tier is refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.allocator.capacity.kv_events import router_hashes
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepResult
from kvalloc.server.contract.routing import worker_salt
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.service.warmup import warm_up
from named_worker import NamedWorker
from pydantic import ValidationError
from service_harness import replayed_events, stage_pattern

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


def test_a_windowed_pool_keeps_no_host_tier() -> None:
    with pytest.raises(ValidationError, match="host_tier_bytes: a windowed pool"):
        ServiceConfig(pool=windowed(), max_step_tokens=64, prefix_caching=True,
                      host_tier_bytes=1 << 20)


@pytest.mark.parametrize(("overlap", "first_hit"), [(False, 2), (True, 3)])
def test_a_prompt_is_a_hit_from_the_same_call_in_a_windowed_pool_as_in_a_full_one(
        overlap: bool, first_hit: int) -> None:
    """"a"'s 24-token prompt registers after the step of the call that settles its prefill
    (the next call's, or an overlap worker's the call after), once it is written; a windowed
    pool's window passes columns 0..3 before that and keeps them until they register. The
    same prompt asked again in every later call first hits (20 tokens) in the same call,
    whatever the pool's attention."""
    ids = np.arange(700, 724)
    for window in (WINDOW, None):
        core = ServiceCore(ServiceConfig(pool=windowed(window=window), max_step_tokens=64,
                                         prefix_caching=True))
        try:
            kv = Client.in_process(core, worker_id="w")
            kv.register(overlap=overlap)
            kv.step(new=(["a"], [24]), prompt_token_ids=ids)
            hits = [int(kv.step(new=([f"b{k}"], [24]), prompt_token_ids=ids).cached_tokens[0])
                    for k in range(1, 4)]
            assert hits == [0] * (first_hit - 1) + [20] * (4 - first_hit), window
            assert core.get_pool(wire.PoolQuery(verify=True)).invariants == "ok"
        finally:
            core.close()


def test_a_windowed_prefix_is_cached_parked_and_hit_with_its_window_alone(zmq_context) -> None:
    """"a"'s 24-token prompt registers after the step that settles it, once the commit wrote
    it, as in a full pool; that step's window (its decode at 24 reads 17..24) keeps the first
    four columns until then, and the next step releases them, parked. Once "a" finishes all
    its prompt blocks are parked, still cached and protected, and no BlockRemoved goes out.
    "c" shares 20 tokens: its hit needs only the blocks covering 13..20, so its columns 0..2
    start released."""
    core = ServiceCore(ServiceConfig(
        pool=windowed(), max_step_tokens=64, prefix_caching=True,
        kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*",
        kv_events_plaintext=True))
    replay = zmq_context.socket(zmq.DEALER)
    try:
        replay.connect(core.kv_events.endpoints()[""].replay)
        kv = Client.in_process(core, worker_id="w")
        kv.register()
        ids = np.arange(700, 724)
        first = kv.step(new=(["a"], [24]), prompt_token_ids=ids)
        stage_pattern(kv.pool.staging, 24, tag=1)
        kv.step(grants=(first.admitted, [0]))  # commits the prompt, which registers
        assert RELEASED not in kv.get_request("a").block_ids[:4]
        assert len(core.manager.cache.hash_of) == 6
        kv.step(results=(first.admitted, [0]), grants=(first.admitted, [0]))
        assert kv.get_request("a").block_ids[:4] == [RELEASED] * 4
        assert core.manager.pool.num_parked == 4
        kv.step(finished=first.admitted)
        assert core.manager.pool.num_parked == 6
        again = kv.step(new=(["c"], [23]), prompt_token_ids=np.concatenate([ids[:20], [9] * 3]))
        assert again.cached_tokens.tolist() == [20]
        row_c = int(again.scheduled.rows[0])
        assert core.manager.table.host[row_c, :3].tolist() == [RELEASED] * 3
        assert (core.pool.storage.kv[:, :, core.manager.table.host[row_c, 3:5]][..., 0]
                == 1).all()  # "a"'s prompt, written by the commit
        protected = core.pool.committer.protected
        assert protected is not None and protected.sum() == 6
        assert (protected.numpy() == core.manager.cache.protected).all()
        events = replayed_events(replay)
        assert [e["type"] for e in events] == ["AllBlocksCleared", "BlockStored"]
        assert events[1]["block_hashes"] == router_hashes(
            ids, 4, namespace=worker_salt("w", {}))
        assert core.get_pool(wire.PoolQuery(verify=True)).invariants == "ok"
    finally:
        replay.close(linger=0)
        core.close()


def test_the_commit_never_writes_a_column_its_settling_step_gave_back() -> None:
    """A 20-token prompt in a window of 8: the call that settles its prefill gives back the
    columns behind the window (positions 0-11) before it commits the prompt's K/V, and those
    blocks are free, maybe already another row's: the commit writes only the columns the row
    still holds."""
    core = ServiceCore(ServiceConfig(pool=windowed(), max_step_tokens=64))
    try:
        client = Client.in_process(core, worker_id="w")
        client.register()
        w = NamedWorker(client)
        w.pool.kv.fill_(float("nan"))
        w.step(new={"r": 20})
        blocks = w.pool.block_table[0, :5].tolist()
        stage_pattern(w.pool.staging, 20, tag=1)
        w.step(grants={"r": 3})
        given_back = w.pool.block_table[0, :5] == RELEASED
        assert given_back.tolist() == [True, True, True, False, False]
        for column, block in enumerate(blocks):
            written = not w.pool.kv[:, :, block].isnan().any()
            assert written == (not given_back[column]), (column, block)
    finally:
        core.close()
