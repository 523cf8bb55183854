"""`latent_attention_triton`: `worker.attention.latent_attention.latent_attention` in one Triton
launch (`worker.kernels.latent_attention`), plus the split merge of the GQA kernel's module when
an entry's history is split.

Grid ``(head_blocks, entries, query_tiles x splits)``: a program holds ``GROUP`` heads (the
largest power of two dividing the head count, at most `LatentLaunch.block_h`) times a tile of
its entry's queries, at most ``max_rows`` rows; a decode entry (1 + D tokens) is one tile. Any
entry length is correct (a prefill chunk is ``max_query / QUERY_TILE`` tiles, the short entries'
extra tiles exit at once), so on CUDA the kernel takes prefill chunks as well as decodes.
Splits: as many programs per entry's history as keep every SM busy (`splits_to_fill`), unless
the launch fixes them.

`kernel_takes` is the dispatch rule: CUDA tensors of a kernel dtype, Triton installed, a pool in
the query's dtype or fp8. On CPU tensors the kernel runs in Triton's interpreter (the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from kvalloc.worker.attention.latent_attention import check_latent_inputs
from kvalloc.worker.attention.pool_attention import PagedLayout, reject
from kvalloc.worker.attention.pool_attention_triton import splits_to_fill
from kvalloc.worker.kernels.helpers import floor_pow2, kernel_for, kernel_may_take, pow2


@dataclass(frozen=True)
class LatentLaunch:
    """How the launch is cut: ``block_h`` heads a program holds at most, ``max_rows`` rows
    (queries x heads) a program holds at most, ``block_n`` history tokens per loop step,
    Triton's warps and stages, ``splits`` (1, 2, 4, 8 or None: `splits_to_fill`),
    ``value_split`` (1 or 2: programs sharing a tile's value columns, each its own chunk; 1
    where the latent's width is odd) and ``lazy_rescale`` (the accumulator rescaled only when
    a row's max grows by more than `online_softmax.RESCALE_SLACK`: fewer passes over it, the
    same result).

    The defaults, by the rule that a program's fp32 accumulator must fit its registers without
    spilling, with rows enough for the tensor cores: 128 rows (32 heads x 4 queries, two
    warpgroups of Hopper's 64-row products) with the value columns split in two, so the
    ``[128, 256]`` accumulator takes 128 registers a thread of 8 warps. The unsplit
    ``[64, 512]`` at 64 rows takes as many, but its score tile is then computed by both
    warpgroups and the program spills (ptxas for sm_90: 255 registers and 264 bytes of stack a
    thread; the 128-row cut: about 231 and none). 64 tokens a step in one stage (the queries,
    128 KiB, and one 72 KiB latent tile in shared memory): the fastest of `LATENT_CANDIDATES`
    at 1k, 4k and 16k tokens of context on an H200 (benchmarks/bench_mla.py times them
    against each other), ahead of 32 tokens in two stages by a fifth."""

    block_h: int = 32
    max_rows: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 1
    splits: int | None = None
    value_split: int = 2
    lazy_rescale: bool = False

    def __post_init__(self) -> None:
        if (self.splits not in (None, 1, 2, 4, 8) or self.block_n not in (16, 32, 64, 128)
                or self.max_rows not in (16, 32, 64, 128) or self.block_h < 1
                or self.block_h > self.max_rows or self.value_split not in (1, 2)
                or not isinstance(self.lazy_rescale, bool)):
            reject("launch", f"splits 1/2/4/8, block_n and max_rows 16..128 (powers of two), "
                             f"1 <= block_h <= max_rows, value_split 1 or 2, lazy_rescale a "
                             f"bool; got {self}")


def _cut(rows: int, block_n: int, warps: int, stages: int, value_split: int,
         lazy: bool = False) -> LatentLaunch:
    return LatentLaunch(block_h=rows // 4, max_rows=rows, block_n=block_n, num_warps=warps,
                        num_stages=stages, value_split=value_split, lazy_rescale=lazy)


# The cuts a sweep compares at 128 heads x 4 queries, each fitting an H200's shared memory
# (227 KiB) at DeepSeek-V3's latent, (rows, block_n, warps, stages, value split): the
# unsplit 64 rows of 8 warps (the first default); 64 rows of one warpgroup, split, whose
# accumulator is 128 registers a thread and whose smaller tiles let two programs share an SM
# (at most ~113 KiB each: 16 tokens a step in 2 stages, or 32 in 1); 128 rows of two
# warpgroups, split, in every tile and stage count that fits; and two of those with the lazy
# rescale, (rows, block_n, warps, stages, value split, lazy).
LATENT_CANDIDATES = tuple(_cut(*cut) for cut in (
    (64, 32, 8, 2, 1),
    (64, 16, 4, 2, 2), (64, 16, 4, 3, 2), (64, 32, 4, 1, 2), (64, 32, 4, 2, 2),
    (128, 16, 8, 2, 2), (128, 16, 8, 3, 2), (128, 32, 8, 1, 2), (128, 32, 8, 2, 2),
    (128, 64, 8, 1, 2), (64, 16, 4, 2, 2, True), (128, 32, 8, 2, 2, True)))


def kernel_takes(q_latent: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether the step's latent attention goes to the kernel rather than the reference."""
    return kernel_may_take(q_latent) and pool.dtype in (q_latent.dtype, torch.float8_e4m3fn)


def latent_attention_triton(q_latent: torch.Tensor, q_rope: torch.Tensor, staged: torch.Tensor,
                            pool: torch.Tensor, layout: PagedLayout, *, scale: float,
                            window: int | None = None, kv_scale: torch.Tensor | None = None,
                            out: torch.Tensor | None = None,
                            launch: LatentLaunch | None = None) -> torch.Tensor:
    """`latent_attention`'s contract; ``out`` (``[N, H, R]``, the query's dtype), when given,
    receives the result. Every tensor's last dimension must be contiguous."""
    check_latent_inputs(q_latent, q_rope, staged, pool, layout, kv_scale, window)
    tensors = (q_latent, q_rope, staged, pool, layout.block_table)
    if any(t.stride(-1) != 1 or t.device != q_latent.device for t in tensors):
        reject("q_latent", f"every tensor's last dimension contiguous, on {q_latent.device}")
    if out is None:
        out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    elif out.shape != q_latent.shape or out.dtype != q_latent.dtype or out.stride(-1) != 1:
        reject("out", f"expected {q_latent.dtype} {tuple(q_latent.shape)}, got {out.dtype} "
                      f"{tuple(out.shape)}")
    if layout.num_tokens:
        _launch(q_latent, q_rope, staged, pool, layout, out, scale, window, kv_scale,
                sized_for(launch or LatentLaunch(), q_latent.dtype, q_latent.device))
    return out


def sized_for(launch: LatentLaunch, dtype: torch.dtype, device: torch.device) -> LatentLaunch:
    """``launch`` as it runs on queries of ``dtype`` on ``device``: cuts are stated for 2-byte
    queries, whose tiles fill an sm_90 block's shared memory at the default; float32 queries on
    a GPU take half the rows and half the latents a step, so their tiles take the same bytes
    (the whole cut needs 432 KiB there, which no launch gets)."""
    if device.type != "cuda" or dtype.itemsize <= 2:
        return launch
    rows = max(16, launch.max_rows // 2)
    return replace(launch, max_rows=rows, block_h=max(1, min(launch.block_h // 2, rows)),
                   block_n=max(16, launch.block_n // 2))


def _launch(q_latent: torch.Tensor, q_rope: torch.Tensor, staged: torch.Tensor,
            pool: torch.Tensor, layout: PagedLayout, out: torch.Tensor, scale: float,
            window: int | None, kv_scale: torch.Tensor | None, launch: LatentLaunch) -> None:
    from kvalloc.worker.kernels import latent_attention as kernels
    from kvalloc.worker.kernels import pool_attention as gqa

    heads, rank = q_latent.shape[1:]
    group = math.gcd(heads, floor_pow2(launch.block_h))
    max_query = max(1, layout.max_query)
    query_tile = min(pow2(max_query), floor_pow2(max(1, launch.max_rows // group)))
    tiles = -(-max_query // query_tile)
    entries = layout.rows.numel()
    value_split = launch.value_split if rank % launch.value_split == 0 else 1
    width = rank // value_split
    grid = (heads // group * value_split, entries, tiles)
    splits = launch.splits or splits_to_fill(grid[0] * entries * tiles, out.device)
    block_m, block_v = max(16, pow2(query_tile * group)), max(16, pow2(width))
    fp8 = pool.dtype == torch.float8_e4m3fn
    if fp8:
        pool = pool.view(torch.uint8)
    else:
        kv_scale = layout.rows  # a valid pointer, never read
    parts = grid[0] * entries * tiles * splits * block_m
    one = splits == 1
    part_acc = out if one else out.new_empty(parts * block_v, dtype=torch.float32)
    part_ml = out if one else out.new_empty(parts * 2, dtype=torch.float32)
    table = layout.block_table
    kernel = kernel_for(kernels.latent_attention_jit, q_latent)
    kernel[(grid[0], entries, tiles * splits)](
        q_latent, q_rope, staged, pool, table, layout.rows, layout.query_starts,
        layout.query_lens, layout.history, kv_scale, out, part_acc, part_ml,
        scale * math.log2(math.e), window or 0, table.shape[1], q_latent.stride(0),
        q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), staged.stride(0),
        pool.stride(0), pool.stride(1), table.stride(0), out.stride(0), out.stride(1),
        RANK=rank, ROPE=q_rope.shape[-1], WIDTH=width, BLOCK_V=block_v,
        BLOCK_P=max(16, pow2(q_rope.shape[-1])), GROUP=group, QUERY_TILE=query_tile,
        BLOCK_M=block_m, BLOCK_N=launch.block_n,
        BLOCK_S=min(launch.block_n, max(16, pow2(query_tile))),
        TOKENS_PER_BLOCK=layout.tokens_per_block, VALUE_SPLIT=value_split,
        WINDOWED=window is not None, FP8=fp8,
        # The interpreter's bf16 dot is wrong (it multiplies raw bits): float32 tiles.
        DOT_F32=not q_latent.is_cuda and q_latent.dtype == torch.bfloat16,
        PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        LAZY=launch.lazy_rescale, SPLITS=splits,
        **{name: kernel_for(jitted, q_latent) for name, jitted in kernels.HELPERS_JIT.items()},
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if not one:
        combine = kernel_for(gqa.combine_splits_jit, q_latent)
        combine[(entries, grid[0], tiles)](
            part_acc, part_ml, layout.query_starts, layout.query_lens, out, out.stride(0),
            out.stride(1), GROUP=group, QUERY_TILE=query_tile, HEAD_DIM=width, BLOCK_M=block_m,
            BLOCK_D=block_v, SPLITS=splits, VALUE_SPLIT=value_split, num_warps=4)
