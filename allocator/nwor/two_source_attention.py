"""Reference attention for the NWOR attention contract (clarity over speed; fp32 inside).

With deferred writes the pool holds only committed history while a step runs, so the verify
forward must read this step's own K/V from the staged tensors: attention over two sources, history
(read from the pool through the block table, no mask) and the step's tokens (causal), merged by
log-sum-exp. `two_source_attention` does that; `paged_attention` is "write everything, then
attend", which it must equal. Reading this step's K/V back from the pool instead is the stale-KV
bug deferred writes introduced.

Layouts: ``query`` ``[tokens, Hq, D]`` with requests back to back in ``query_lens``; K/V
``[tokens, Hkv, D]`` with ``Hq % Hkv == 0`` (grouped-query attention). Request r's step tokens sit
at positions ``history_lens[r] ..`` and its block-table row is ``rows[r]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from kvalloc.allocator.nwor.storage import KVStorage


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
           causal_offset: int | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [n, Hq, D], lse [n, Hq])`` in fp32. Query i sees key j iff ``causal_offset`` is
    None or ``j <= i + causal_offset``. A query that sees no key gets out 0 and lse -inf."""
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if causal_offset is not None:
        i = torch.arange(query.shape[0], device=query.device)[:, None]
        j = torch.arange(key.shape[0], device=query.device)[None, :]
        scores = scores.masked_fill(j > i + causal_offset, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    return out_a * w_a + out_b * w_b, lse


def read_history(storage: KVStorage, layer: int, block_table_row: torch.Tensor,
                 length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[0, length)`` of one request's K and V from the pool, dequantised to fp32."""
    tpb = storage.config.tokens_per_block
    pos = torch.arange(length, device=storage.device)
    blocks = block_table_row.to(storage.device)[pos // tpb].long()
    k = storage.key_cache(layer)[blocks, pos % tpb].float()
    v = storage.value_cache(layer)[blocks, pos % tpb].float()
    if storage.is_fp8:
        k, v = k * storage.k_scale[layer], v * storage.v_scale[layer]
    return k, v


def two_source_attention(query: torch.Tensor, storage: KVStorage, layer: int,
                         block_table: torch.Tensor, rows: Sequence[int],
                         history_lens: Sequence[int], query_lens: Sequence[int],
                         staged_k: torch.Tensor, staged_v: torch.Tensor) -> torch.Tensor:
    """History from the pool + this step's staged K/V, merged by log-sum-exp."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    outs, start = [], 0
    for row, hist, n in zip(rows, history_lens, query_lens, strict=True):
        q = query[start:start + n]
        hk, hv = read_history(storage, layer, block_table[row], hist)
        out_h, lse_h = attend(q, hk, hv, causal_offset=None, scale=scale)
        out_s, lse_s = attend(q, staged_k[start:start + n], staged_v[start:start + n],
                              causal_offset=0, scale=scale)
        outs.append(merge_attention(out_h, lse_h, out_s, lse_s)[0])
        start += n
    return _cat(outs, query)


def paged_attention(query: torch.Tensor, storage: KVStorage, layer: int,
                    block_table: torch.Tensor, rows: Sequence[int],
                    history_lens: Sequence[int], query_lens: Sequence[int]) -> torch.Tensor:
    """Single-source attention after the step's K/V has been written to the pool."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    outs, start = [], 0
    for row, hist, n in zip(rows, history_lens, query_lens, strict=True):
        k, v = read_history(storage, layer, block_table[row], hist + n)
        outs.append(attend(query[start:start + n], k, v, causal_offset=hist, scale=scale)[0])
        start += n
    return _cat(outs, query)


def _cat(outs: list[torch.Tensor], query: torch.Tensor) -> torch.Tensor:
    if not outs:
        return torch.empty_like(query)
    return torch.cat(outs).to(query.dtype)
