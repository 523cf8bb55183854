"""A grouped pool (`ServiceConfig.groups`) through the service core: a worker attaches a pool,
a block table and a staging buffer per group (the fences are the pool's), the service's commit
writes exactly the accepted tokens into each group's pool at the slots of that group's own
table, a windowed group gives its blocks back while the full group keeps them, every drop and
every invariant check covers every group, the shared tables are repaired per group, and a worker
that does not attach is refused naming ``attached``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from kvalloc.allocator import InvariantViolation, PoolConfig
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import RemoteError
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from service_harness import POISON, nwor_scenario, stage_pattern

WINDOW = 8
POOL = PoolConfig(num_blocks=64, tokens_per_block=4, num_layers=3, num_kv_heads=2, head_dim=8,
                  device="cpu", max_batch_size=8, max_seq_len=64, max_draft_len=3)
# The full group's layers are not contiguous: a group's layer i is the model's layers[i].
GROUPS = [{"name": "full", "layers": [0, 2], "num_blocks": 64},
          {"name": "sliding", "layers": [1], "window": WINDOW, "num_blocks": 24}]


@pytest.fixture
def core() -> Iterator[ServiceCore]:
    core = ServiceCore(ServiceConfig(pool=POOL, max_step_tokens=64, groups=GROUPS))
    yield core
    core.close()


def registered(core: ServiceCore, worker_id: str = "w", **kwargs: bool) -> Client:
    client = Client.in_process(core, worker_id=worker_id)
    client.register(**kwargs)
    return client


def test_a_worker_attaches_a_pool_a_table_and_a_staging_per_group(core: ServiceCore) -> None:
    kv = registered(core)
    reg, pool = kv.registration, kv.pool
    assert reg is not None and pool is not None
    assert [(g.name, g.layers, g.window, g.num_blocks) for g in reg.layout.groups] == [
        ("full", [0, 2], None, 64), ("sliding", [1], WINDOW, 24)]
    assert (reg.layout.num_blocks, reg.layout.window) == (64, None)  # group 0's
    described = reg.attachment.groups
    assert [(g.name, g.layers, g.window) for g in described] == [
        ("full", [0, 2], None), ("sliding", [1], WINDOW)]
    assert described[0].kv == reg.attachment.kv and described[0].staging == reg.attachment.staging
    assert [g.kv.shape for g in described] == [[2, 2, 64, 4, 2, 8], [1, 2, 24, 4, 2, 8]]
    full, sliding = pool.groups
    assert (full.layers, full.window, sliding.layers, sliding.window) == ((0, 2), None, (1,),
                                                                          WINDOW)
    assert full.kv.shape == (2, 2, 64, 4, 2, 8) and sliding.kv.shape == (1, 2, 24, 4, 2, 8)
    assert full.staging.shape == (2, 2, 64, 2, 8) and sliding.staging.shape == (1, 2, 64, 2, 8)
    assert full.block_table.shape == sliding.block_table.shape == (8, POOL.max_blocks_per_seq)
    assert full.block_table.data_ptr() != sliding.block_table.data_ptr()
    assert pool.kv is full.kv and pool.block_table is full.block_table and pool.layers == (0, 2)
    assert full.writer_fence is sliding.writer_fence is pool.writer_fence is not None


def test_each_group_holds_exactly_the_committed_tokens_at_its_own_tables_slots(
        core: ServiceCore) -> None:
    """The NWOR scenario (`nwor_scenario`): each group's pool, poisoned first, holds exactly
    the accepted tokens at the slots its own table gives them. A long request, live throughout,
    holds all its blocks in the full group and its window's alone in the sliding one, so the
    groups hand the scenario's requests different blocks: a commit through the wrong table
    would show."""
    kv = registered(core)
    kv.step(new=(["long"], [24]))
    kv.step()  # commits its prompt, before the scenario poisons the pools
    outcome = nwor_scenario(kv)
    assert outcome.mismatches == []
    assert outcome.commit.tokens > 0 and outcome.commit.written > 0
    full, sliding = (g.table.host for g in core.groups.managers.values())
    assert (full[full >= 0].size and not np.array_equal(full, sliding))


def test_a_windowed_group_gives_its_blocks_back_while_the_full_group_keeps_them(
        core: ServiceCore) -> None:
    kv = registered(core)
    first = kv.step(new=(["a"], [24]))
    stage_pattern(kv.pool.groups[0].staging, 24, tag=1)
    stage_pattern(kv.pool.groups[1].staging, 24, tag=1)
    second = kv.step(grants=(first.admitted, [0]))  # commits the prompt; reads 17..24 from now
    row = int(first.scheduled.rows[0])
    full, sliding = kv.pool.groups
    assert sliding.block_table[row, :4].tolist() == [RELEASED] * 4
    assert (full.block_table[row, :7] >= 0).all()
    assert kv.get_request("a").block_ids[:4] == full.block_table[row, :4].tolist()  # group 0's
    free = core.groups.free_blocks
    assert (free["full"], free["sliding"]) == (64 - 7, 24 - 3)
    assert second.free_blocks == min(free.values())
    state = kv.get_pool(verify=True)
    assert (state.free_blocks, state.invariants) == (24 - 3, "ok")  # the scarcest group's
    kv.step(results=(first.admitted, [0]), finished=first.admitted)
    assert core.groups.free_blocks == {"full": 64, "sliding": 24}


def test_a_dropped_worker_frees_its_requests_in_every_group(core: ServiceCore) -> None:
    kv = registered(core)
    kv.step(new=(["a", "b"], [9, 20]))
    assert all(free < total for free, total in zip(core.groups.free_blocks.values(), (64, 24),
                                                    strict=True))
    assert kv.deregister().freed_requests == 2
    assert core.groups.free_blocks == {"full": 64, "sliding": 24}
    core.check_invariants()


def test_an_overlap_worker_commits_its_own_tokens(core: ServiceCore) -> None:
    kv = registered(core, overlap=True)
    for group in kv.pool.groups:
        group.kv.fill_(POISON)
    first = kv.step(new=(["a"], [6]))
    kv.step(grants=(first.admitted, [1]))
    third = kv.step(results=(first.admitted, [1]), grants=(first.admitted, [1]))
    assert third.committed.tokens == 0
    assert all((g.kv == POISON).all() for g in kv.pool.groups)


def test_a_worker_that_does_not_attach_is_refused_naming_attached(core: ServiceCore) -> None:
    kv = Client.in_process(core, worker_id="remote")
    with pytest.raises(RemoteError, match="attached: a grouped pool") as refused:
        kv.register(attach=False)
    assert (refused.value.status, refused.value.code, refused.value.field) == (
        422, "attach_required", "attached")
    assert not core.holds("remote")


def test_each_group_s_shared_table_is_put_back(core: ServiceCore) -> None:
    kv = registered(core)
    kv.step(new=(["a"], [9]))
    row = core.registry.get("w").req_ids["a"]
    sliding = kv.pool.groups[1].block_table
    sliding[row, :3] = torch.tensor([5, 6, 7], dtype=sliding.dtype)  # another process's write
    assert core.repair_shared_state()["block_table"] == 3
    assert sliding[row].numpy().tolist() == core.groups.managers["sliding"].table.host[
        row].tolist()


def test_the_invariant_check_covers_every_group(core: ServiceCore) -> None:
    kv = registered(core)
    kv.step(new=(["a"], [9]))
    core.check_invariants()
    rows = core.groups.managers["sliding"].rows
    rows.capacity[core.registry.get("w").req_ids["a"]] += 1  # the second group alone
    with pytest.raises(InvariantViolation):
        core.check_invariants()
    assert kv.get_pool().free_blocks == min(core.groups.free_blocks.values())
    assert core.get_pool(wire.PoolQuery()).invariants == "unchecked"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_groups_share_one_step_fence_and_each_holds_its_committed_tokens() -> None:
    """The CUDA run of `test_each_group_holds_exactly_the_committed_tokens_at_its_own_tables_slots`
    (whose CPU run has no fences): one step fence for every group, and the same pools."""
    core = ServiceCore(ServiceConfig(pool=POOL.model_copy(update={"device": "cuda"}),
                                     max_step_tokens=64, groups=GROUPS))
    try:
        kv = registered(core)
        attachment = kv.registration.attachment
        assert attachment.forward_done is not None
        assert all(g.forward_done is None and g.writer_fence is None for g in attachment.groups)
        assert all(g.fence is kv.pool.fence is not None for g in kv.pool.groups)
        assert all(g.kv.is_cuda and g.block_table.is_cuda for g in kv.pool.groups)
        kv.step(new=(["long"], [24]))
        kv.step()
        assert nwor_scenario(kv).mismatches == []
        core.check_invariants()
    finally:
        core.close()
