"""The worker's attention against the project's reference two-source attention, on random
pools: grouped-query heads, requests with and without history, decode-sized and long entries,
histories known only on the device (an overlap worker's lead), and NaN everywhere in the pool
outside the requests' history."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.two_source_attention import two_source_attention
from kvalloc.worker.attention.hook import PoolStep, kvalloc_attention
from kvalloc.worker.attention.pool_attention import PagedLayout
from kvalloc.worker.errors import KvallocAttentionError

HEADS, KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK = 4, 2, 8, 4


@pytest.mark.parametrize("group_width", [1, 4, 64])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("on_device", [False, True])
def test_equals_the_reference_two_source_attention(group_width: int, layer: int,
                                                    on_device: bool) -> None:
    """``on_device``: the host knows each history only up to a lead of at most 3 tokens, which
    the device adds."""
    gen = torch.Generator().manual_seed(group_width * 10 + layer + 100 * on_device)
    config = PoolConfig(num_blocks=64, tokens_per_block=TOKENS_PER_BLOCK, num_layers=2,
                        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32", device="cpu",
                        max_batch_size=8, max_seq_len=64, max_draft_len=3)
    storage = KVStorage(config)
    storage.kv.fill_(float("nan"))
    history = np.array([9, 0, 21, 4, 0])
    lengths = np.array([4, 7, 1, 12, 2])
    rows = np.array([3, 0, 5, 1, 6])
    table = torch.full((8, config.max_blocks_per_seq), -1, dtype=torch.int32)
    blocks = iter(torch.randperm(64, generator=gen).tolist())
    for row, n in zip(rows, history + lengths, strict=True):
        table[row, :-(-n // TOKENS_PER_BLOCK)] = torch.tensor(
            [next(blocks) for _ in range(-(-n // TOKENS_PER_BLOCK))], dtype=torch.int32)
    for row, n in zip(rows, history, strict=True):  # only history is in the pool
        pos = torch.arange(n)
        slots = table[row, pos // TOKENS_PER_BLOCK].long() * TOKENS_PER_BLOCK + (
            pos % TOKENS_PER_BLOCK)
        storage.rows()[:, :, slots] = torch.randn(2, 2, n, KV_HEADS * HEAD_DIM, generator=gen)
    total = int(lengths.sum())
    query = torch.randn(1, HEADS, total, HEAD_DIM, generator=gen)
    key = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=gen)
    value = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=gen)
    staging = torch.zeros(2, 2, 64, KV_HEADS, HEAD_DIM)
    offsets = np.cumsum(lengths) - lengths
    lead = np.array([2, 0, 3, 1, 0]) if on_device else np.zeros(5, dtype=np.int64)
    layout = PagedLayout.build(table, TOKENS_PER_BLOCK, rows=rows, query_starts=offsets,
                               query_lens=lengths, starts=history - lead,
                               lead=torch.as_tensor(lead) if on_device else None,
                               lead_bound=3 if on_device else 0, group_width=group_width)
    step = PoolStep.of(storage.kv, staging, layout)
    module = torch.nn.Module()
    module.layer_idx = layer
    out, _ = kvalloc_attention(module, query, key, value, None, scaling=HEAD_DIM ** -0.5,
                               kvalloc_step=step)

    torch.testing.assert_close(staging[layer, 0, :total], key[0].transpose(0, 1))
    torch.testing.assert_close(staging[layer, 1, :total], value[0].transpose(0, 1))
    want = two_source_attention(query[0].transpose(0, 1), storage, layer, table, rows.tolist(),
                                history.tolist(), lengths.tolist(), staging[layer, 0, :total],
                                staging[layer, 1, :total])
    assert out.shape == (1, total, HEADS, HEAD_DIM)
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)


def test_rejects_what_it_does_not_implement() -> None:
    kv = torch.zeros(1, 2, 4, 4, 1, 8)
    staging = torch.zeros(1, 2, 8, 1, 8)
    table = torch.tensor([[0, 1, -1, -1]], dtype=torch.int32)
    step = PoolStep.of(kv, staging, _layout(table, length=3, start=5))
    module = torch.nn.Module()
    module.layer_idx = 0
    q, k = torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(KvallocAttentionError, match="softcap"):
        kvalloc_attention(module, q, k, k, None, kvalloc_step=step, softcap=30.0)
    with pytest.raises(KvallocAttentionError, match="expected one packed sequence of 3"):
        kvalloc_attention(module, torch.zeros(1, 1, 2, 8), k, k, None, kvalloc_step=step)
    with pytest.raises(KvallocAttentionError, match="staging holds 8"):
        PoolStep.of(kv, staging, _layout(table, length=9, start=0))


def _layout(table: torch.Tensor, *, length: int, start: int) -> PagedLayout:
    return PagedLayout.build(table, 4, rows=np.array([0]), query_starts=np.array([0]),
                             query_lens=np.array([length]), starts=np.array([start]),
                             group_width=4)


def test_a_step_that_does_not_attend_stages_its_keys_and_returns_the_query() -> None:
    """What benchmarks time the forward without attention with."""
    table = torch.zeros(1, 2, dtype=torch.int32)
    kv = torch.full((1, 2, 2, 4, 1, 8), float("nan"))
    staging = torch.zeros(1, 2, 8, 1, 8)
    step = PoolStep.of(kv, staging, _layout(table, length=3, start=0), attend=False)
    module = torch.nn.Module()
    module.layer_idx = 0
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    out, _ = kvalloc_attention(module, q, k, v, None, kvalloc_step=step)
    assert torch.equal(out[0], q[0].transpose(0, 1))
    assert torch.equal(staging[0, 0, :3], k[0].transpose(0, 1))
    assert torch.equal(staging[0, 1, :3], v[0].transpose(0, 1))
