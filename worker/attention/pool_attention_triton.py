"""`pool_attention_triton`: `worker.attention.pool_attention.pool_attention` as one Triton launch.

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

import torch

from worker.attention.pool_attention import PagedLayout, check_inputs, reject

MAX_HEAD_DIM = 256
MAX_KERNEL_QUERY = 64
_MAX_ROWS = 64  # query rows (queries x grouped heads) one program holds
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LaunchConfig:
    """How one launch is cut: ``block_n`` history keys per loop step, Triton's warps and
    pipeline stages, and ``splits``: programs sharing one entry's history (1, 2, 4 or 8; each
    keeps a partial softmax that a second launch merges), None for as many as keep every SM
    busy with two programs when entries alone do not."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    splits: int | None = None

    def __post_init__(self) -> None:
        if self.splits not in (None, 1, 2, 4, 8) or self.block_n not in (16, 32, 64, 128):
            reject("launch", f"splits must be 1, 2, 4 or 8 and block_n 16..128, a power of "
                             f"two, got {self.splits} and {self.block_n}")


def default_launch(head_dim: int) -> LaunchConfig:
    """The cut for a head size: the fastest of benchmarks/bench_attention.py's sweep on an H200
    for decode at batch 64 (a 128-wide head takes 32 keys a step, so its registers leave room
    for more programs per SM; three pipeline stages cost it a third more time there, two are
    as fast as three for a 64-wide head)."""
    return LaunchConfig(block_n=64 if head_dim <= 64 else 32, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class _Tiling:
    group: int  # query heads a KV head serves
    query_tile: int  # queries a program holds
    tiles: int  # query tiles per entry and KV head
    splits: int
    block_m: int  # query_tile x group rows, padded to a power of two (>= 16, for tl.dot)

    @classmethod
    def of(cls, query: torch.Tensor, kv_heads: int, layout: PagedLayout,
           launch: LaunchConfig) -> _Tiling:
        group = query.shape[1] // kv_heads
        query_tile = max(1, min(layout.max_query, _MAX_ROWS // group))
        tiles = -(-layout.max_query // query_tile)
        programs = layout.rows.numel() * kv_heads * tiles
        splits = launch.splits or _splits_to_fill(programs, query.device)
        return cls(group, query_tile, tiles, splits, max(16, _pow2(query_tile * group)))


def _splits_to_fill(programs: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while splits < 8 and programs * splits < target:
        splits *= 2
    return splits


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
    _check_kernel_inputs(query, (staged_k, staged_v, pool_k, pool_v), out, layout.block_table)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if layout.num_tokens == 0:
        return out
    _launch(query, staged_k, staged_v, pool_k, pool_v, layout, out,
            (query.shape[-1] ** -0.5 if scale is None else scale), window, (k_scale, v_scale),
            launch or default_launch(query.shape[-1]))
    return out


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _check_kernel_inputs(query: torch.Tensor, kv: tuple[torch.Tensor, ...],
                         out: torch.Tensor | None, table: torch.Tensor) -> None:
    if table.dtype != torch.int32 or table.stride(-1) != 1 or table.device != query.device:
        reject("block_table", f"expected int32 rows with contiguous entries on {query.device}, "
                              f"got {table.dtype} with stride {table.stride(-1)} on {table.device}")
    for name, tensor in zip(("query", "staged_k", "staged_v", "pool_k", "pool_v"),
                            (query, *kv), strict=True):
        if tensor.stride(-1) != 1 or tensor.device != query.device:
            reject(name, f"expected a contiguous last dimension on {query.device}, got stride "
                         f"{tensor.stride(-1)} on {tensor.device}")
    if query.dtype not in _KERNEL_DTYPES or query.shape[-1] > MAX_HEAD_DIM:
        reject("query", f"the kernel takes bf16 / fp16 / fp32 heads of at most {MAX_HEAD_DIM}, "
                        f"got {query.dtype} x {query.shape[-1]}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype
                            or out.device != query.device or out.stride(-1) != 1):
        reject("out", f"expected {query.dtype} {tuple(query.shape)} on {query.device}, got "
                      f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _launch(query: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
            pool_k: torch.Tensor, pool_v: torch.Tensor, layout: PagedLayout, out: torch.Tensor,
            scale: float, window: int | None, scales: tuple[torch.Tensor | None, ...],
            launch: LaunchConfig) -> None:
    from worker.attention import pool_attention_kernel as kernels

    if query.is_cuda:
        kernel, combine, helpers = (kernels.pool_attention_jit, kernels.combine_splits_jit,
                                    kernels.HELPERS_JIT)
    else:
        kernel, combine, helpers = kernels.interpreted()
    dim, kv_heads = query.shape[-1], pool_k.shape[2]
    tiling = _Tiling.of(query, kv_heads, layout, launch)
    block_d = max(16, _pow2(dim))
    grid = (layout.rows.numel(), kv_heads, tiling.tiles)
    fp8 = pool_k.dtype == torch.float8_e4m3fn
    if fp8:
        pool_k, pool_v = pool_k.view(torch.uint8), pool_v.view(torch.uint8)
    else:
        scales = (layout.rows, layout.rows)  # valid pointers, never read
    # Partial softmaxes when the history is split: sizes from host bounds only.
    parts = grid[0] * kv_heads * tiling.tiles * tiling.splits * tiling.block_m
    part_acc = out if tiling.splits == 1 else out.new_empty(parts * block_d, dtype=torch.float32)
    part_ml = out if tiling.splits == 1 else out.new_empty(parts * 2, dtype=torch.float32)
    table = layout.block_table
    kernel[(*grid[:2], tiling.tiles * tiling.splits)](
        query, staged_k, staged_v, pool_k, pool_v, table,
        layout.rows, layout.query_starts, layout.query_lens, layout.history, *scales, out,
        part_acc, part_ml, scale * math.log2(math.e), window or 0,
        table.shape[1], query.stride(0), query.stride(1), staged_k.stride(0), staged_k.stride(1),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=tiling.group, QUERY_TILE=tiling.query_tile, HEAD_DIM=dim,
        TOKENS_PER_BLOCK=layout.tokens_per_block, BLOCK_M=tiling.block_m,
        BLOCK_N=launch.block_n, BLOCK_S=min(launch.block_n, max(16, _pow2(tiling.query_tile))),
        BLOCK_D=block_d, WINDOWED=window is not None, FP8=fp8,
        # The interpreter's bf16 dot is wrong (it multiplies raw bits): it gets float32 tiles.
        DOT_F32=not query.is_cuda and query.dtype == torch.bfloat16,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SPLITS=tiling.splits,
        **helpers, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if tiling.splits > 1:
        combine[grid](part_acc, part_ml, layout.query_starts, layout.query_lens, out,
                      out.stride(0), out.stride(1), GROUP=tiling.group,
                      QUERY_TILE=tiling.query_tile, HEAD_DIM=dim, BLOCK_M=tiling.block_m,
                      BLOCK_D=block_d, SPLITS=tiling.splits, num_warps=4)
