"""The SiLU-and-multiply kernel (Triton). Imported only where Triton is installed.

Program ``(row, block)`` reads ``BLOCK`` columns of one token's merged gate/up projection (the
gate half, then the up half of the same row) and writes ``silu(gate) * up``. It rounds where
transformers' two kernels round: the activation to the input's dtype, then the product, so the
two differ only by ``exp``'s last bits.

The function is plain Python: `silu_and_mul_jit` is it compiled for a GPU and `interpreted()`
it in Triton's interpreter for CPU tensors.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

from functools import cache

import triton
import triton.language as tl


def _silu_and_mul(gate_up_ptr, out_ptr, in_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < width
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + width + cols, mask=live, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=live)


silu_and_mul_jit = triton.jit(_silu_and_mul)


@cache
def interpreted():
    """The kernel in Triton's interpreter, for CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_silu_and_mul)
