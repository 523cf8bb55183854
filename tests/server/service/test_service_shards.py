"""A tensor-parallel service: one pool per device, each holding its shard of the KV heads, one
block table mirrored to every device, one step call, and the service's commit on every shard.

What must hold: each shard's pool, after a worker staged each shard's heads, equals the one-pool
service's pool of the same steps split by heads; every shard holds exactly the committed tokens;
a configuration that does not fit is refused with `ShardingInvalid` before anything is made; a
worker's staging goes with it on every shard. The devices are a parameter: the same tests run on
``cuda:0,cuda:0`` on a GPU, and on ``cuda:0,cuda:1`` where there are two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepResult
from kvalloc.server.contract.errors import ShardingInvalid
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from service_harness import POISON, nwor_scenario

DEVICES = [("cpu", "cpu"), pytest.param(("cuda:0", "cuda:0"), marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param(("cuda:0", "cuda:1"), marks=[pytest.mark.gpu, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two GPUs")])]
HEADS = 4


@pytest.fixture(params=DEVICES, ids=",".join)
def device(request: pytest.FixtureRequest) -> tuple[str, str]:
    """The two shards' devices."""
    return request.param


def sharded(make_core, device: tuple[str, str], **service: object) -> ServiceCore:
    return make_core(device=device[0], num_kv_heads=HEADS,
                     service={"devices": list(device), "tensor_parallel": 2, **service})


def test_every_shard_is_attached_with_its_heads_and_its_own_tensors(make_core, device):
    core = sharded(make_core, device)
    client = Client.in_process(core, worker_id="w")
    reg = client.register()
    assert reg.layout.tensor_parallel == 2 and reg.layout.num_kv_heads == HEADS
    assert [(s.head_start, s.head_stop) for s in reg.attachment.shards] == [(0, 2), (2, 4)]
    pool = client.pool
    assert pool is not None and [s.heads for s in pool.shards] == [(0, 2), (2, 4)]
    kvs = [s.kv for s in pool.shards]
    assert all(kv.shape[4] == HEADS // 2 and s.staging.shape[3] == HEADS // 2
               for kv, s in zip(kvs, pool.shards, strict=True))
    assert kvs[0].data_ptr() != kvs[1].data_ptr()
    assert pool.shards[0].block_table.data_ptr() != pool.shards[1].block_table.data_ptr()


def test_every_shard_holds_exactly_the_committed_tokens(make_core, device):
    core = sharded(make_core, device)
    client = Client.in_process(core, worker_id="w")
    client.register()
    outcome = nwor_scenario(client)
    assert outcome.mismatches == []
    assert outcome.commit.written > 0 and outcome.commit.fallback is None
    core.check_invariants()  # every device copy of the table equals the host's


def run_script(client: Client, seed: int) -> None:
    """Admit, chunk, decode with drafts, accept some, revert one, finish one; each forward stages
    random K/V for every head, shard r's heads into shard r's staging."""
    rng = torch.Generator().manual_seed(seed)
    pool = client.pool
    assert pool is not None
    shards = pool.shards or [pool]
    for shard in shards:
        shard.kv.fill_(POISON)

    def forward(reply: StepResult) -> None:
        layers, _, _, _, dim = shards[0].staging.shape
        full = torch.randn(layers, 2, reply.scheduled.total_tokens, HEADS, dim, generator=rng)
        for shard in shards:
            start, stop = shard.heads or (0, HEADS)
            shard.staging[:, :, :full.shape[2]] = full[..., start:stop, :].to(shard.staging)

    first = client.step(new=(["a", "b", "c"], [7, 20, 5], [0, 9, 0]))
    a, b, c = first.admitted.tolist()
    forward(first)
    second = client.step(grants=([a, c], [3, 2]), prefill=([b], [11]))
    forward(second)
    third = client.step(results=([a, c], [2, 0]), grants=([a, b], [3, 1]))
    forward(third)
    client.step(results=([a], [3]), reverts=[b], finished=[c])


