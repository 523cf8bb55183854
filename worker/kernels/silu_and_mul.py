"""The SiLU-and-multiply kernel (Triton). Imported only where Triton is installed; its reference
is `worker.mlp.gated_mlp.silu_and_mul`, its launch `worker.mlp.gated_mlp.silu_and_mul_triton`.

Program ``(row, block)`` reads ``BLOCK`` columns of one token's merged gate/up projection (the
gate half, then the up half of the same row) and writes ``silu(gate) * up``. It rounds where
transformers' two kernels round: the activation to the input's dtype, then the product, so the
two differ only by ``exp``'s last bits.

The function is plain Python: `silu_and_mul_jit` is it compiled for a GPU; for CPU tensors
the launch runs it in Triton's interpreter (`worker.kernels.helpers.kernel_for`).

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

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
