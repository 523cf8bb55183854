"""`pool_attention_triton`: `worker.pool_attention.pool_attention` as one Triton launch.

Same inputs, same layout, same result (to rounding), plus an optional ``out``. The launch reads
no device value on the host: its grid is ``(entries, kv_heads, query tiles)``, all sizes the
host knows (the layout's ``max_query`` bounds the tiles), and each program loops to its entry's
device-side history length. So it runs under an overlap worker's device-only histories and is
capturable in a CUDA graph for a fixed batch bucket (the layout's tensors and ``max_query`` fixed).

`kernel_takes` is the dispatch rule: CUDA tensors, Triton installed, a head size of at most
``MAX_HEAD_DIM`` and entries of at most ``MAX_KERNEL_QUERY`` tokens (decode, drafts and short
prefill chunks); a longer prefill chunk keeps the reference, whose SDPA suits it.

On CPU tensors the kernel runs in Triton's interpreter: that is how CPU tests compare it with the
reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import NoReturn

import torch

from worker.pool_attention import PagedLayout, PoolAttentionInputError, check_inputs

MAX_HEAD_DIM = 256
MAX_KERNEL_QUERY = 64
_MAX_ROWS = 64  # query rows (queries x grouped heads) one program holds
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LaunchConfig:
    """How one launch is cut: ``block_n`` history keys per loop step, Triton's warps and
    pipeline stages."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_launch(head_dim: int) -> LaunchConfig:
    """The cut for a head size (benchmarks/bench_attention.py --sweep times the others)."""
    return LaunchConfig(num_warps=4 if head_dim <= 64 else 8)


@cache
def triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def kernel_takes(query: torch.Tensor, pool_k: torch.Tensor, layout: PagedLayout) -> bool:
    """Whether the step's attention goes to the kernel rather than the reference."""
    return (query.is_cuda and triton_available() and query.shape[-1] <= MAX_HEAD_DIM
            and query.dtype in _KERNEL_DTYPES and layout.max_query <= MAX_KERNEL_QUERY
            and (pool_k.dtype == query.dtype or pool_k.dtype == torch.float8_e4m3fn))


def pool_attention_triton(query: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
                          pool_k: torch.Tensor, pool_v: torch.Tensor, layout: PagedLayout, *,
                          scale: float | None = None, window: int | None = None,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                          launch: LaunchConfig | None = None) -> torch.Tensor:
    """`pool_attention`'s contract; ``out`` (``[N, Hq, D]``, the query's dtype and device), when
    given, receives the result. Every tensor's last dimension must be contiguous."""
    check_inputs(query, staged_k, staged_v, pool_k, pool_v, layout, window=window,
                 k_scale=k_scale, v_scale=v_scale)
    launch = launch or default_launch(query.shape[-1])
    _check_kernel_inputs(query, (staged_k, staged_v, pool_k, pool_v), out)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if layout.num_tokens == 0:
        return out
    from worker import pool_attention_kernel as kernels

    if query.is_cuda:
        kernel, update = kernels.pool_attention_jit, kernels.online_update_jit
    else:
        kernel, update = kernels.interpreted()
    heads, dim = query.shape[1:]
    kv_heads = pool_k.shape[2]
    group = heads // kv_heads
    query_tile = max(1, min(layout.max_query, _MAX_ROWS // group))
    fp8 = pool_k.dtype == torch.float8_e4m3fn
    scales = (k_scale, v_scale) if fp8 else (layout.rows, layout.rows)  # never read unless fp8
    grid = (layout.rows.numel(), kv_heads, -(-layout.max_query // query_tile))
    table = layout.block_table
    if fp8:
        pool_k, pool_v = pool_k.view(torch.uint8), pool_v.view(torch.uint8)
    kernel[grid](
        query, staged_k, staged_v, pool_k, pool_v, table,
        layout.rows, layout.query_starts, layout.query_lens, layout.history, *scales, out,
        (dim ** -0.5 if scale is None else scale) * math.log2(math.e), window or 0,
        table.shape[1], query.stride(0), query.stride(1), staged_k.stride(0), staged_k.stride(1),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, QUERY_TILE=query_tile, HEAD_DIM=dim,
        TOKENS_PER_BLOCK=layout.tokens_per_block,
        BLOCK_M=max(16, _pow2(query_tile * group)), BLOCK_N=launch.block_n,
        BLOCK_S=min(launch.block_n, max(16, _pow2(query_tile))), BLOCK_D=max(16, _pow2(dim)),
        WINDOWED=window is not None, FP8=fp8,
        # The interpreter's bf16 dot is wrong (it multiplies raw bits): it gets float32 tiles.
        DOT_F32=not query.is_cuda and query.dtype == torch.bfloat16,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", UPDATE=update,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return out


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_kernel_inputs(query: torch.Tensor, kv: tuple[torch.Tensor, ...],
                         out: torch.Tensor | None) -> None:
    for name, tensor in zip(("query", "staged_k", "staged_v", "pool_k", "pool_v"),
                            (query, *kv), strict=True):
        if tensor.stride(-1) != 1 or tensor.device != query.device:
            _reject(name, f"expected a contiguous last dimension on {query.device}, got stride "
                        f"{tensor.stride(-1)} on {tensor.device}")
    if query.dtype not in _KERNEL_DTYPES or query.shape[-1] > MAX_HEAD_DIM:
        _reject("query", f"the kernel takes bf16 / fp16 / fp32 heads of at most {MAX_HEAD_DIM}, "
                       f"got {query.dtype} x {query.shape[-1]}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype
                            or out.device != query.device or out.stride(-1) != 1):
        _reject("out", f"expected {query.dtype} {tuple(query.shape)} on {query.device}, got "
                     f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _reject(field: str, message: str) -> NoReturn:
    raise PoolAttentionInputError(f"{field}: {message}", field=field)
