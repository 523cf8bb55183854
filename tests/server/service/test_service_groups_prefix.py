"""Prefix caching on a grouped pool (`ServiceConfig.groups` with ``prefix_caching``): a prompt
that shares a written prefix with an earlier one is admitted with one hit every group serves
(the reply's ``cached_tokens``), the full group maps every block of the hit and the windowed
group only its window's; each group's write protection (shared with the workers, one mask per
group) marks exactly that group's cached blocks, for a worker the service commits for and for
one that commits its own tokens; another worker's namespace finds no hit in any group; the
repair puts each group's mask back from its own cache.
KV events and the host tier stay refused with groups, naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from kvalloc.allocator import KVCacheManager, PoolConfig
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.server.client import AttachedPool, Client
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from pydantic import ValidationError
from service_harness import TTL, FakeClock, stage_pattern

WINDOW = 8
POOL = PoolConfig(num_blocks=64, tokens_per_block=4, num_layers=3, num_kv_heads=2, head_dim=8,
                  device="cpu", max_batch_size=8, max_seq_len=64, max_draft_len=3)
GROUPS = [{"name": "full", "layers": [0, 2], "num_blocks": 64},
          {"name": "sliding", "layers": [1], "window": WINDOW, "num_blocks": 24}]
SYSTEM = list(range(700, 724))  # six full blocks of 4 tokens, three windows of 8


@pytest.fixture
def core() -> Iterator[ServiceCore]:
    core = ServiceCore(ServiceConfig(pool=POOL, max_step_tokens=64, groups=GROUPS,
                                     prefix_caching=True, lease_ttl_s=TTL), clock=FakeClock())
    yield core
    core.close()


def registered(core: ServiceCore, **kwargs: bool) -> Client:
    client = Client.in_process(core, worker_id="w")
    client.register(**kwargs)
    return client


def host_tables(core: ServiceCore, row: int) -> list[list[int]]:
    """Row ``row`` of each group's host table, in group order."""
    return [m.table.host[row].tolist() for m in core.groups.managers.values()]


def shared_prefix(kv: Client, core: ServiceCore, *, overlap: bool = False
                  ) -> tuple[list[list[int]], np.ndarray, int]:
    """``a`` (the prefix and 4 tokens of its own: 7 full blocks) prefilled and written, then
    ``b`` (the prefix and 3 of its own) sent while ``a`` decodes: ``a``'s 7 prompt blocks in
    each group, ``b``'s reply's cached tokens and its row."""
    a = kv.step(new=(["a"], [28]), prompt_token_ids=SYSTEM + [1] * 4)
    row_a = int(a.scheduled.rows[0])
    prompt_blocks = [table[:7] for table in host_tables(core, row_a)]
    for group in kv.pool.groups:
        stage_pattern(group.staging, 28, tag=1)  # a's prefill forward
    kv.step(grants=(a.admitted, [0]))  # commits a's prompt (a sync worker's)
    if overlap:  # the worker commits its own: the service marks it written one call later
        kv.step(results=(a.admitted, [0]), grants=(a.admitted, [0]))
    b = kv.step(results=(a.admitted, [0]), grants=(a.admitted, [0]),
                new=(["b"], [27]), prompt_token_ids=SYSTEM + [2] * 3)
    return prompt_blocks, b.cached_tokens, int(b.scheduled.rows[-1])


@pytest.mark.parametrize("overlap", [False, True])
def test_a_shared_prefix_is_one_hit_in_every_group(core: ServiceCore, overlap: bool) -> None:
    kv = registered(core, overlap=overlap)
    (full_a, sliding_a), cached, row_b = shared_prefix(kv, core, overlap=overlap)
    assert cached.tolist() == [24]
    assert [m.counters.prefix_hit_tokens for m in core.groups.managers.values()] == [24, 24]
    full_b, sliding_b = host_tables(core, row_b)
    assert full_b[:6] == full_a[:6]  # every block of the hit
    # b runs from position 24, whose window reads back to 17: blocks 4 and 5 alone.
    assert sliding_b[:6] == [RELEASED] * 4 + sliding_a[4:6]
    assert kv.get_pool(verify=True).invariants == "ok"