def test_the_shards_equal_the_one_pool_service_split_by_heads(make_core, device):
    one = Client.in_process(make_core(device=device[0], num_kv_heads=HEADS), worker_id="w")
    one.register()
    run_script(one, seed=7)
    two = Client.in_process(sharded(make_core, device), worker_id="w")
    two.register()
    run_script(two, seed=7)
    assert one.pool is not None and two.pool is not None
    whole = one.pool.kv.cpu()
    assert (whole != POISON).any() and (whole == POISON).any()  # something, not everything
    for shard in two.pool.shards:
        start, stop = shard.heads
        assert torch.equal(shard.kv.cpu(), whole[..., start:stop, :])


@pytest.mark.parametrize("service, pool, message", [
    ({"devices": ["cpu", "cpu"], "tensor_parallel": 2}, {"num_kv_heads": 3},
     "num_kv_heads: 3 KV heads do not split evenly over 2 shards"),
    ({"devices": ["cpu"] * 3, "tensor_parallel": 2}, {},
     "devices: 3 devices are not a multiple of the tensor-parallel degree"),
    ({"devices": ["cpu"] * 4, "tensor_parallel": 2}, {},
     "devices: 4 devices at tensor-parallel 2 make 2 data-parallel ranks"),
    ({"devices": ["cpu", "tpu"], "tensor_parallel": 2}, {},
     "devices: device: 'tpu' is not a torch device"),
    ({"devices": ["cpu", f"cuda:{torch.cuda.device_count()}"], "tensor_parallel": 2}, {},
     f"devices: device: 'cuda:{torch.cuda.device_count()}'"),
    ({"tensor_parallel": 2}, {},
     "devices: 1 devices are not a multiple of the tensor-parallel degree"),
    ({"devices": ["cpu", "cpu"], "tensor_parallel": 2},
     {"kv_layout": "latent", "num_kv_heads": 1, "head_dim": 72},
     "kv_layout: a latent pool has no KV heads to split over 2 shards; MLA engines replicate"),
])
def test_what_does_not_fit_is_refused_before_anything_is_made(make_config, service, pool,
                                                             message):
    config = ServiceConfig(pool=make_config(**{"num_kv_heads": HEADS, **pool}), **service)
    epoch = 0x5EED
    with pytest.raises(ShardingInvalid, match=message):
        ServiceCore(config, epoch=epoch)
    assert list(SHM_DIR.glob(f"kvalloc-{epoch:016x}*")) == []


def test_a_worker_leaves_nothing_on_any_shard(make_core, device):
    core = sharded(make_core, device)
    before = core.manager.free_blocks
    client = Client.in_process(core, worker_id="gone")
    client.register()
    client.step(new=(["a"], [40]))
    client.deregister()
    assert core.manager.free_blocks == before
    core.check_invariants()
    if device[0] == "cpu":
        prefix = f"kvalloc-{core.epoch:016x}-"
        names = sorted(p.name.removeprefix(prefix) for p in SHM_DIR.glob(prefix + "*"))
        assert names == ["block_table", "fence_words", "kv", "shard1-block_table",
                         "shard1-fence_words", "shard1-kv"]


def test_the_table_of_every_shard_follows_the_step(make_core, device):
    core = sharded(make_core, device)
    client = Client.in_process(core, worker_id="w")
    client.register()
    reply = client.step(new=(["a", "b"], [33, 17]))
    assert client.pool is not None
    tables = [s.block_table.cpu().numpy() for s in client.pool.shards]
    assert np.array_equal(tables[0], core.manager.table.host)
    assert np.array_equal(tables[1], core.manager.table.host)
    held = sum(core.manager.view(int(row)).num_blocks for row in reply.scheduled.rows)
    assert held > 0 and (tables[1][reply.scheduled.rows] >= 0).sum() == held


def test_every_shard_protects_the_cached_prefix_blocks(make_core, device):
    core = sharded(make_core, device, prefix_caching=True)
    client = Client.in_process(core, worker_id="w")
    client.register()
    prompt = np.arange(12)
    client.step(new=(["a"], [12]), prompt_token_ids=prompt)
    client.step()  # the commit writes "a"'s prompt: its full blocks become shared
    reply = client.step(new=(["b"], [12]), prompt_token_ids=prompt)
    assert int(reply.cached_tokens[0]) > 0
    masks = [shard.committer.protected for shard in core.pool.shards]
    assert masks[0] is not None and masks[0].any()
    assert all(torch.equal(mask.cpu(), masks[0].cpu()) for mask in masks)
    assert client.pool is not None
    assert [s.protected is not None for s in client.pool.shards] == [True, True]
