"""The NWOR attention contract: during a verify step, attention over (committed history read from
the pool through the block table) + (this step's staged K/V), merged by log-sum-exp, equals
attention after writing everything; and the pool never holds a rejected token."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kvalloc.allocator.capacity.block_table import BlockTable
from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.two_source_attention import (
    attend,
    merge_attention,
    paged_attention,
    two_source_attention,
)
from kvalloc.allocator.nwor.window import WindowLayout
from nwor_scenarios import POISON_BITS, bits, poisoned_storage

BF16_TOL = {"atol": 2e-2, "rtol": 1.6e-2}


def test_merging_two_key_sets_equals_attending_to_their_union():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=gen)
    k, v = torch.randn(9, 2, 8, generator=gen), torch.randn(9, 2, 8, generator=gen)
    scale = 1 / math.sqrt(8)
    full, lse_full = attend(q, k, v, causal_offset=None, scale=scale)
    a = attend(q, k[:4], v[:4], causal_offset=None, scale=scale)
    b = attend(q, k[4:], v[4:], causal_offset=None, scale=scale)
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, lse_full)
    # An empty source (no history yet) contributes nothing.
    empty = attend(q, k[:0], v[:0], causal_offset=None, scale=scale)
    torch.testing.assert_close(merge_attention(*empty, *a)[0], a[0])


def _write_all(storage: KVStorage, layer: int, slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> KVStorage:
    """Independent oracle: a copy of the pool with every staged token written (plain indexing)."""
    ref = KVStorage(storage.config)
    ref.kv.copy_(storage.kv)
    keep = slots >= 0
    ref.key_cache(layer).view(-1, *k.shape[1:])[slots[keep]] = k[keep]
    ref.value_cache(layer).view(-1, *v.shape[1:])[slots[keep]] = v[keep]
    return ref


@pytest.mark.parametrize("seed", range(4))
def test_two_source_attention_equals_write_everything_then_attend(seed):
    rng = np.random.default_rng(seed)
    heads, kv_heads, dim = int(rng.choice([2, 4])), 2, int(rng.choice([8, 16]))
    cfg = PoolConfig(num_blocks=96, tokens_per_block=4, num_layers=2, num_kv_heads=kv_heads,
                     head_dim=dim, device="cpu", max_seq_len=80, max_batch_size=8)
    storage = poisoned_storage(cfg)
    table = BlockTable(cfg.max_batch_size, cfg.max_blocks_per_seq, storage.device)
    num_reqs = int(rng.integers(2, 6))
    rows = [table.acquire_row() for _ in range(num_reqs)]
    blocks = rng.permutation(cfg.total_blocks)[: num_reqs * 12].reshape(num_reqs, 12)
    table.append(np.array(rows), np.zeros(num_reqs, dtype=np.int64),
                 np.full(num_reqs, 12), blocks.reshape(-1).astype(np.int32))
    table.sync()
    mgr = DeferredWriteManager(storage, max_tokens=64, backend="torch")
    history = [0] * num_reqs
    poison = POISON_BITS[torch.bfloat16]
    gen = torch.Generator().manual_seed(seed)

    for step in range(5):
        tokens, drafts = [], []
        for _ in range(num_reqs):
            if step == 0 or rng.random() < 0.2:  # prefill chunk
                tokens.append(int(rng.integers(1, 7)))
                drafts.append(0)
            else:  # decode: last verified token + D drafts
                d = int(rng.integers(0, 4))
                tokens.append(1 + d)
                drafts.append(d)
        layout = WindowLayout(tokens, drafts)
        n = layout.total_tokens
        positions = torch.cat([torch.arange(h, h + t) for h, t in zip(history, tokens,
                                                                      strict=True)])
        req_rows = torch.repeat_interleave(torch.tensor(rows), torch.tensor(tokens))
        slots = table.slot_mapping(req_rows, positions, cfg.tokens_per_block)
        assert (slots >= 0).all()

        mgr.begin_window(layout)
        queries, staged = [], []
        for layer in range(cfg.num_layers):
            k = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
            v = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
            split = int(rng.integers(0, n + 1))  # stage in two chunks
            mgr.stage_layer(layer, k[:split], v[:split], slots[:split])
            mgr.stage_layer(layer, k[split:], v[split:], slots[split:])
            queries.append(torch.randn(n, heads, dim, generator=gen).bfloat16())
            staged.append((k, v))

        for layer in range(cfg.num_layers):
            q = queries[layer]
            got = two_source_attention(q, storage, layer, table.device_table, rows, history,
                                       tokens, *mgr.staged_kv(layer))
            full = _write_all(storage, layer, slots, *staged[layer])
            want = paged_attention(q, full, layer, table.device_table, rows, history, tokens)
            torch.testing.assert_close(got, want, **BF16_TOL)
            # What deferred writes broke: reading this step's K/V back from the pool reads
            # tokens that are not there yet.
            stale = paged_attention(q, storage, layer, table.device_table, rows, history, tokens)
            assert not torch.allclose(stale.float(), want.float(), **BF16_TOL)

        accepted = [int(rng.integers(0, d + 1)) for d in drafts]
        mgr.commit(accepted)

        keep = np.concatenate([[True] * (t - d + a) + [False] * (d - a)
                               for t, d, a in zip(tokens, drafts, accepted, strict=True)])
        for layer in range(cfg.num_layers):
            k, v = staged[layer]
            pool = storage.rows()[layer]
            kept, rejected = slots[torch.from_numpy(keep)], slots[torch.from_numpy(~keep)]
            assert torch.equal(bits(pool[0, kept]), bits(k.reshape(n, -1)[keep]))
            assert torch.equal(bits(pool[1, kept]), bits(v.reshape(n, -1)[keep]))
            # The pool never contains a rejected token: its slot still holds the poison.
            assert (bits(pool[:, rejected]) == poison).all()
        history = [h + t - d + a for h, t, d, a in zip(history, tokens, drafts, accepted,
                                                       strict=True)]
    assert mgr.metrics().fallbacks == {}
