"""The RMSNorm kernel (Triton). Imported only where Triton is installed; its reference is
`worker.norm.rms_norm.rms_norm`, its launch `worker.norm.rms_norm.rms_norm_triton`.

Program ``row`` normalises one token's hidden vector in one pass: it loads the row once, sums
its squares in float32, rounds the normalised row to the input's dtype and multiplies it by the
weight, the same order of roundings as transformers' RMSNorm, so the two differ only by the
order of the sum and by ``rsqrt``'s last bit.

The function is plain Python: `rms_norm_jit` is it compiled for a GPU; for CPU tensors the
launch runs it in Triton's interpreter (`worker.kernels.helpers.kernel_for`). The sum goes
through ``tl.reduce`` with `_add` rather than ``tl.sum``: that is a library function, which the
interpreter can only call when ``TRITON_INTERPRET`` was set at import.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


def _rms_norm(x_ptr, weight_ptr, out_ptr, x_stride, out_stride, inv_hidden, eps,
              HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < HIDDEN
    x = tl.load(x_ptr + row * x_stride + cols, mask=live, other=0.0).to(tl.float32)
    variance = tl.reduce(x * x, 0, _add) * inv_hidden
    normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=live, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=live)


rms_norm_jit = triton.jit(_rms_norm)
