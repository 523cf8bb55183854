"""The rotary-and-stage kernel (Triton). Imported only where Triton is installed; its reference
is `worker.attention.rotary.rotate_and_stage_reference`, its launch
`worker.attention.rotary.rotate_and_stage`.

Program ``token`` loads the token's query heads, key heads and value heads, each row beside its
rotated partner (column ``d`` pairs with ``d + D/2`` in the first half, ``d - D/2`` in the
second, transformers' ``rotate_half``), rotates the query and the key with the token's cos and
sin, and stores the query into a tensor of its own and the key and the value into the layer's
staging rows. The roundings are transformers' own: ``x * cos`` and ``rotate_half(x) * sin``
each rounded to the tensor's dtype, then their sum.

The functions are plain Python: `rotate_and_stage_jit` (and its helper, `ROTATED_JIT`, passed
as the constexpr ``ROTATED``: a kernel can only call a helper wrapped the same way it is) are
them compiled for a GPU; for CPU tensors the launch runs them in Triton's interpreter
(`worker.kernels.helpers.kernel_for`).

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

import triton
import triton.language as tl


def _rotated(ptr, stride_h, cos, sin, heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    half = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)
    live = (h < heads)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(ptr + h[:, None] * stride_h + d[None, :], mask=live, other=0.0)
    xp = tl.load(ptr + h[:, None] * stride_h + partner[None, :], mask=live,
                 other=0.0).to(tl.float32)
    # Negated in float32 (exact either way): the interpreter's half types are raw bits.
    xp = tl.where((d < half)[None, :], -xp, xp)
    dtype = x.dtype
    a = (x.to(tl.float32) * cos[None, :]).to(dtype)
    b = (xp * sin[None, :]).to(dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dtype), live


def _rotate_and_stage(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
                      q_st, q_sh, k_st, k_sh, v_st, v_sh, cs_st, qo_st, qo_sh, ko_st, ko_sh,
                      vo_st, vo_sh, q_heads, kv_heads,
                      HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                      BLOCK_D: tl.constexpr, ROTATED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + t * cs_st + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * cs_st + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    q, q_live = ROTATED(q_ptr + t * q_st, q_sh, cos, sin, q_heads, HEAD_DIM, BLOCK_HQ, BLOCK_D)
    hq = tl.arange(0, BLOCK_HQ)
    tl.store(q_out_ptr + t * qo_st + hq[:, None] * qo_sh + d[None, :], q, mask=q_live)
    k, kv_live = ROTATED(k_ptr + t * k_st, k_sh, cos, sin, kv_heads, HEAD_DIM, BLOCK_HKV,
                         BLOCK_D)
    hk = tl.arange(0, BLOCK_HKV)
    tl.store(k_out_ptr + t * ko_st + hk[:, None] * ko_sh + d[None, :],
             k.to(k_out_ptr.dtype.element_ty), mask=kv_live)
    v = tl.load(v_ptr + t * v_st + hk[:, None] * v_sh + d[None, :], mask=kv_live, other=0.0)
    tl.store(v_out_ptr + t * vo_st + hk[:, None] * vo_sh + d[None, :],
             v.to(v_out_ptr.dtype.element_ty), mask=kv_live)


rotate_and_stage_jit = triton.jit(_rotate_and_stage)
ROTATED_JIT = triton.jit(_rotated)
