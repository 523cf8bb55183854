"""Attention for an unmodified `transformers` model whose KV lives in the kvalloc pool.

`register()` adds ``"kvalloc"`` to transformers' ``AttentionInterface``; a model loaded with (or
switched to) ``attn_implementation="kvalloc"`` then calls `kvalloc_attention` in every layer with
the projected, rotated Q/K/V of one packed step (batch 1, every scheduled request's tokens back to
back in the reply's token order). The step travels as the ``kvalloc_step`` keyword (a
`PoolStep`), which transformers forwards from ``model(...)`` to the attention function.

Per layer the function
1. stages the step's K/V at ``staging[layer, 0 / 1, i]`` for token ``i``: the commit writes the
   pool from there (the service's, or an overlap worker's own), so nothing here writes the pool;
2. attends over two sources in one softmax (`worker.attention.pool_attention`, or its Triton
   kernel where `kernel_takes` the step: CUDA, decodes and prefill chunks alike): each
   request's history in the pool, read through its block-table row, and its own staged tokens,
   causal among themselves, with the layer's sliding window when it has one. The step's layout
   (`PagedLayout`) is on the device, built once per step, so a request's history length may be
   one only the device knows yet. In a grouped pool each layer reads its group's pool, staging
   and block table (`PoolStep.where`); the entries are the same in every group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvalloc.worker.attention.pool_attention import PagedLayout, pool_attention
from kvalloc.worker.attention.pool_attention_triton import kernel_takes, pool_attention_triton
from kvalloc.worker.errors import KvallocAttentionError
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "kvalloc"


@dataclass(frozen=True)
class StepGroup:
    """One group of the pool in a step: its layers' KV and staging, and the step's entries read
    through the group's own block table (``layout``: every group's has the same entries)."""

    kv: torch.Tensor  # the group's pool, [Lg, P, num_blocks, tokens_per_block, H, D]
    staging: torch.Tensor  # [Lg, P, max_step_tokens, H, D]
    layout: PagedLayout


@dataclass(frozen=True)
class PoolStep:
    """One step's tokens in the pool's terms: what every layer's attention needs. A pool of
    several groups (a model mixing full and windowed layers) holds each model layer in one
    group; a pool of one group holds every layer, in order (`of`)."""

    groups: tuple[StepGroup, ...]
    where: tuple[tuple[int, int], ...]  # per model layer: its group, its layer in the group
    # False: every layer stages its K/V but attends to nothing (its output is its query), which
    # is how benchmarks time the same forward with attention left out.
    attend: bool = True

    @classmethod
    def of(cls, kv: torch.Tensor, staging: torch.Tensor, layout: PagedLayout, *,
           attend: bool = True) -> PoolStep:
        """The step of a pool of one group: ``kv`` ``[L, 2, num_blocks, tokens_per_block, H,
        D]``, ``staging`` ``[L, 2, max_step_tokens, H, D]``, model layer ``l`` at ``l``."""
        return cls((StepGroup(kv, staging, layout),),
                   tuple((0, layer) for layer in range(kv.shape[0])), attend)

    def __post_init__(self) -> None:
        for group in self.groups:
            if group.layout.num_tokens > group.staging.shape[2]:
                raise KvallocAttentionError(
                    f"num_tokens: the step has {group.layout.num_tokens} tokens, staging "
                    f"holds {group.staging.shape[2]}")

    @property
    def num_tokens(self) -> int:
        return self.groups[0].layout.num_tokens

    def layout(self, layer: int) -> PagedLayout:
        """The step's entries as model layer ``layer`` reads them: through its group's table."""
        return self.groups[self.where[layer][0]].layout

    def pool(self, layer: int, kv: int) -> torch.Tensor:
        """``layer``'s pool of keys (``kv`` 0) or values (1): ``[num_blocks, T, H, D]``."""
        group, at = self.where[layer]
        return self.groups[group].kv[at, kv]

    def staged(self, layer: int, kv: int) -> torch.Tensor:
        """``layer``'s staging rows of the step's keys (``kv`` 0) or values (1): ``[N, H, D]``."""
        group, at = self.where[layer]
        return self.groups[group].staging[at, kv, :self.num_tokens]


def kvalloc_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                      scaling: float | None = None, kvalloc_step: PoolStep | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [1, Hq, N, D]``, ``key``/``value``
    ``[1, Hkv, N, D]``; returns ``([1, N, Hq, D], None)``."""
    if kvalloc_step is None:
        raise KvallocAttentionError(
            "kvalloc_step: the kvalloc attention needs the step layout; run the model through "
            "worker.engine, or switch attn_implementation back for a plain forward")
    step = kvalloc_step
    if step.groups[0].staging.shape[1] == 1:
        raise KvallocAttentionError(
            "kv_layout: a latent pool holds no per-head K/V; an MLA model's attention modules "
            "run worker.attention.mla's forward (switch_mla_modules, as the engine does)")
    if query.shape[0] != 1 or query.shape[2] != step.num_tokens:
        raise KvallocAttentionError(f"query: expected one packed sequence of {step.num_tokens} "
                                   f"tokens, got shape {tuple(query.shape)}")
    if kwargs.get("softcap") is not None:
        raise KvallocAttentionError("softcap: attention logit soft-capping is not supported")
    layer = module.layer_idx
    step.staged(layer, 0).copy_(key[0].transpose(0, 1))
    step.staged(layer, 1).copy_(value[0].transpose(0, 1))
    out = attend_staged(step, layer, query[0].transpose(0, 1), scaling,
                        kwargs.get("sliding_window"))  # this layer's, when it slides
    return out.unsqueeze(0), None


def attend_staged(step: PoolStep, layer: int, query: torch.Tensor, scale: float | None,
                  window: int | None) -> torch.Tensor:
    """``query [N, Hq, D]`` over ``layer``'s history in the pool and the step's K/V already in
    its staging rows: the kernel where it takes the step, else the reference (``query``
    itself for a step that does not attend)."""
    if not step.attend:
        return query
    pool_k, pool_v, layout = step.pool(layer, 0), step.pool(layer, 1), step.layout(layer)
    kernel = kernel_takes(query, pool_k, layout)
    if not kernel and query.is_cuda and torch.cuda.is_current_stream_capturing():
        # The reference sizes its gathers by the capturing step's history bounds: a replay
        # at a longer history would read past them.
        raise KvallocAttentionError(
            f"cuda_graphs: a captured step needs the pool-attention kernel, which does not take "
            f"{query.dtype} heads of {query.shape[-1]} over a {pool_k.dtype} pool "
            f"(or Triton is missing)")
    return (pool_attention_triton if kernel else pool_attention)(
        query, step.staged(layer, 0), step.staged(layer, 1), pool_k, pool_v, layout,
        scale=scale, window=window)


def register() -> None:
    """Make ``attn_implementation="kvalloc"`` available to every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvalloc_attention)
