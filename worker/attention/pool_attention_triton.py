"""`pool_attention_triton`: `worker.attention.pool_attention.pool_attention` in Triton launches.

Same inputs, same layout, same result (to rounding), plus an optional ``out``. No launch reads a
device value on the host: every grid is a size the host knows, and each program loops to its
entry's device-side history length. So it runs under an overlap worker's device-only histories
and is capturable in a CUDA graph for a fixed batch bucket (the layout's tensors and host bounds
fixed; a step with long chunks uploads its tile map on first use, before any capture).

A step takes up to two launches of the one kernel, split by each entry's host-known length:
- the decode launch, grid ``(entries, kv_heads, query tiles)`` with the tiles from the longest
  entry of at most ``MAX_DECODE_QUERY`` tokens (decode, drafts, short chunks), and the history
  split across programs when entries alone do not fill the device (`LaunchConfig`);
- the prefill launch, grid ``(tiles, kv_heads)`` over only the query tiles of the longer entries
  (FlashAttention's varlen layout: a host-built map of each tile's entry and first query, the
  tiles with most keys first), ``block_m`` rows and ``block_n`` keys a step (`PrefillConfig`),
  never split. Each tile's staged walk stops at its own last query.
In the decode launch a long entry's length reads 0, so its programs exit at once: a step of 63
decodes and one 8192-token chunk launches 64 x kv_heads decode programs, not 64 x kv_heads x 512.

`kernel_takes` is the dispatch rule: CUDA tensors, Triton installed, a head size of at most
``MAX_HEAD_DIM``, entries of any length.

On CPU tensors the kernel runs in Triton's interpreter: that is how CPU tests compare it with the
reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from kvalloc.worker.attention.pool_attention import HostBounds, PagedLayout, check_inputs, reject
from kvalloc.worker.kernels.helpers import (
    KERNEL_DTYPES,
    floor_pow2,
    kernel_for,
    kernel_may_take,
    pow2,
)

MAX_HEAD_DIM = 256
# Entries of at most this many tokens (decode, drafts, short chunks) take the decode launch;
# longer prefill chunks take the prefill launch of their own.
MAX_DECODE_QUERY = 64
_MAX_ROWS = 64  # query rows (queries x grouped heads) one program holds


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
class PrefillConfig:
    """How the prefill launch is cut: ``block_m`` query rows a program holds (queries x the
    query heads of one KV head), ``block_n`` keys a loop step (history and staged alike),
    Triton's warps and pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        if self.block_m not in (16, 32, 64, 128) or self.block_n not in (16, 32, 64, 128):
            reject("prefill", f"block_m and block_n must be 16..128, a power of two, got "
                              f"{self.block_m} and {self.block_n}")


def default_prefill(head_dim: int) -> PrefillConfig:
    """The prefill cut for a head size: the fastest of benchmarks/bench_attention.py's
    ``--prefill --sweep`` on an H200 (4 chunks of 2048 after 4096 tokens, bf16); a 128-wide
    head takes 32 keys a step, as in decode."""
    return PrefillConfig(block_m=128, block_n=64 if head_dim <= 64 else 32, num_warps=4,
                         num_stages=2)


