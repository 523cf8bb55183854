"""Attention for an unmodified `transformers` model whose KV lives in the kvalloc pool.

`register()` adds ``"kvalloc"`` to transformers' ``AttentionInterface``; a model loaded with (or
switched to) ``attn_implementation="kvalloc"`` then calls `kvalloc_attention` in every layer with
the projected, rotated Q/K/V of one packed step (batch 1, every scheduled request's tokens back to
back in the reply's token order). The step's layout travels as the ``kvalloc_step`` keyword
(a `PackedStep`), which transformers forwards from ``model(...)`` to the attention function.

Per layer the function
1. stages the step's K/V at ``staging[layer, 0 / 1, i]`` for token ``i``: the service commits from
   there, so nothing here writes the pool;
2. attends, per request, over two sources in one softmax: its history in the pool (positions
   below its start position, read through its block-table row) and its own staged tokens of this
   step (causal among themselves). A layer with a sliding window (Mistral, Qwen2's windowed
   layers) sees only the last ``window`` positions, as in transformers' own masks.

Requests are attended in groups of equal padded shape: all short entries (decodes) together,
and each long prefill chunk on its own, so a long chunk never pads a whole decode batch.
Gather indices and masks are built once per step (`PackedStep.build`), not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "kvalloc"


class KvallocAttentionError(ValueError):
    """Input the pool attention cannot serve: no step layout, a step larger than the staging
    buffer, or a feature it does not implement (soft-capping)."""


@dataclass(frozen=True)
class _Group:
    """Requests attended together, padded to ``[R, Q]`` queries and ``[R, S]`` keys."""

    query_index: torch.Tensor  # int64 [R, Q]: packed token of each query (0 where padded)
    query_valid: torch.Tensor  # bool [R, Q]
    keys: int  # S
    # (r, j, source index) per key: a pool slot for history keys, a packed token for staged ones.
    # Keys past a request's tokens stay zero: the pool may hold anything there (poison, NaN).
    history_at: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    staged_at: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    mask: torch.Tensor  # bool [R, 1, Q, S]: query i of request r sees key j
    query_positions: torch.Tensor  # int64 [R, 1, Q, 1]: position of each query
    key_positions: torch.Tensor  # int64 [S]: position of each key (j)


@dataclass(frozen=True)
class PackedStep:
    """One step's tokens in the pool's terms: what every layer's attention needs."""

    kv: torch.Tensor  # the pool, [L, 2, num_blocks, tokens_per_block, H, D]
    staging: torch.Tensor  # [L, 2, max_step_tokens, H, D]
    num_tokens: int
    groups: tuple[_Group, ...]

    @classmethod
    def build(cls, kv: torch.Tensor, staging: torch.Tensor, block_table: torch.Tensor,
              token_offsets: np.ndarray, num_tokens: np.ndarray, start_positions: np.ndarray,
              rows: np.ndarray, *, group_width: int) -> PackedStep:
        """The layout of a step whose request ``r`` owns packed tokens ``token_offsets[r] ..
        + num_tokens[r]`` at positions ``start_positions[r] ..``, block-table row ``rows[r]``.
        Entries of at most ``group_width`` tokens are attended as one padded group."""
        total = int(num_tokens.sum())
        if total > staging.shape[2]:
            raise KvallocAttentionError(f"num_tokens: the step has {total} tokens, staging holds "
                             f"{staging.shape[2]}")
        short = np.flatnonzero(num_tokens <= group_width)
        long = np.flatnonzero(num_tokens > group_width)
        members = ([short] if short.size else []) + [long[i:i + 1] for i in range(long.size)]
        tokens_per_block = kv.shape[3]
        groups = tuple(
            _group(block_table, tokens_per_block, token_offsets[m], num_tokens[m],
                   start_positions[m], rows[m], kv.device)
            for m in members)
        return cls(kv, staging, total, groups)


