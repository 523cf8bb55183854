"""`write_staged`: NWOR's commit write, staged K/V rows of every layer into their pool slots.

Contract (both backends give identical bytes):
- ``pool_rows`` is `KVStorage.rows()`: ``[L, P, num_slots, row]`` with ``P`` the pool's planes
  (2: K and V; 1: an MLA latent, `PoolConfig.kv_planes`); ``staged`` is ``[L, P, capacity,
  row]``; ``slots`` is int64 ``[L, >= num_rows]``; ``layer_rows`` is int64 ``[L]`` (rows staged
  per layer).
- Staged row ``(l, p, t)`` is written to ``pool_rows[l, p, slots[l, t]]`` iff
  ``t < min(num_rows, layer_rows[l])`` and ``0 <= slots[l, t] < num_slots``. Every other byte of
  the pool is left as it was: -1 marks a rejected or padded token, and an out-of-range slot is
  skipped rather than written out of bounds. Slots within one layer must be distinct.
- fp8 pools store ``e4m3(clamp(value * inv_scale, -448, 448))`` rounded to nearest even, with
  ``inv_scales[l, p] = 1 / scale`` (value = stored * scale). Saturating, as fp8 KV-cache writers
  do, so an outlier becomes +-448 instead of NaN. Other pools copy the staged bits unchanged.

``fence`` (a `fence.WriterFence`): the write happens only if the writer's fence word still holds
the number the writer expects, read on the device by the write itself (the Triton kernel's every
program, the torch path's keep mask); on a CPU pool it is read just before each layer's copy.

``backend``: ``triton`` is one fused launch over all layers with no host synchronisation (so it
can be captured in a CUDA graph); on a CPU tensor it runs in Triton's interpreter, which is how CPU
tests compare it with the ``torch`` path bit for bit. ``torch`` is the plain reference path (it
synchronises on CUDA: it selects rows with ``nonzero``); on a CPU pool its copy case goes through
numpy views of the same memory, which is cheaper there. ``auto`` picks Triton on CUDA when it is
installed, torch otherwise.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from kvalloc.allocator.common.triton_support import triton_available
from kvalloc.allocator.errors import NworInputError, SlotDtypeError
from kvalloc.allocator.nwor.fence import WriterFence

Backend = Literal["auto", "torch", "triton"]
FP8_MAX = 448.0
_FP8 = torch.float8_e4m3fn
_FP8_SOURCES = (torch.bfloat16, torch.float16, torch.float32)
_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_TILE_ELEMENTS = 4096  # elements one program moves per column block: ~8 KiB of bf16


def resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise NworInputError("backend: 'triton' requested but triton is not installed",
                             field="backend")
    if backend not in ("torch", "triton"):
        raise NworInputError(f"backend: {backend!r} is not auto | torch | triton",
                             field="backend")
    return backend


def quantise_fp8(values: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(values * inv_scale, -448, 448))``; ``inv_scale`` broadcasts per row."""
    scaled = values.to(torch.float32) * inv_scale.to(torch.float32)[..., None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(_FP8)


def write_staged(pool_rows: torch.Tensor, staged: torch.Tensor, slots: torch.Tensor,
                 layer_rows: torch.Tensor, num_rows: int,
                 inv_scales: torch.Tensor | None = None, *, backend: Backend = "auto",
                 fence: WriterFence | None = None) -> None:
    """Write the staged rows selected by the contract above into the pool, in place."""
    _check(pool_rows, staged, slots, layer_rows, num_rows, inv_scales)
    if fence is not None:
        fence.check(pool_rows.device)
    if num_rows == 0 or pool_rows.shape[0] == 0:
        return
    if resolve_backend(backend, pool_rows.device) == "triton":
        _write_triton(pool_rows, staged, slots, layer_rows, num_rows, inv_scales, fence)
    else:
        _write_torch(pool_rows, staged, slots, layer_rows, num_rows, inv_scales, fence)


def _write_torch(pool_rows: torch.Tensor, staged: torch.Tensor, slots: torch.Tensor,
                 layer_rows: torch.Tensor, num_rows: int,
                 inv_scales: torch.Tensor | None, fence: WriterFence | None) -> None:
    num_slots = pool_rows.shape[2]
    if inv_scales is None and pool_rows.device.type == "cpu":
        _copy_rows_cpu(pool_rows, staged, slots, layer_rows, num_rows, fence)
        return
    window = slots[:, :num_rows]
    t = torch.arange(num_rows, device=slots.device)
    keep = (window >= 0) & (window < num_slots) & (t[None, :] < layer_rows[:, None])
    if fence is not None:
        keep &= fence.word == fence.expected
    layer, row = keep.nonzero(as_tuple=True)
    slot = window[layer, row]
    pool_bits = pool_rows.view(_BITS_VIEW[pool_rows.element_size()])
    for plane in range(pool_rows.shape[1]):
        src = staged[layer, plane, row]
        if inv_scales is not None:
            src = quantise_fp8(src, inv_scales[layer, plane])
        pool_bits[layer, plane, slot] = src.view(pool_bits.dtype)


def _copy_rows_cpu(pool_rows: torch.Tensor, staged: torch.Tensor, slots: torch.Tensor,
                   layer_rows: torch.Tensor, num_rows: int, fence: WriterFence | None) -> None:
    """The copy case on a CPU pool, per layer through numpy views of the raw bits: torch's
    multi-index ``index_put_`` costs about 3x as much on CPU, and on a CPU pool the commit sits on
    the service's per-step critical path. Each row moves as one element (`_whole_rows`): numpy
    then copies a row per index instead of looping over its elements (6x faster on rows in cache,
    about 10% on a service's step, whose rows are mostly new memory). Same selection and bytes as
    the torch path."""
    num_slots = pool_rows.shape[2]
    bits = _BITS_VIEW[pool_rows.element_size()]
    pool_np = pool_rows.view(bits).numpy()
    staged_np = staged.view(bits).numpy()
    window = slots[:, :num_rows].numpy()
    for layer, staged_rows in enumerate(layer_rows.tolist()):
        if fence is not None and fence.word.numpy()[0] != fence.expected.numpy()[0]:
            return  # read again before each layer: a stalled writer stops at the next layer
        layer_slots = window[layer, : max(0, min(num_rows, staged_rows))]
        row = np.flatnonzero((layer_slots >= 0) & (layer_slots < num_slots))
        slot = layer_slots[row]
        for plane in range(pool_np.shape[1]):
            _whole_rows(pool_np[layer, plane])[slot] = _whole_rows(staged_np[layer, plane])[row]


def _whole_rows(rows: np.ndarray) -> np.ndarray:
    """``rows`` (2-D) as a 1-D view of one opaque element per row, where each row is contiguous;
    else ``rows`` itself."""
    if rows.shape[1] == 0 or rows.strides[1] != rows.dtype.itemsize:
        return rows
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.dtype.itemsize)))[:, 0]


