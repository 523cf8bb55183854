"""Random steps in the pool's terms for the pool attention's tests: ragged histories and
query lengths (empty entries too), blocks in random order, rows whose history runs past their
blocks (-1 table entries read as invisible), device-only leads, an entry on the spare row past
the table (a batch bucket's padded entry: no history), and NaN everywhere a correct
kernel never reads: pool slots outside every history, staging rows past the step's tokens.
With ``released`` (a window), each row's leading columns wholly behind the window of its
step's first position hold `RELEASED` (-2), as a windowed pool's table does, and their blocks
NaN (given back, another request's now)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.worker.attention.pool_attention import PagedLayout

LEAD_BOUND = 3


@dataclass(frozen=True)
class RandomStep:
    query: torch.Tensor  # [N, Hq, D]
    staged_k: torch.Tensor  # [N + pad, Hkv, D], NaN past N
    staged_v: torch.Tensor
    pool_k: torch.Tensor  # [num_blocks, tpb, Hkv, D], NaN outside every history
    pool_v: torch.Tensor
    layout: PagedLayout
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


def random_step(seed: int, *, entries: int, kv_heads: int, group: int, dim: int,
                tokens_per_block: int, max_history: int, max_query: int,
                dtype: torch.dtype, device: str, fp8: bool = False,
                lead: bool = False, query_lens: list[int] | None = None,
                histories: list[int] | None = None, released: int | None = None) -> RandomStep:
    """``query_lens`` / ``histories``, when given, fix each entry's instead of drawing it
    (``entries``, ``max_query`` and ``max_history`` must bound them)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    history = rng.integers(0, max_history + 1, entries)
    lengths = rng.integers(0, max_query + 1, entries)
    longest = rng.integers(entries)
    lengths[longest] = max_query  # the bound the layout keeps is reached
    lengths[(longest + 1) % entries] = 0  # an empty entry
    if query_lens is not None:
        lengths = np.array(query_lens)
    if histories is not None:
        history = np.array(histories)
    max_blocks = -(-(max_history + max_query) // tokens_per_block)
    num_blocks = entries * max_blocks + 3
    rows = rng.permutation(entries + 2)[:entries]
    table = torch.full((entries + 2, max_blocks), -1, dtype=torch.int32)
    if histories is None and entries > 2:
        padded = (longest + 2) % entries
        rows[padded], history[padded] = table.shape[0], 0
    free = iter(rng.permutation(num_blocks).tolist())
    pool_dtype = torch.float8_e4m3fn if fp8 else dtype
    pool = torch.full((2, num_blocks, tokens_per_block, kv_heads, dim), float("nan"),
                      dtype=pool_dtype)
    for row, hist, n in zip(rows, history, lengths, strict=True):
        if row == table.shape[0]:
            continue
        # One row in five holds blocks for only part of its history.
        owned = -(-(hist + n) // tokens_per_block)
        if rng.random() < 0.2:
            owned = hist // 2 // tokens_per_block
        table[row, :owned] = torch.tensor([next(free) for _ in range(owned)], dtype=torch.int32)
        readable = min(hist, owned * tokens_per_block)
        pos = torch.arange(readable)
        blocks = table[row, pos // tokens_per_block].long()
        pool[:, blocks, pos % tokens_per_block] = torch.randn(
            2, readable, kv_heads, dim, generator=gen).to(pool_dtype)
    total = int(lengths.sum())
    staged = torch.full((2, total + 5, kv_heads, dim), float("nan"), dtype=dtype)
    staged[:, :total] = torch.randn(2, total, kv_heads, dim, generator=gen).to(dtype)
    query = torch.randn(total, kv_heads * group, dim, generator=gen).to(dtype)
    leads = rng.integers(0, LEAD_BOUND + 1, entries).clip(max=history) if lead else 0
    if released is not None:
        _release(table, pool, rows, history - leads, released, tokens_per_block)
    layout = PagedLayout.build(
        table.to(device), tokens_per_block, rows=rows, query_starts=np.cumsum(lengths) - lengths,
        query_lens=lengths, starts=history - leads,
        lead=torch.as_tensor(leads, device=device) if lead else None,
        lead_bound=LEAD_BOUND if lead else 0, group_width=max_query)
    scales = (torch.tensor([0.7], device=device), torch.tensor([1.3], device=device)) if fp8 \
        else (None, None)
    pool, staged, query = pool.to(device), staged.to(device), query.to(device)
    return RandomStep(query, staged[0], staged[1], pool[0], pool[1], layout, *scales)


def _release(table: torch.Tensor, pool: torch.Tensor, rows: np.ndarray, starts: np.ndarray,
             window: int, tokens_per_block: int) -> None:
    """Give back each row's columns behind the window of its first position ``starts``."""
    for row, start in zip(rows.tolist(), starts.tolist(), strict=True):
        behind = max(0, (start - window + 1) // tokens_per_block)
        if row < table.shape[0] and behind:
            held = table[row, :behind]
            pool[:, held[held >= 0].long()] = float("nan")
            table[row, :behind] = RELEASED


# How far a kernel's attention may be from its torch reference, by the queries' dtype.
ATTENTION_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def assert_attention_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """A kernel's output equals the reference's within the dtype's tolerance (a NaN the kernel
    left in its NaN-filled output fails it)."""
    assert not want.isnan().any()
    tol = ATTENTION_TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