@dataclass(frozen=True)
class _Tiling:
    group: int  # query heads a KV head serves
    query_tile: int  # queries a program holds
    tiles: int  # query tiles per entry and KV head
    splits: int
    block_m: int  # query_tile x group rows, padded to a power of two (>= 16, for tl.dot)

    @classmethod
    def of(cls, group: int, kv_heads: int, entries: int, max_query: int, launch: LaunchConfig,
           device: torch.device) -> _Tiling:
        # Powers of two: each distinct tile is a kernel of its own to compile (seconds, mid-run,
        # the first time a step's longest entry has a new length), and five cover 1..64.
        query_tile = min(pow2(max(1, max_query)), floor_pow2(max(1, _MAX_ROWS // group)))
        tiles = -(-max_query // query_tile)
        programs = entries * kv_heads * tiles
        splits = launch.splits or splits_to_fill(programs, device)
        return cls(group, query_tile, tiles, splits, max(16, pow2(query_tile * group)))


def splits_to_fill(programs: int, device: torch.device) -> int:
    """Programs per entry's history (1..8) so that ``programs`` x it keeps every SM of
    ``device`` busy with two (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while splits < 8 and programs * splits < target:
        splits *= 2
    return splits


def kernel_takes(query: torch.Tensor, pool_k: torch.Tensor, layout: PagedLayout) -> bool:
    """Whether the step's attention goes to the kernel rather than the reference."""
    return (kernel_may_take(query) and query.shape[-1] <= MAX_HEAD_DIM
            and (pool_k.dtype == query.dtype or pool_k.dtype == torch.float8_e4m3fn))


def pool_attention_triton(query: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
                          pool_k: torch.Tensor, pool_v: torch.Tensor, layout: PagedLayout, *,
                          scale: float | None = None, window: int | None = None,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                          launch: LaunchConfig | None = None,
                          prefill: PrefillConfig | None = None) -> torch.Tensor:
    """`pool_attention`'s contract; ``out`` (``[N, Hq, D]``, the query's dtype and device), when
    given, receives the result. Every tensor's last dimension must be contiguous. ``launch``
    cuts the decode launch, ``prefill`` the prefill launch (by default, each for the head
    size)."""
    check_inputs(query, staged_k, staged_v, pool_k, pool_v, layout, window=window,
                 k_scale=k_scale, v_scale=v_scale)
    _check_kernel_inputs(query, (staged_k, staged_v, pool_k, pool_v), out, layout.block_table)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if layout.num_tokens == 0:
        return out
    _launch(query, staged_k, staged_v, pool_k, pool_v, layout, out,
            (query.shape[-1] ** -0.5 if scale is None else scale), window, (k_scale, v_scale),
            launch or default_launch(query.shape[-1]), prefill or default_prefill(query.shape[-1]))
    return out


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
    if query.dtype not in KERNEL_DTYPES or query.shape[-1] > MAX_HEAD_DIM:
        reject("query", f"the kernel takes bf16 / fp16 / fp32 heads of at most {MAX_HEAD_DIM}, "
                        f"got {query.dtype} x {query.shape[-1]}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype
                            or out.device != query.device or out.stride(-1) != 1):
        reject("out", f"expected {query.dtype} {tuple(query.shape)} on {query.device}, got "
                      f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _launch(query: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
            pool_k: torch.Tensor, pool_v: torch.Tensor, layout: PagedLayout, out: torch.Tensor,
            scale: float, window: int | None, scales: tuple[torch.Tensor | None, ...],
            launch: LaunchConfig, prefill: PrefillConfig) -> None:
    """The prefill launch for the entries longer than ``MAX_DECODE_QUERY``, then the decode
    launch for the others (with the long ones' lengths zeroed, so their programs exit at once):
    which entries are long is a host bound, so neither launch reads a device value."""
    call = _Call.of(query, staged_k, staged_v, pool_k, pool_v, layout, out, scale, window, scales)
    long = layout.bounds.query_lens > MAX_DECODE_QUERY
    if long.any():
        call.prefill(prefill)
    short_max = int(layout.bounds.query_lens[~long].max(initial=0))
    if short_max:
        lens = layout.query_lens if not long.any() else layout.cached(
            "decode_lens", lambda: np.where(long, 0, layout.bounds.query_lens))
        call.decode(lens, short_max, launch)


@dataclass(frozen=True)
class _Call:
    """One attention call's operands in the kernel's order, shared by its launches."""

    kernels: tuple  # (attention, combine, helpers): compiled for CUDA tensors, else interpreted
    layout: PagedLayout
    before_lens: tuple  # query .. query_starts
    after_lens: tuple  # history .. out
    scalars: tuple  # softmax scale, window, table width, strides
    constexprs: dict
    out: torch.Tensor

    @classmethod
    def of(cls, query: torch.Tensor, staged_k: torch.Tensor, staged_v: torch.Tensor,
           pool_k: torch.Tensor, pool_v: torch.Tensor, layout: PagedLayout, out: torch.Tensor,
           scale: float, window: int | None, scales: tuple[torch.Tensor | None, ...]) -> _Call:
        from kvalloc.worker.kernels import pool_attention as kernels

        chosen = (kernel_for(kernels.pool_attention_jit, query),
                  kernel_for(kernels.combine_splits_jit, query),
                  {name: kernel_for(jitted, query) for name, jitted in kernels.HELPERS_JIT.items()})
        fp8 = pool_k.dtype == torch.float8_e4m3fn
        if fp8:
            pool_k, pool_v = pool_k.view(torch.uint8), pool_v.view(torch.uint8)
        else:
            scales = (layout.rows, layout.rows)  # valid pointers, never read
        table = layout.block_table
        dim = query.shape[-1]
        scalars = (scale * math.log2(math.e), window or 0, table.shape[1], query.stride(0),
                   query.stride(1), staged_k.stride(0), staged_k.stride(1), pool_k.stride(0),
                   pool_k.stride(1), pool_k.stride(2), table.stride(0), out.stride(0),
                   out.stride(1))
        constexprs = dict(
            GROUP=query.shape[1] // pool_k.shape[2], HEAD_DIM=dim,
            TOKENS_PER_BLOCK=layout.tokens_per_block, BLOCK_D=max(16, pow2(dim)),
            WINDOWED=window is not None, FP8=fp8,
            # The interpreter's bf16 dot is wrong (it multiplies raw bits): float32 tiles.
            DOT_F32=not query.is_cuda and query.dtype == torch.bfloat16,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **chosen[2])
        return cls(chosen, layout, (query, staged_k, staged_v, pool_k, pool_v, table,
                                    layout.rows, layout.query_starts),
                   (layout.history, *scales, out), scalars, constexprs, out)

    @property
    def kv_heads(self) -> int:
        return self.before_lens[3].shape[2]

    def decode(self, lens: torch.Tensor, max_query: int, launch: LaunchConfig) -> None:
        """Grid ``(entries, kv_heads, tiles x splits)``, tiles from ``max_query``: the cut
        `default_launch` was measured on, unchanged for decode-only steps."""
        group, block_d = self.constexprs["GROUP"], self.constexprs["BLOCK_D"]
        tiling = _Tiling.of(group, self.kv_heads, self.layout.rows.numel(), max_query,
                            launch, self.out.device)
        grid = (self.layout.rows.numel(), self.kv_heads, tiling.tiles)
        # Partial softmaxes when the history is split: sizes from host bounds only.
        parts = grid[0] * self.kv_heads * tiling.tiles * tiling.splits * tiling.block_m
        one = tiling.splits == 1
        part_acc = self.out if one else self.out.new_empty(parts * block_d, dtype=torch.float32)
        part_ml = self.out if one else self.out.new_empty(parts * 2, dtype=torch.float32)
        self.kernels[0][(*grid[:2], tiling.tiles * tiling.splits)](
            *self.before_lens, lens, *self.after_lens, part_acc, part_ml, self.layout.rows,
            *self.scalars, **self.constexprs, QUERY_TILE=tiling.query_tile,
            BLOCK_M=tiling.block_m, BLOCK_N=launch.block_n,
            BLOCK_S=min(launch.block_n, max(16, pow2(tiling.query_tile))),
            SPLITS=tiling.splits, TILE_MAP=False, num_warps=launch.num_warps,
            num_stages=launch.num_stages)
        if not one:
            self.kernels[1][grid](
                part_acc, part_ml, self.layout.query_starts, lens, self.out,
                self.out.stride(0), self.out.stride(1), GROUP=group,
                QUERY_TILE=tiling.query_tile, HEAD_DIM=self.constexprs["HEAD_DIM"],
                BLOCK_M=tiling.block_m, BLOCK_D=block_d, SPLITS=tiling.splits, VALUE_SPLIT=1,
                num_warps=4)

    def prefill(self, config: PrefillConfig) -> None:
        """Grid ``(tiles, kv_heads)`` over the long entries' query tiles only, in whole
        ``block_n`` key steps for the staged walk too, with no split: a long chunk's tiles
        alone fill the device."""
        group = self.constexprs["GROUP"]
        query_tile = max(1, config.block_m // group)
        tile_map = self.layout.cached(("prefill_tiles", query_tile),
                                      lambda: prefill_tiles(self.layout.bounds, query_tile))
        self.kernels[0][(tile_map.shape[0] // 2, self.kv_heads, 1)](
            *self.before_lens, self.layout.query_lens, *self.after_lens, self.out, self.out,
            tile_map, *self.scalars, **self.constexprs, QUERY_TILE=query_tile,
            BLOCK_M=max(16, pow2(query_tile * group)), BLOCK_N=config.block_n,
            BLOCK_S=config.block_n, SPLITS=1, TILE_MAP=True, num_warps=config.num_warps,
            num_stages=config.num_stages)


def prefill_tiles(bounds: HostBounds, query_tile: int) -> np.ndarray:
    """int64 ``[2 x tiles]``: the entry of every query tile of the entries longer than
    ``MAX_DECODE_QUERY``, then its first query. The tiles with the most keys to walk (by the
    host's bound) come first, so the short ones fill in behind them instead of leaving a tail."""
    entries = np.flatnonzero(bounds.query_lens > MAX_DECODE_QUERY)
    firsts = [np.arange(0, bounds.query_lens[e], query_tile) for e in entries]
    tile_entry = np.repeat(entries, [f.size for f in firsts])
    first = np.concatenate(firsts)
    keys = bounds.reach[tile_entry] - bounds.query_lens[tile_entry] + first
    order = np.argsort(-keys, kind="stable")
    return np.concatenate([tile_entry[order], first[order]])