def test_a_new_prompt_is_hashed_once_in_each_group(core: ServiceCore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashing is the admission's per-token cost: each group hashes a prompt in its own blocks
    once, and the step takes those hashes."""
    hashed: list[int] = []
    prompt = KVCacheManager.prompt

    def counted(manager: KVCacheManager, *args: object, **kwargs: object) -> object:
        hashed.append(id(manager))
        return prompt(manager, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, "prompt", counted)
    kv = registered(core)
    kv.step(new=(["a", "b"], [28, 27]), prompt_token_ids=SYSTEM + [1] * 4 + SYSTEM + [2] * 3)
    assert sorted(hashed) == sorted(2 * [id(m) for m in core.groups.managers.values()])


@pytest.mark.parametrize("overlap", [False, True])
def test_each_group_protects_exactly_its_cached_blocks(core: ServiceCore, overlap: bool) -> None:
    """A request that finished before its prompt was written protects nothing; once ``a``'s is
    written, each group's mask (the one its workers map) is exactly that group's blocks of
    ``a``'s prompt: the full group's held by ``a``, the windowed group's held or parked behind
    ``a``'s window."""
    kv = registered(core, overlap=overlap)
    first = kv.step(new=(["x"], [9]), prompt_token_ids=list(range(9)))
    assert not any(group.protected.any() for group in kv.pool.groups)
    kv.step(results=None, finished=first.admitted)
    prompt_blocks, _, _ = shared_prefix(kv, core, overlap=overlap)
    full, sliding = kv.pool.groups
    assert (full.protected.shape, sliding.protected.shape) == ((64,), (24,))
    for group, blocks, manager in zip(kv.pool.groups, prompt_blocks,
                                      core.groups.managers.values(), strict=True):
        assert torch.nonzero(group.protected)[:, 0].tolist() == sorted(blocks)
        assert np.array_equal(group.protected.numpy(), manager.cache.protected)
    assert full.protected.data_ptr() != sliding.protected.data_ptr()


def test_a_finished_prefix_stays_protected_until_evicted(core: ServiceCore) -> None:
    """``a`` finishes once its prompt is written: its blocks are parked in both groups, still
    protected (and nothing else is), and ``b`` hits them."""
    kv = registered(core)
    a = kv.step(new=(["a"], [28]), prompt_token_ids=SYSTEM + [1] * 4)
    row_a = int(a.scheduled.rows[0])
    prompt_blocks = [table[:7] for table in host_tables(core, row_a)]
    kv.step(grants=(a.admitted, [0]))
    kv.step(results=(a.admitted, [0]), finished=a.admitted)
    for group, blocks in zip(kv.pool.groups, prompt_blocks, strict=True):
        assert torch.nonzero(group.protected)[:, 0].tolist() == sorted(blocks)
    b = kv.step(new=(["b"], [27]), prompt_token_ids=SYSTEM + [2] * 3)
    assert b.cached_tokens.tolist() == [24]


def test_a_worker_of_another_namespace_finds_no_hit(core: ServiceCore) -> None:
    """Every group hashes a prompt in its worker's namespace: another worker's written prefix
    is no hit in any group."""
    kv = registered(core)
    shared_prefix(kv, core)
    other = Client.in_process(core, worker_id="other")
    other.register()
    reply = other.step(new=(["c"], [27]), prompt_token_ids=SYSTEM + [3] * 3)
    assert reply.cached_tokens.tolist() == [0]
    assert [m.counters.prefix_hit_tokens for m in core.groups.managers.values()] == [24, 24]


def test_each_group_s_protection_is_put_back_from_its_own_cache(core: ServiceCore) -> None:
    kv = registered(core)
    shared_prefix(kv, core)
    sliding = kv.pool.groups[1].protected
    want = sliding.clone()
    sliding[:3] = ~sliding[:3]  # another process's write
    assert core.repair_shared_state()["protected"] == 3
    assert torch.equal(sliding, want)


def test_the_attachment_carries_each_group_s_protection(core: ServiceCore) -> None:
    """Described (what a worker in another process maps) and in process alike: each group's
    mask is its own committer's."""
    kv = registered(core)
    reg = kv.registration
    described = reg.attachment
    assert described.protected == described.groups[0].protected
    assert [g.protected.shape for g in described.groups] == [[64], [24]]
    assert described.groups[1].protected.shm.name.endswith("group-sliding-protected")
    mapped = AttachedPool.attach(described, reg.session)
    shared_prefix(kv, core)
    own = [committer.protected for committer in core.pool.commits.shards]
    for group, in_process, mask in zip(mapped.groups, kv.pool.groups, own, strict=True):
        assert in_process.protected is mask
        assert group.protected.any() and torch.equal(group.protected, mask)


@pytest.mark.parametrize(("service", "field"), [
    ({"kv_events": "ipc:///tmp/kvalloc-groups-events"}, "kv_events"),
    ({"kv_events": "ipc:///tmp/kvalloc-groups-events",
      "kv_events_replay": "ipc:///tmp/kvalloc-groups-replay"}, "kv_events"),
    ({"host_tier_bytes": 1 << 20}, "host_tier_bytes")])
def test_kv_events_and_the_host_tier_are_refused_with_groups(service: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=rf"{field}: not with groups \(each group caches "
                                              r"its own blocks under its own hashes; which "
                                              r"group's a router or the host tier would see "
                                              r"is not defined\)"):
        ServiceConfig(pool=POOL, max_step_tokens=64, groups=GROUPS, prefix_caching=True,
                      **service)
