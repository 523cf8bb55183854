"""The MLA attention kernel over a latent pool (Triton). Imported only where Triton is
installed; its reference is `worker.attention.latent_attention.latent_attention`, its launch
`worker.attention.latent_attention_triton`.

Program ``(head_block, entry, query_tile x splits)`` attends ``BLOCK_M`` rows: ``QUERY_TILE``
consecutive queries of one entry times ``GROUP`` consecutive query heads (row ``m`` is query
``m // GROUP`` of the tile, head ``head_block * GROUP + m % GROUP``), the row mapping of
`worker.kernels.pool_attention` with every head sharing the one latent head. Each latent tile
(``BLOCK_N`` tokens of ``[c | k_rope]``) is loaded once for all of its rows and used twice: its
scores are ``q_latent . c + q_rope . k_rope`` (two dots, so the 64-wide rope part is not padded
to the 512-wide latent's power of two) and its values are ``c`` itself. The head blocks of one
entry and split are neighbours in launch order, so the blocks after the first find its latent
tiles in L2 (FlashMLA's sharing of one KV read by all heads of a request, across programs).

A split takes its share of the history in whole ``BLOCK_N`` steps and the last split also the
entry's staged tokens (causal: query ``qi`` sees staged token ``t <= qi``); with more than one
split each program writes its partial softmax in `worker.kernels.pool_attention`'s layout and
that module's `_combine_splits` merges them (``GROUP`` heads per "kv head" there).

fp8 pools arrive as raw bytes (uint8); a tile is converted to the query's dtype unscaled and the
layer's scale multiplies the scores and the probabilities, as in the GQA kernel. The helpers
(the two walks, the softmax update and the GQA kernel's key range, which a window starts at
its first key) reach the kernel as constexprs (``HISTORY``, ``STAGED``, ``UPDATE``, ``KEYS``),
as the GQA kernel's do: a kernel calls only helpers wrapped the way it is.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

import triton
import triton.language as tl
from kvalloc.worker.kernels.pool_attention import NO_SCORE, _add, _key_range, _max


def _latent_update(ql, qr, c, kr, visible, m_i, l_i, acc, k_mult, v_mult,
                   PRECISION: tl.constexpr):
    """One latent tile into the running ``(max, sum, accumulator)`` of every row."""
    s = tl.dot(ql, tl.trans(c), input_precision=PRECISION)
    s = (s + tl.dot(qr, tl.trans(kr), input_precision=PRECISION)) * k_mult
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, _add)
    pv = tl.dot((p * v_mult).to(c.dtype), c, input_precision=PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


def _latent_history(ql, qr, m_i, l_i, acc, pool_ptr, table_row_ptr, lo, hi, position, window,
                    k_mult, v_mult, table_width, p_stride_b, p_stride_s, RANK: tl.constexpr,
                    ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                    BLOCK_N: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr, WINDOWED: tl.constexpr,
                    FP8: tl.constexpr, PRECISION: tl.constexpr, UPDATE: tl.constexpr):
    """Pool tokens ``[lo, hi)`` of one block-table row; a token whose table entry is negative
    (-1, or a windowed pool's released -2) is masked out of the load, and with ``WINDOWED``
    the row at ``position`` sees token ``j > position - window`` only."""
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        col = j // TOKENS_PER_BLOCK
        block = tl.load(table_row_ptr + col, mask=(j < hi) & (col < table_width), other=-1)
        readable = block >= 0
        slot = (block.to(tl.int64) * p_stride_b + (j % TOKENS_PER_BLOCK) * p_stride_s)[:, None]
        c = tl.load(pool_ptr + slot + r[None, :], mask=readable[:, None] & (r < RANK)[None, :],
                    other=0)
        kr = tl.load(pool_ptr + slot + RANK + p[None, :],
                     mask=readable[:, None] & (p < ROPE)[None, :], other=0)
        if FP8:
            c = c.to(tl.float8e4nv, bitcast=True)
            kr = kr.to(tl.float8e4nv, bitcast=True)
        visible = readable[None, :]
        if WINDOWED:
            visible = visible & (j[None, :] > position[:, None] - window)
        m_i, l_i, acc = UPDATE(ql, qr, c.to(ql.dtype), kr.to(ql.dtype), visible, m_i, l_i, acc,
                               k_mult, v_mult, PRECISION)
    return m_i, l_i, acc


def _latent_staged(ql, qr, m_i, l_i, acc, staged_ptr, lo, hi, qi, window, qk_scale, s_stride_t,
                   RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, WINDOWED: tl.constexpr,
                   PRECISION: tl.constexpr, UPDATE: tl.constexpr):
    """The entry's staged tokens ``[lo, hi)`` (``staged_ptr`` at its first), causal: query
    ``qi`` sees token ``t <= qi`` (and ``t > qi - window`` with ``WINDOWED``)."""
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    for t0 in range(lo, hi, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        at = staged_ptr + (t * s_stride_t)[:, None]
        in_step = t < hi
        c = tl.load(at + r[None, :], mask=in_step[:, None] & (r < RANK)[None, :], other=0)
        kr = tl.load(at + RANK + p[None, :], mask=in_step[:, None] & (p < ROPE)[None, :],
                     other=0)
        visible = in_step[None, :] & (t[None, :] <= qi[:, None])
        if WINDOWED:
            visible = visible & (t[None, :] > qi[:, None] - window)
        m_i, l_i, acc = UPDATE(ql, qr, c.to(ql.dtype), kr.to(ql.dtype), visible, m_i, l_i, acc,
                               qk_scale, 1.0, PRECISION)
    return m_i, l_i, acc


def _latent_attention(ql_ptr, qr_ptr, staged_ptr, pool_ptr, table_ptr, rows_ptr, starts_ptr,
                      lens_ptr, hist_ptr, scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                      qk_scale, window, table_width, ql_stride_t, ql_stride_h, qr_stride_t,
                      qr_stride_h, s_stride_t, p_stride_b, p_stride_s, table_stride,
                      o_stride_t, o_stride_h,
                      RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_P: tl.constexpr, GROUP: tl.constexpr, QUERY_TILE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                      TOKENS_PER_BLOCK: tl.constexpr, WINDOWED: tl.constexpr,
                      FP8: tl.constexpr, DOT_F32: tl.constexpr,
                      PRECISION: tl.constexpr, SPLITS: tl.constexpr, HISTORY: tl.constexpr,
                      STAGED: tl.constexpr, UPDATE: tl.constexpr, KEYS: tl.constexpr):
    head_block = tl.program_id(0)
    entry = tl.program_id(1)
    split = tl.program_id(2) % SPLITS
    first = tl.program_id(2) // SPLITS * QUERY_TILE
    start = tl.load(starts_ptr + entry)
    length = tl.load(lens_ptr + entry)
    hist = tl.load(hist_ptr + entry)
    m = tl.arange(0, BLOCK_M)
    qi = first + m // GROUP
    head = head_block * GROUP + m % GROUP
    live = (m < QUERY_TILE * GROUP) & (qi < length)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    token = (start + qi)[:, None]
    ql = tl.load(ql_ptr + token * ql_stride_t + head[:, None] * ql_stride_h + r[None, :],
                 mask=live[:, None] & (r < RANK)[None, :], other=0)
    qr = tl.load(qr_ptr + token * qr_stride_t + head[:, None] * qr_stride_h + p[None, :],
                 mask=live[:, None] & (p < ROPE)[None, :], other=0)
    if DOT_F32:
        ql = ql.to(tl.float32)
        qr = qr.to(tl.float32)
    k_mult = qk_scale
    v_mult = 1.0
    if FP8:
        k_mult = qk_scale * tl.load(scale_ptr)
        v_mult = tl.load(scale_ptr)

    # This program's keys (`worker.kernels.pool_attention._key_range`).
    lo, hi, s_lo, s_hi = KEYS(hist, first, length, window, split, QUERY_TILE, BLOCK_N,
                              WINDOWED, SPLITS)

    m_i = tl.full([BLOCK_M], NO_SCORE, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_R], 0.0, tl.float32)
    m_i, l_i, acc = HISTORY(ql, qr, m_i, l_i, acc, pool_ptr,
                            table_ptr + tl.load(rows_ptr + entry) * table_stride, lo, hi,
                            hist + qi, window, k_mult, v_mult, table_width, p_stride_b,
                            p_stride_s, RANK, ROPE, BLOCK_R, BLOCK_P, BLOCK_N, TOKENS_PER_BLOCK,
                            WINDOWED, FP8, PRECISION, UPDATE)
    m_i, l_i, acc = STAGED(ql, qr, m_i, l_i, acc, staged_ptr + start * s_stride_t, s_lo, s_hi,
                           qi, window, qk_scale, s_stride_t, RANK, ROPE, BLOCK_R, BLOCK_P,
                           BLOCK_S, WINDOWED, PRECISION, UPDATE)

    if SPLITS == 1:
        # A live row always sees its own staged token, so its sum is positive.
        out = acc / tl.where(live, l_i, 1.0)[:, None]
        tl.store(out_ptr + token * o_stride_t + head[:, None] * o_stride_h + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None] & (r < RANK)[None, :])
    else:
        # pool_attention's partial layout, head blocks in the place of its KV heads.
        part = (entry * tl.num_programs(0) + head_block).to(tl.int64) * tl.num_programs(2) \
            + tl.program_id(2)
        tl.store(part_acc_ptr + (part * BLOCK_M + m[:, None]) * BLOCK_R + r[None, :], acc)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + m, m_i)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + m, l_i)


latent_attention_jit = triton.jit(_latent_attention)
_HELPERS = {"HISTORY": _latent_history, "STAGED": _latent_staged, "UPDATE": _latent_update,
            "KEYS": _key_range}
HELPERS_JIT = {name: triton.jit(fn) for name, fn in _HELPERS.items()}
