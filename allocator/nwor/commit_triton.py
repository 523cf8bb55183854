"""The NWOR commit kernels (Triton). Imported only when the Triton backend is used.

`_mask_rejected` turns accepted counts into the per-token keep mask and sets every rejected
token's slot to -1 in every layer (plus the window's counters); `_commit_rows` then writes.
Both run in one launch each, with no host synchronisation.

`_commit_rows`: one launch writes every layer's planes (K and V, or an MLA latent's one plane):
program ``(tile, layer, plane)`` copies ``BLOCK_T`` staged rows of one layer's plane to their pool
slots, skipping rows past the
layer's staged count and rows whose slot is outside ``[0, num_slots)`` (-1: rejected or padded).
A fenced launch (``FENCED``) first reads its writer's fence word and writes nothing once the word
no longer holds the writer's number: a volatile load, so a word closed by another process after
the launch was queued is seen.

fp8 e4m3 quantisation is done with integer operations (round to nearest even, saturating at
+-448) instead of a float cast, because the Triton interpreter's float casts are not exact: this
way the same kernel gives the same bytes on a GPU and in the interpreter, and both equal torch's
``clamp(-448, 448).to(float8_e4m3fn)``.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

from functools import cache

import triton
import triton.language as tl

# What the kernel reads from `staged`: the raw bits to copy (pool dtype == staged dtype), or the
# value to quantise to fp8 from bf16 bits (passed as int16) or from a float16/float32 tensor.
# (Globals a kernel reads must be constexpr.)
SRC_COPY = tl.constexpr(0)
SRC_BF16_TO_FP8 = tl.constexpr(1)
SRC_FLOAT_TO_FP8 = tl.constexpr(2)


def _commit_rows(pool_ptr, staged_ptr, slots_ptr, layer_rows_ptr, inv_scale_ptr,
                 fence_word_ptr, fence_expected_ptr,
                 num_rows, num_slots, stage_capacity, slot_stride,
                 ROW: tl.constexpr, PLANES: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr, SRC: tl.constexpr, FENCED: tl.constexpr):
    tile = tl.program_id(0)
    layer = tl.program_id(1)
    which = tl.program_id(2)
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    limit = tl.minimum(tl.load(layer_rows_ptr + layer), num_rows)
    if FENCED:  # the writer's session ended: this program writes nothing (`fence.py`)
        word = tl.load(fence_word_ptr, volatile=True)
        limit = tl.where(word == tl.load(fence_expected_ptr), limit, 0)
    live = rows < limit
    slot = tl.load(slots_ptr + layer * slot_stride + rows, mask=live, other=-1)
    live = live & (slot >= 0) & (slot < num_slots)
    plane = (layer * PLANES + which).to(tl.int64)
    src_row = (plane * stage_capacity + rows) * ROW
    dst_row = (plane * num_slots + slot) * ROW
    if SRC != SRC_COPY:
        inv_scale = tl.load(inv_scale_ptr + plane)
    for d0 in tl.static_range(0, ROW, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = live[:, None] & (cols[None, :] < ROW)
        x = tl.load(staged_ptr + src_row[:, None] + cols[None, :], mask=mask, other=0)
        if SRC != SRC_COPY:
            if SRC == SRC_BF16_TO_FP8:
                x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32,
                                                                            bitcast=True)
            else:
                x = x.to(tl.float32)
            x = tl.clamp(x * inv_scale, -448.0, 448.0)
            # e4m3fn: bias 7, 3 mantissa bits; normal from 2^-6, subnormal steps of 2^-9.
            bits = x.to(tl.uint32, bitcast=True)
            sign = (bits >> 24) & 0x80
            mag = bits & 0x7FFFFFFF
            exp = (mag >> 23).to(tl.int32) - 127
            normal = exp >= -6
            # Normal: keep 3 of 23 mantissa bits. Subnormal: the value in units of 2^-9 is the
            # 24-bit significand shifted right by 14 - exp (capped so the shift stays defined).
            shift = tl.where(normal, 20, tl.minimum(14 - exp, 31)).to(tl.uint32)
            full = tl.where(normal, mag, (mag & 0x7FFFFF) | 0x800000)
            q = full >> shift
            rem = full & ((1 << shift) - 1)
            half = 1 << (shift - 1)
            round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
            q = q + round_up.to(tl.uint32)
            # Rebias the exponent field (127 -> 7); a mantissa carry moves into it by itself.
            q = tl.where(normal, q - (120 << 3), q)
            q = tl.where(mag > 0x7F800000, 0x7F, q)  # NaN stays NaN
            x = (q | sign).to(tl.uint8)
        tl.store(pool_ptr + dst_row[:, None] + cols[None, :], x, mask=mask)


# Reductions go through tl.reduce with these rather than tl.sum / tl.max: those are @jit library
# functions, which Triton's interpreter can only call when TRITON_INTERPRET was set at import.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _either(a, b):
    return a | b


def _mask_rejected(tokens_ptr, accepted_ptr, limits_ptr, slots_ptr, out_ptr,
                   window_ptr, total_ptr, hist_ptr,
                   num_rows, num_requests, slot_stride, out_stride,
                   NEVER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                   RECORD: tl.constexpr):
    # Program (tile, layer). Every program checks all counts itself: one launch, no separate
    # reduction; the layer-0 programs also keep the counters.
    req = tl.arange(0, BLOCK_R)
    in_req = req < num_requests
    acc = tl.load(accepted_ptr + req, mask=in_req, other=0)
    lim = tl.load(limits_ptr + req, mask=in_req, other=0)
    invalid = tl.reduce(((acc < 0) | (acc > lim)).to(tl.int32), 0, _either) != 0
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < num_rows
    request = tl.load(tokens_ptr + rows * 3, mask=live, other=0)
    draft_index = tl.load(tokens_ptr + rows * 3 + 1, mask=live, other=NEVER)
    bound = tl.where(invalid, NEVER, tl.load(accepted_ptr + request, mask=live, other=0))
    keep = live & (draft_index < bound)
    layer = tl.program_id(1)
    slot = tl.load(slots_ptr + layer * slot_stride + rows, mask=live, other=-1)
    tl.store(out_ptr + layer * out_stride + rows, tl.where(keep, slot, -1), mask=live)
    if RECORD:  # noqa: SIM102 - a compile-time branch around a run-time one
        if layer == 0:
            committed = tl.where(invalid, 0, keep.to(tl.int64))
            kept = tl.reduce(committed, 0, _add)
            tl.atomic_add(window_ptr, kept)
            tl.atomic_add(total_ptr, kept)
            bucket = tl.load(tokens_ptr + rows * 3 + 2, mask=live, other=0)
            tl.atomic_add(hist_ptr + bucket, committed, mask=live)
            if tl.program_id(0) == 0:
                flag = invalid.to(tl.int64)
                fallback = flag * tl.load(limits_ptr + num_requests)
                tl.atomic_add(window_ptr + 1, flag)
                tl.atomic_add(total_ptr + 1, flag)
                tl.atomic_add(window_ptr + 2, fallback)
                tl.atomic_add(total_ptr + 2, fallback)

commit_rows_jit = triton.jit(_commit_rows)
mask_rejected_jit = triton.jit(_mask_rejected)
cdiv = triton.cdiv


@cache
def interpreted(name: str):
    """A kernel in Triton's interpreter, for CPU tensors (tests compare it bit for bit)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction({"commit_rows": _commit_rows,
                                "mask_rejected": _mask_rejected}[name])