def _group(block_table: torch.Tensor, tokens_per_block: int, offsets: np.ndarray,
           lengths: np.ndarray, starts: np.ndarray, rows: np.ndarray,
           device: torch.device) -> _Group:
    queries, keys = int(lengths.max()), int((starts + lengths).max())
    i = np.arange(queries)
    j = np.arange(keys)
    query_valid = i[None, :] < lengths[:, None]
    query_index = np.where(query_valid, offsets[:, None] + i[None, :], 0)
    history = j[None, :] < starts[:, None]
    staged = ~history & (j[None, :] < (starts + lengths)[:, None])
    # Causal: query i (position start + i) sees keys at positions <= start + i. A padded query
    # row sees key 0 only, so its softmax stays finite; its output is dropped.
    mask = (j[None, None, :] <= (starts[:, None] + i[None, :])[..., None]) & (
        history | staged)[:, None, :]
    mask = np.where(query_valid[..., None], mask, j[None, None, :] == 0)
    to = {"device": device}
    r_history, j_history = (torch.as_tensor(a, **to) for a in np.nonzero(history))
    table = block_table.to(device)[torch.as_tensor(rows, **to)].long()  # [R, max_blocks]
    slots = (table[r_history, j_history // tokens_per_block] * tokens_per_block
             + j_history % tokens_per_block)
    r_staged, j_staged = np.nonzero(staged)
    packed = offsets[r_staged] + j_staged - starts[r_staged]
    return _Group(
        query_index=torch.as_tensor(query_index, **to),
        query_valid=torch.as_tensor(query_valid, **to),
        keys=keys,
        history_at=(r_history, j_history, slots),
        staged_at=tuple(torch.as_tensor(a, **to) for a in (r_staged, j_staged, packed)),
        mask=torch.as_tensor(mask[:, None], **to),
        query_positions=torch.as_tensor((starts[:, None] + i[None, :])[:, None, :, None], **to),
        key_positions=torch.as_tensor(j, **to),
    )


def kvalloc_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                      scaling: float | None = None, kvalloc_step: PackedStep | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [1, Hq, N, D]``, ``key``/``value``
    ``[1, Hkv, N, D]``; returns ``([1, N, Hq, D], None)``."""
    if kvalloc_step is None:
        raise KvallocAttentionError(
            "kvalloc_step: the kvalloc attention needs the step layout; run the model through "
            "worker.engine, or switch attn_implementation back for a plain forward")
    step = kvalloc_step
    if query.shape[0] != 1 or query.shape[2] != step.num_tokens:
        raise KvallocAttentionError(f"query: expected one packed sequence of {step.num_tokens} "
                                   f"tokens, got shape {tuple(query.shape)}")
    if kwargs.get("softcap") is not None:
        raise KvallocAttentionError("softcap: attention logit soft-capping is not supported")
    window = kwargs.get("sliding_window")  # this layer's, when it slides
    layer, n = module.layer_idx, step.num_tokens
    staged_k, staged_v = step.staging[layer, 0, :n], step.staging[layer, 1, :n]
    staged_k.copy_(key[0].transpose(0, 1))
    staged_v.copy_(value[0].transpose(0, 1))
    pool_k = step.kv[layer, 0].flatten(0, 1)  # [num_slots, H, D]
    pool_v = step.kv[layer, 1].flatten(0, 1)
    q = query[0].transpose(0, 1)  # [N, Hq, D]
    out = torch.empty_like(q)
    for group in step.groups:
        shape = (group.query_index.shape[0], group.keys, *staged_k.shape[1:])
        k = staged_k.new_zeros(shape)  # [R, S, H, D]
        v = staged_v.new_zeros(shape)
        for (r, j, source), from_k, from_v in ((group.history_at, pool_k, pool_v),
                                               (group.staged_at, staged_k, staged_v)):
            k[r, j], v[r, j] = from_k[source], from_v[source]
        attended = F.scaled_dot_product_attention(
            q[group.query_index].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=_windowed(group, window), scale=scaling,
            enable_gqa=True)  # [R, Hq, Q, D]
        out[group.query_index[group.query_valid]] = attended.transpose(1, 2)[group.query_valid]
    return out.unsqueeze(0), None


def _windowed(group: _Group, window: int | None) -> torch.Tensor:
    """The group's mask, limited to the last ``window`` positions when the layer slides (as
    transformers does: key j is visible to query i iff i - window < j <= i). A padded query row
    may lose its one key; its output is dropped."""
    if window is None:
        return group.mask
    return group.mask & (group.key_positions > group.query_positions - window)


def register() -> None:
    """Make ``attn_implementation="kvalloc"`` available to every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvalloc_attention)
