"""The MLA attention kernel over a latent pool (Triton). Imported only where Triton is
installed; its reference is `worker.attention.latent_attention.latent_attention`, its launch
`worker.attention.latent_attention_triton`.

Program ``(head_block x value_chunk, entry, query_tile x splits)`` attends ``BLOCK_M`` rows:
``QUERY_TILE`` consecutive queries of one entry times ``GROUP`` consecutive query heads (row
``m`` is query ``m // GROUP`` of the tile, head ``head_block * GROUP + m % GROUP``), the row
mapping of `worker.kernels.pool_attention` with every head sharing the one latent head. Each
latent tile (``BLOCK_N`` tokens of ``[c | k_rope]``) is loaded once for all of its rows; its
scores are ``q_latent . c + q_rope . k_rope`` (separate dots, so the 64-wide rope part is not
padded to the 512-wide latent's power of two) and its values are ``c`` itself.

The value split: with ``VALUE_SPLIT`` 2 a program accumulates one half of ``c``'s columns
(``WIDTH`` of them, its chunk) and a neighbour program the other, each computing the whole
scores (its own chunk's dot plus the other chunk's). That recomputes the scores once more, but
halves the fp32 accumulator ``[BLOCK_M, WIDTH]`` each program keeps in registers: at 64 rows x
512 columns it takes 128 registers a thread of 8 warps before anything else, and spills.
The programs of one entry and split are neighbours in launch order, so the ones after the first
find its latent tiles in L2 (FlashMLA's sharing of one KV read by all heads of a request,
across programs).

A split takes its share of the history in whole ``BLOCK_N`` steps and the last split also the
entry's staged tokens (causal: query ``qi`` sees staged token ``t <= qi``); with more than one
split each program writes its partial softmax in `worker.kernels.pool_attention`'s layout and
that module's `_combine_splits` merges them (``GROUP`` heads per "kv head" there, the value
chunks its ``VALUE_SPLIT``). ``LAZY``: the online softmax rescales the accumulator only when a
row's max has grown enough (`worker.kernels.online_softmax`), which at a 512-wide latent is
the update's largest cost on the CUDA cores.

fp8 pools arrive as raw bytes (uint8); a tile is converted to the query's dtype unscaled and the
layer's scale multiplies the scores and the probabilities, as in the GQA kernel. The helpers
(the two walks, a tile's scores, the softmax update of `worker.kernels.online_softmax` and the
rows' store and key range of the GQA kernel, which a window starts at its first key) reach the
kernel as constexprs (``HISTORY``, ``STAGED``, ``TILE``, ``UPDATE``, ``STORE``, ``KEYS``), as
the GQA kernel's do: a kernel calls only helpers wrapped the way it is.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

import triton
import triton.language as tl
from kvalloc.worker.kernels.online_softmax import NO_SCORE, _online_update
from kvalloc.worker.kernels.pool_attention import _key_range, _store_rows


def _latent_tile(q_own, q_other, qr, at, rows, own, other, WIDTH: tl.constexpr,
                 ROPE: tl.constexpr, RANK: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_P: tl.constexpr, VALUE_SPLIT: tl.constexpr, FP8: tl.constexpr,
                 PRECISION: tl.constexpr):
    """The unscaled scores of the latents at ``at`` (``[BLOCK_N, 1]`` row pointers, ``rows``
    those that exist) and their values, this program's chunk ``own`` of ``c`` (the other
    chunk, at ``other``, counts in the scores only)."""
    v = tl.arange(0, BLOCK_V)
    p = tl.arange(0, BLOCK_P)
    in_chunk = rows[:, None] & (v < WIDTH)[None, :]
    c = tl.load(at + own + v[None, :], mask=in_chunk, other=0)
    kr = tl.load(at + RANK + p[None, :], mask=rows[:, None] & (p < ROPE)[None, :], other=0)
    if FP8:
        c = c.to(tl.float8e4nv, bitcast=True)
        kr = kr.to(tl.float8e4nv, bitcast=True)
    c = c.to(q_own.dtype)
    s = tl.dot(q_own, tl.trans(c), input_precision=PRECISION)
    if VALUE_SPLIT > 1:
        c_other = tl.load(at + other + v[None, :], mask=in_chunk, other=0)
        if FP8:
            c_other = c_other.to(tl.float8e4nv, bitcast=True)
        s += tl.dot(q_other, tl.trans(c_other.to(q_own.dtype)), input_precision=PRECISION)
    s += tl.dot(qr, tl.trans(kr.to(qr.dtype)), input_precision=PRECISION)
    return s, c


def _latent_history(q_own, q_other, qr, m_i, l_i, acc, pool_ptr, table_row_ptr, lo, hi, own,
                    other, position, window, k_mult, v_mult, table_width, p_stride_b,
                    p_stride_s, WIDTH: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                    TOKENS_PER_BLOCK: tl.constexpr, VALUE_SPLIT: tl.constexpr,
                    WINDOWED: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
                    LAZY: tl.constexpr, TILE: tl.constexpr, UPDATE: tl.constexpr):
    """Pool tokens ``[lo, hi)`` of one block-table row; a token whose table entry is negative
    (-1, or a windowed pool's released -2) is masked out of the load, and with ``WINDOWED``
    the row at ``position`` sees token ``j > position - window`` only."""
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        col = j // TOKENS_PER_BLOCK
        block = tl.load(table_row_ptr + col, mask=(j < hi) & (col < table_width), other=-1)
        readable = block >= 0
        slot = block.to(tl.int64) * p_stride_b + (j % TOKENS_PER_BLOCK) * p_stride_s
        s, c = TILE(q_own, q_other, qr, pool_ptr + slot[:, None], readable, own, other, WIDTH,
                    ROPE, RANK, BLOCK_V, BLOCK_P, VALUE_SPLIT, FP8, PRECISION)
        visible = readable[None, :]
        if WINDOWED:
            visible = visible & (j[None, :] > position[:, None] - window)
        m_i, l_i, acc = UPDATE(s * k_mult, c, visible, m_i, l_i, acc, v_mult, PRECISION, LAZY)
    return m_i, l_i, acc


def _latent_staged(q_own, q_other, qr, m_i, l_i, acc, staged_ptr, lo, hi, qi, own, other,
                   window, qk_scale, s_stride_t, WIDTH: tl.constexpr, ROPE: tl.constexpr,
                   RANK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_S: tl.constexpr, VALUE_SPLIT: tl.constexpr, WINDOWED: tl.constexpr,
                   PRECISION: tl.constexpr, LAZY: tl.constexpr, TILE: tl.constexpr,
                   UPDATE: tl.constexpr):
    """The entry's staged tokens ``[lo, hi)`` (``staged_ptr`` at its first), causal: query
    ``qi`` sees token ``t <= qi`` (and ``t > qi - window`` with ``WINDOWED``)."""
    for t0 in range(lo, hi, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        in_step = t < hi
        s, c = TILE(q_own, q_other, qr, staged_ptr + (t * s_stride_t)[:, None], in_step, own,
                    other, WIDTH, ROPE, RANK, BLOCK_V, BLOCK_P, VALUE_SPLIT, False, PRECISION)
        visible = in_step[None, :] & (t[None, :] <= qi[:, None])
        if WINDOWED:
            visible = visible & (t[None, :] > qi[:, None] - window)
        m_i, l_i, acc = UPDATE(s * qk_scale, c, visible, m_i, l_i, acc, 1.0, PRECISION, LAZY)
    return m_i, l_i, acc


def _latent_attention(ql_ptr, qr_ptr, staged_ptr, pool_ptr, table_ptr, rows_ptr, starts_ptr,
                      lens_ptr, hist_ptr, scale_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                      qk_scale, window, table_width, ql_stride_t, ql_stride_h, qr_stride_t,
                      qr_stride_h, s_stride_t, p_stride_b, p_stride_s, table_stride,
                      o_stride_t, o_stride_h,
                      RANK: tl.constexpr, ROPE: tl.constexpr, WIDTH: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, GROUP: tl.constexpr,
                      QUERY_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_S: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
                      VALUE_SPLIT: tl.constexpr, WINDOWED: tl.constexpr, FP8: tl.constexpr,
                      DOT_F32: tl.constexpr, PRECISION: tl.constexpr, LAZY: tl.constexpr,
                      SPLITS: tl.constexpr, HISTORY: tl.constexpr, STAGED: tl.constexpr,
                      TILE: tl.constexpr, UPDATE: tl.constexpr, STORE: tl.constexpr,
                      KEYS: tl.constexpr):
    head_block = tl.program_id(0) // VALUE_SPLIT
    chunk = tl.program_id(0) % VALUE_SPLIT
    own = chunk * WIDTH  # this program's value columns; the other chunk's, with a split
    other = (1 - chunk) * WIDTH
    entry = tl.program_id(1)
    split = tl.program_id(2) % SPLITS
    first = tl.program_id(2) // SPLITS * QUERY_TILE
    start = tl.load(starts_ptr + entry)
    length = tl.load(lens_ptr + entry)
    hist = tl.load(hist_ptr + entry)
    m = tl.arange(0, BLOCK_M)
    qi = first + m // GROUP
    head = (head_block * GROUP + m % GROUP)[:, None]
    live = (m < QUERY_TILE * GROUP) & (qi < length)
    v = tl.arange(0, BLOCK_V)
    p = tl.arange(0, BLOCK_P)
    token = (start + qi)[:, None]
    row_mask = live[:, None] & (v < WIDTH)[None, :]
    q_at = ql_ptr + token * ql_stride_t + head * ql_stride_h + v[None, :]
    q_own = tl.load(q_at + own, mask=row_mask, other=0)
    q_other = q_own  # unused without a value split
    if VALUE_SPLIT > 1:
        q_other = tl.load(q_at + other, mask=row_mask, other=0)
    qr = tl.load(qr_ptr + token * qr_stride_t + head * qr_stride_h + p[None, :],
                 mask=live[:, None] & (p < ROPE)[None, :], other=0)
    if DOT_F32:
        q_own = q_own.to(tl.float32)
        q_other = q_other.to(tl.float32)
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
    acc = tl.full([BLOCK_M, BLOCK_V], 0.0, tl.float32)
    m_i, l_i, acc = HISTORY(q_own, q_other, qr, m_i, l_i, acc, pool_ptr,
                            table_ptr + tl.load(rows_ptr + entry) * table_stride, lo, hi, own,
                            other, hist + qi, window, k_mult, v_mult, table_width, p_stride_b,
                            p_stride_s, WIDTH, ROPE, RANK, BLOCK_V, BLOCK_P, BLOCK_N,
                            TOKENS_PER_BLOCK, VALUE_SPLIT, WINDOWED, FP8, PRECISION, LAZY, TILE,
                            UPDATE)
    m_i, l_i, acc = STAGED(q_own, q_other, qr, m_i, l_i, acc, staged_ptr + start * s_stride_t,
                           s_lo, s_hi, qi, own, other, window, qk_scale, s_stride_t, WIDTH, ROPE,
                           RANK, BLOCK_V, BLOCK_P, BLOCK_S, VALUE_SPLIT, WINDOWED, PRECISION,
                           LAZY, TILE, UPDATE)

    # pool_attention's partial layout: head blocks x value chunks in the place of its KV heads.
    part = (entry * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * tl.num_programs(2) \
        + tl.program_id(2)
    STORE(out_ptr + token * o_stride_t + head * o_stride_h + own + v[None, :], row_mask, live,
          part_acc_ptr, part_ml_ptr, part, m, v, m_i, l_i, acc, BLOCK_M, BLOCK_V, SPLITS)


latent_attention_jit = triton.jit(_latent_attention)
_HELPERS = {"HISTORY": _latent_history, "STAGED": _latent_staged, "TILE": _latent_tile,
            "UPDATE": _online_update, "STORE": _store_rows, "KEYS": _key_range}
HELPERS_JIT = {name: triton.jit(fn) for name, fn in _HELPERS.items()}
