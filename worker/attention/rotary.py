"""A step's rotary embedding and staging in one launch, and the attention forward that uses it.

transformers' Llama / Qwen2 / Mistral attention rotates Q and K with about ten small kernels a
layer (for each: two multiplies, a negation, a concatenation and an add), and the pool hook then
copies K and V into staging: a dozen launches a layer over a few hundred tokens each.
`rotate_and_stage` does it in one launch: it rotates the query into a tensor of its own and
writes the rotated key and the value straight into the layer's staging rows.
`fuse_attention_modules(model)` merges each of those attention modules' q/k/v projections into
one (`worker.module_forwards.merge_linears`: one GEMM where transformers runs three, the weights
held once) and points the module at a forward that projects, calls it, attends
(`worker.attention.hook.attend_staged`) and projects out, for the steps it takes (a `PoolStep`
passed, CUDA, the kernels' dtypes and widths); every other call keeps the module's own forward,
the reference it is tested against. `rotate_and_stage_reference` states the
kernel's arithmetic in torch: transformers' `apply_rotary_pos_emb`, then the staging copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from kvalloc.worker.attention.hook import ATTN_IMPLEMENTATION, PoolStep, attend_staged
from kvalloc.worker.attention.pool_attention_triton import kernel_takes as attention_kernel_takes
from kvalloc.worker.errors import RotaryError
from kvalloc.worker.kernels.helpers import KERNEL_DTYPES, kernel_for, kernel_may_take, pow2
from kvalloc.worker.module_forwards import merge_linears, switch_forwards

# Each class's sliding window, read the way its own forward reads it.
_WINDOWS: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "LlamaAttention": lambda module: None,
    "Qwen2Attention": lambda module: module.sliding_window,
    "MistralAttention": lambda module: getattr(module.config, "sliding_window", None),
}
MAX_HEAD_DIM = 256


def rotate_and_stage_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               cos: torch.Tensor, sin: torch.Tensor, staged_k: torch.Tensor,
                               staged_v: torch.Tensor) -> torch.Tensor:
    """``query [N, Hq, D]`` rotated (returned), ``key [N, Hkv, D]`` rotated into ``staged_k``,
    ``value`` into ``staged_v``; ``cos`` / ``sin`` ``[N, D]``: transformers' arithmetic."""
    c, s = cos[:, None, :], sin[:, None, :]
    staged_k.copy_(key * c + _rotate_half(key) * s)
    staged_v.copy_(value)
    return query * c + _rotate_half(query) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def kernel_takes(query: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether ``query``'s rotation goes to the kernel."""
    dim = query.shape[-1]
    return (kernel_may_take(query) and cos.dtype == query.dtype and dim % 2 == 0
            and dim <= MAX_HEAD_DIM
            and cos.shape[-1] == dim)


def rotate_and_stage(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, staged_k: torch.Tensor,
                     staged_v: torch.Tensor) -> torch.Tensor:
    """`rotate_and_stage_reference` in one launch (Triton's interpreter for CPU tensors)."""
    n, q_heads, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape != (n, kv_heads, dim) or value.shape != key.shape:
        raise RotaryError(f"key: {tuple(key.shape)} and value {tuple(value.shape)} must be "
                          f"[{n}, heads, {dim}] like the query")
    if cos.shape != (n, dim) or sin.shape != cos.shape:
        raise RotaryError(f"cos: {tuple(cos.shape)} and sin {tuple(sin.shape)} must be "
                          f"[{n}, {dim}]")
    if dim % 2 or dim > MAX_HEAD_DIM or query.dtype not in KERNEL_DTYPES:
        raise RotaryError(f"query: the kernel takes even head sizes up to {MAX_HEAD_DIM} in "
                          f"float32 / bfloat16 / float16, got {dim} in {query.dtype}")
    if staged_k.shape != key.shape or staged_v.shape != key.shape:
        raise RotaryError(f"staged_k: {tuple(staged_k.shape)} must be the key's shape "
                          f"{tuple(key.shape)}")
    if any(t.stride(-1) != 1 for t in (query, key, value, cos, sin, staged_k, staged_v)):
        raise RotaryError("stride: every tensor's last dimension must be contiguous")
    from kvalloc.worker.kernels import rotate_and_stage as kernels

    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    kernel = kernel_for(kernels.rotate_and_stage_jit, query)
    rotated = kernel_for(kernels.ROTATED_JIT, query)
    kernel[(n,)](query, key, value, cos, sin, out, staged_k, staged_v,
                 query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                 value.stride(0), value.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                 staged_k.stride(0), staged_k.stride(1), staged_v.stride(0), staged_v.stride(1),
                 q_heads, kv_heads, HEAD_DIM=dim, BLOCK_HQ=pow2(q_heads),
                 BLOCK_HKV=pow2(kv_heads), BLOCK_D=max(16, pow2(dim)), ROTATED=rotated)
    return out


def fuse_attention_modules(model: torch.nn.Module) -> int:
    """Merge the q/k/v projections of every Llama / Qwen2 / Mistral attention module of
    ``model`` and point it at `fused_attention` (for the calls it takes); returns how many it
    switched. Calling it again switches none."""
    return switch_forwards(model, _WINDOWS, _forward, prepare=_merge_projections)


def fused_attention(module: torch.nn.Module, hidden_states: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor],
                    step: PoolStep) -> torch.Tensor:
    """The output of an attention module `fuse_attention_modules` switched, for one packed step
    (``hidden_states [1, N, hidden]``): its merged projection, one rotary-and-stage launch, the
    pool attention and ``o_proj``."""
    n, dim, layer = step.num_tokens, module.head_dim, module.layer_idx
    qkv = F.linear(hidden_states[0], module.qkv_weight, module.qkv_bias)
    query_width, kv_width = module.q_proj.weight.shape[0], module.k_proj.weight.shape[0]
    query = qkv[:, :query_width].view(n, -1, dim)
    key = qkv[:, query_width:query_width + kv_width].view(n, -1, dim)
    value = qkv[:, query_width + kv_width:].view(n, -1, dim)
    cos, sin = position_embeddings
    rotated = rotate_and_stage(query, key, value, cos[0], sin[0], step.staged(layer, 0),
                               step.staged(layer, 1))
    out = attend_staged(step, layer, rotated, module.scaling,
                        _WINDOWS[type(module).__name__](module))
    return module.o_proj(out.reshape(1, n, -1))


def _merge_projections(module: torch.nn.Module) -> bool:
    return merge_linears(module, ("q_proj", "k_proj", "v_proj"), "qkv")


def _takes(module: torch.nn.Module, hidden_states: torch.Tensor,
           position_embeddings: Any, step: Any) -> bool:
    if not isinstance(step, PoolStep) or position_embeddings is None or module.training:
        return False
    if module.config._attn_implementation != ATTN_IMPLEMENTATION:
        return False
    cos = position_embeddings[0]
    # Shaped as one head of the projections (their dtype and device): what both rules read.
    probe = hidden_states.new_empty((1, 1, module.head_dim))
    return (hidden_states.shape[:2] == (1, step.num_tokens) and kernel_takes(probe, cos)
            and attention_kernel_takes(probe, step.pool(module.layer_idx, 0),
                                          step.layout(module.layer_idx)))


def _forward(module: torch.nn.Module, hidden_states: torch.Tensor,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
             attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[Any, Any]:
    step = kwargs.get("kvalloc_step")
    if kwargs.get("cache") is None and _takes(module, hidden_states, position_embeddings, step):
        return fused_attention(module, hidden_states, position_embeddings, step), None
    return type(module).forward(module, hidden_states, position_embeddings, attention_mask,
                                **kwargs)
