"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent pool, with absorbed weights.

A latent pool holds one plane and one head per token: ``kv[L, 1, blocks, T, 1, R + P]``, the
token's compressed KV ``c`` (``R = kv_lora_rank``, after ``kv_a_layernorm``) followed by its
rotated rope key (``P = qk_rope_head_dim``), shared by every query head. Head ``h``'s key and
value are ``W_UK[h] c`` (with the rope key appended) and ``W_UV[h] c``, from ``kv_b_proj``; they
are never built. Instead ``W_UK`` is absorbed into the query, ``q_latent = q_nope W_UK[h]``, so

    score(h, j) = q_latent[h] . c_j + q_rope[h] . k_rope_j = [q_latent | q_rope][h] . latent_j

and the attention output ``softmax . c`` (``[N, H, R]``) goes through ``W_UV[h]`` afterwards.
That is attention with one KV head of width ``R + P`` whose values are the first ``R`` columns
of the keys: `latent_attention` states it as exactly that, through the GQA reference
(`worker.attention.pool_attention.pool_attention`, its values the whole latent, the output
cut to ``R``), so both paths share one reading of the layout (`PagedLayout`: each entry's
history through its block-table row, then its own staged tokens, causal among themselves).
The Triton decode kernel (`worker.attention.latent_attention_triton`) is tested against it.
"""

from __future__ import annotations

import torch
from kvalloc.worker.attention.pool_attention import (
    PagedLayout,
    check_inputs,
    pool_attention,
    reject,
)


def absorbed_weights(kv_b_weight: torch.Tensor, heads: int, nope_dim: int,
                     v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK [H, nope, R], W_UV [H, v, R])``: views of ``kv_b_proj``'s weight
    ``[H * (nope + v), R]``, whose rows are per head the key's no-rope part then the value."""
    per_head = kv_b_weight.view(heads, nope_dim + v_dim, kv_b_weight.shape[-1])
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_nope [N, H, nope]`` into the latent space: ``[N, H, R]``."""
    return torch.einsum("nhd,hdr->nhr", q_nope, w_uk)


def expand_output(latent_out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The attention's latent output ``[N, H, R]`` through each head's ``W_UV``: ``[N, H, v]``."""
    return torch.einsum("nhr,hvr->nhv", latent_out, w_uv)


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, staged: torch.Tensor,
                     pool: torch.Tensor, layout: PagedLayout, *, scale: float,
                     window: int | None = None,
                     kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``q_latent [N, H, R]`` and ``q_rope [N, H, P]`` over the latent
    ``staged [>= N, 1, R + P]`` rows and ``pool [num_blocks, T, 1, R + P]``; returns
    ``softmax(scale * scores) . c`` as ``[N, H, R]``, each query seeing the last ``window``
    positions only when a window is given. An fp8 pool needs its layer's ``kv_scale`` (one
    element)."""
    check_latent_inputs(q_latent, q_rope, staged, pool, layout, kv_scale, window)
    rank = q_latent.shape[-1]
    query = torch.cat((q_latent, q_rope), dim=-1)
    out = pool_attention(query, staged, staged, pool, pool, layout, scale=scale, window=window,
                         k_scale=kv_scale, v_scale=kv_scale)
    return out[..., :rank]


def check_latent_inputs(q_latent: torch.Tensor, q_rope: torch.Tensor, staged: torch.Tensor,
                        pool: torch.Tensor, layout: PagedLayout,
                        kv_scale: torch.Tensor | None, window: int | None = None) -> None:
    """What both forms require of their inputs (shapes and dtypes only): one latent head, as
    wide as the two query parts together, and the GQA attention's rules for the query they
    make (`check_inputs`, on a stand-in of its shape that holds no data)."""
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        reject("q_rope", f"q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)} "
                         f"must be [N, H, R] and [N, H, P]")
    width = q_latent.shape[-1] + q_rope.shape[-1]
    if pool.dim() != 4 or pool.shape[2:] != (1, width):
        reject("pool", f"a latent pool is [num_blocks, T, 1, {width}], got {tuple(pool.shape)}")
    if staged.dim() != 3 or staged.shape[1:] != (1, width):
        reject("staged", f"latent staging is [>= N, 1, {width}], got {tuple(staged.shape)}")
    query = torch.empty((*q_latent.shape[:2], width), dtype=q_latent.dtype, device="meta")
    check_inputs(query, staged, staged, pool, pool, layout, window=window, k_scale=kv_scale,
                 v_scale=kv_scale)
    if q_rope.dtype != q_latent.dtype:
        reject("q_rope", f"q_rope is {q_rope.dtype}, q_latent {q_latent.dtype}: one dtype")