def _write_triton(pool_rows: torch.Tensor, staged: torch.Tensor, slots: torch.Tensor,
                  layer_rows: torch.Tensor, num_rows: int,
                  inv_scales: torch.Tensor | None, fence: WriterFence | None) -> None:
    from kvalloc.allocator.nwor import commit_triton as ct

    kernel = ct.commit_rows_jit if pool_rows.is_cuda else ct.interpreted("commit_rows")
    num_layers, planes, num_slots, row = pool_rows.shape
    if inv_scales is None:
        src_kind, staged_arg = ct.SRC_COPY, staged.view(_BITS_VIEW[staged.element_size()])
    elif staged.dtype == torch.bfloat16:
        src_kind, staged_arg = ct.SRC_BF16_TO_FP8, staged.view(torch.int16)
    else:
        src_kind, staged_arg = ct.SRC_FLOAT_TO_FP8, staged
    block_d = min(1 << (row - 1).bit_length(), 1024)
    block_t = max(1, _TILE_ELEMENTS // block_d)
    grid = (ct.cdiv(num_rows, block_t), num_layers, planes)
    kernel[grid](
        pool_rows.view(_BITS_VIEW[pool_rows.element_size()]), staged_arg, slots, layer_rows,
        layer_rows if inv_scales is None else inv_scales,  # a valid pointer, never read for copies
        layer_rows if fence is None else fence.word,  # valid pointers, read only when FENCED
        layer_rows if fence is None else fence.expected,
        num_rows, num_slots, staged.shape[2], slots.stride(0),
        ROW=row, PLANES=planes, BLOCK_T=block_t, BLOCK_D=block_d, SRC=src_kind.value,
        FENCED=fence is not None,
    )


def _check(pool_rows: torch.Tensor, staged: torch.Tensor, slots: torch.Tensor,
           layer_rows: torch.Tensor, num_rows: int, inv_scales: torch.Tensor | None) -> None:
    if pool_rows.dim() != 4 or pool_rows.shape[1] not in (1, 2) or not pool_rows.is_contiguous():
        raise NworInputError(
            f"pool_rows: expected contiguous [L, 1 or 2, num_slots, row], got "
            f"{tuple(pool_rows.shape)}", field="pool_rows")
    num_layers, planes, _, row = pool_rows.shape
    device = pool_rows.device
    if (staged.dim() != 4 or staged.shape[:2] != (num_layers, planes) or staged.shape[3] != row
            or not staged.is_contiguous() or staged.device != device):
        raise NworInputError(
            f"staged: expected contiguous [{num_layers}, {planes}, capacity, {row}] on "
            f"{device}, got {tuple(staged.shape)} on {staged.device}", field="staged")
    if slots.dtype != torch.int64:
        raise SlotDtypeError(f"slots: dtype {slots.dtype}, expected torch.int64")
    if (slots.dim() != 2 or slots.shape[0] != num_layers or slots.stride(1) != 1
            or slots.device != device):
        raise NworInputError(
            f"slots: expected [{num_layers}, >= num_rows] with unit row stride on {device}",
            field="slots")
    if layer_rows.dtype != torch.int64 or layer_rows.shape != (num_layers,) or (
            layer_rows.device != device):
        raise NworInputError(f"layer_rows: expected int64 [{num_layers}] on {device}",
                             field="layer_rows")
    if not 0 <= num_rows <= min(staged.shape[2], slots.shape[1]):
        raise NworInputError(
            f"num_rows: {num_rows} outside [0, {min(staged.shape[2], slots.shape[1])}]",
            field="num_rows")
    if pool_rows.dtype == _FP8:
        if staged.dtype not in _FP8_SOURCES:
            raise NworInputError(f"staged: dtype {staged.dtype} cannot be quantised to fp8",
                                 field="staged")
        if (inv_scales is None or inv_scales.dtype != torch.float32
                or inv_scales.shape != (num_layers, planes) or inv_scales.device != device):
            raise NworInputError(
                f"inv_scales: an fp8 pool needs float32 [{num_layers}, {planes}] on {device}",
                field="inv_scales")
    else:
        if staged.dtype != pool_rows.dtype:
            raise NworInputError(
                f"staged: dtype {staged.dtype} differs from the pool's {pool_rows.dtype}",
                field="staged")
        if inv_scales is not None:
            raise NworInputError("inv_scales: only an fp8 pool is quantised", field="inv_scales")
