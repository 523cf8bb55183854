"""The online softmax both attention kernels run (`worker.kernels.pool_attention`, the GQA
kernel, and `worker.kernels.latent_attention`, MLA over a latent pool): one key tile's scores
into every row's running ``(max, sum, accumulator)``, base 2, fp32. The kernels compute the
scores their own way (one K tile, or a latent's parts) and pass them here with the tile's
values; a kernel receives `_online_update` as a constexpr (``UPDATE``), as it does its other
helpers.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

import triton.language as tl

# Lower than any score, yet finite: the first update of a row that has seen no key yet gives
# exp2(NO_SCORE - NO_SCORE) = 1 on an empty accumulator instead of exp2(-inf + inf) = NaN.
NO_SCORE = tl.constexpr(-1.0e38)
# How far (base 2) a row's max may grow before a lazy update rescales: probabilities up to 256.
RESCALE_SLACK = tl.constexpr(8.0)


# Reductions go through tl.reduce with Triton's own combine functions rather than tl.sum /
# tl.max: those are @jit library functions, which Triton's interpreter can only call when
# TRITON_INTERPRET was set at import. The interpreter recognises these two and reduces with
# numpy; any other combine function it calls once per element (a 128 x 64 tile: 8k calls).
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max


def _online_update(s, v, visible, m_i, l_i, acc, v_mult, PRECISION: tl.constexpr,
                   LAZY: tl.constexpr):
    """One key tile into the running ``(max, sum, accumulator)`` of every row: ``s`` its
    scores (``[rows, keys]``, already scaled to base 2: softmax scale x log2(e) x the pool's k
    scale), ``visible`` which of them count, ``v`` its values (``[keys, width]``, the dtype the
    probabilities are rounded to for the product) and ``v_mult`` their scale.

    ``LAZY``: the rows keep the max they have (and the accumulator its scale) until one row's
    grows by more than ``RESCALE_SLACK``, so most tiles skip rescaling the accumulator; the
    probabilities are then up to 2 ** RESCALE_SLACK rather than 1, which a float rounds to the
    same relative precision, and the sum is kept against the same max, so the quotient is
    unchanged."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
    grown = True
    if LAZY:
        grown = tl.reduce(m_new - m_i, 0, _max) > RESCALE_SLACK
    if grown:
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    l_i = l_i + tl.reduce(p, 1, _add)
    acc = tl.dot((p * v_mult).to(v.dtype), v, acc, input_precision=PRECISION)
    return m_i, l_i, acc
