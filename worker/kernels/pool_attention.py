"""The paged two-source attention kernel (Triton). Imported only where Triton is installed; its
reference is `worker.attention.pool_attention.pool_attention`, its launches
`worker.attention.pool_attention_triton`.

A decode launch's program ``(entry, kv_head, query_tile)`` (a prefill launch's
``(tile, kv_head)``, its entry and first query read from the host's tile map, ``TILE_MAP``)
attends the rows ``query_tile`` covers: ``QUERY_TILE``
consecutive queries of one entry times the ``GROUP`` query heads that share ``kv_head`` (row
``m`` is query ``m // GROUP`` of the tile, head ``kv_head * GROUP + m % GROUP``), so each K/V
tile is read once for the whole group: grouped-query attention without repeating KV heads. It
walks the entry's history in the pool through its block-table row up to the device-side
``history`` (a slot whose table entry is -1 is masked out of the load, so never read), then the
entry's own staged tokens, causal among themselves, in one online softmax (base 2, fp32). A
sliding window starts both walks at the tile's first visible key.

fp8 pools arrive as their raw bytes (uint8: a masked load's fill must be a value of the loaded
type, and the interpreter cannot make an fp8 one). A tile's keys and values are converted to the
query's dtype unscaled, and the layer's ``k_scale`` / ``v_scale`` multiply the scores and the
probabilities instead, which equals dequantising every element first.

The functions are plain Python, wrapped here with ``triton.jit`` for a GPU; for CPU tensors
`worker.attention.pool_attention_triton` runs them in Triton's interpreter
(`worker.kernels.helpers.kernel_for`). The helpers (the two key walks, the softmax update, the
rows' store and the tile's key range) are passed to the kernel as constexprs (``HISTORY``,
``STAGED``, ``UPDATE``, ``STORE``, ``KEYS``) because a kernel can only call a helper wrapped
the same way it is.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

import triton
import triton.language as tl
from kvalloc.worker.kernels.online_softmax import NO_SCORE, _max, _online_update


def _key_range(hist, first, length, window, split, QUERY_TILE: tl.constexpr,
               BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, SPLITS: tl.constexpr):
    """Which keys the program of a tile (first query ``first`` of an entry of ``length``
    queries after ``hist`` history tokens) reads: pool positions ``[lo, hi)`` and staged tokens
    ``[s_lo, s_hi)``. A key below every query's window is never loaded (a windowed pool's
    released columns lie there), a split takes its share of the history in whole BLOCK_N steps
    (the last ones may be empty), and the staged tokens are the last split's."""
    tile_live = first < length
    lo = hist * 0
    s_lo = first * 0
    if WINDOWED:
        lo = tl.maximum(hist + first - window + 1, 0)
        s_lo = tl.maximum(first - window + 1, 0)
    hi = tl.where(tile_live, hist, lo)
    s_hi = tl.where(tile_live, tl.minimum(length, first + QUERY_TILE), s_lo)
    if SPLITS > 1:
        chunk = (hi - lo + SPLITS * BLOCK_N - 1) // (SPLITS * BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)
        s_hi = tl.where(split == SPLITS - 1, s_hi, s_lo)
    return lo, hi, s_lo, s_hi


def _attend_history(q, m_i, l_i, acc, pk_ptr, pv_ptr, table_row_ptr, lo, hi, head_off, position,
                    window, k_mult, v_mult, table_width, p_stride_b, p_stride_s,
                    TOKENS_PER_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOWED: tl.constexpr,
                    FP8: tl.constexpr, PRECISION: tl.constexpr, UPDATE: tl.constexpr):
    """Pool keys ``[lo, hi)`` of one block-table row into the running softmax; a key whose
    table entry is -1 is masked out of the load."""
    d = tl.arange(0, BLOCK_D)
    in_dim = d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        col = j // TOKENS_PER_BLOCK
        block = tl.load(table_row_ptr + col, mask=(j < hi) & (col < table_width), other=-1)
        readable = block >= 0
        slot = block.to(tl.int64) * p_stride_b + (j % TOKENS_PER_BLOCK) * p_stride_s + head_off
        kv_mask = readable[:, None] & in_dim[None, :]
        k = tl.load(pk_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0)
        v = tl.load(pv_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0)
        if FP8:
            k = k.to(tl.float8e4nv, bitcast=True)
            v = v.to(tl.float8e4nv, bitcast=True)
        visible = readable[None, :]
        if WINDOWED:
            visible = visible & (j[None, :] > position[:, None] - window)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * k_mult
        m_i, l_i, acc = UPDATE(s, v.to(q.dtype), visible, m_i, l_i, acc, v_mult, PRECISION,
                               False)
    return m_i, l_i, acc


def _attend_staged(q, m_i, l_i, acc, sk_ptr, sv_ptr, lo, hi, qi, window, qk_scale,
                   s_stride_t, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD_DIM: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
                   UPDATE: tl.constexpr):
    """The entry's staged tokens ``[lo, hi)`` (entry-relative; ``sk_ptr`` / ``sv_ptr`` at its
    first token and this KV head), causal: query ``qi`` sees token ``t <= qi``."""
    d = tl.arange(0, BLOCK_D)
    in_dim = d < HEAD_DIM
    for t0 in range(lo, hi, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        staged = t[:, None] * s_stride_t + d[None, :]
        kv_mask = (t < hi)[:, None] & in_dim[None, :]
        k = tl.load(sk_ptr + staged, mask=kv_mask, other=0).to(q.dtype)
        v = tl.load(sv_ptr + staged, mask=kv_mask, other=0).to(q.dtype)
        visible = (t < hi)[None, :] & (t[None, :] <= qi[:, None])
        if WINDOWED:
            visible = visible & (t[None, :] > qi[:, None] - window)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        m_i, l_i, acc = UPDATE(s, v, visible, m_i, l_i, acc, 1.0, PRECISION, False)
    return m_i, l_i, acc


def _pool_attention(q_ptr, sk_ptr, sv_ptr, pk_ptr, pv_ptr, table_ptr,
                    rows_ptr, starts_ptr, lens_ptr, hist_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
                    part_acc_ptr, part_ml_ptr, tile_map_ptr,
                    qk_scale, window, table_width,
                    q_stride_t, q_stride_h, s_stride_t, s_stride_h,
                    p_stride_b, p_stride_s, p_stride_h, table_stride, o_stride_t, o_stride_h,
                    GROUP: tl.constexpr, QUERY_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    TOKENS_PER_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                    WINDOWED: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr,
                    PRECISION: tl.constexpr, SPLITS: tl.constexpr, TILE_MAP: tl.constexpr,
                    HISTORY: tl.constexpr, STAGED: tl.constexpr, UPDATE: tl.constexpr,
                    STORE: tl.constexpr, KEYS: tl.constexpr):
    head = tl.program_id(1)
    if TILE_MAP:
        # int64 [2, tiles]: each tile's entry, then its first query (a prefill launch, one split).
        entry = tl.load(tile_map_ptr + tl.program_id(0))
        first = tl.load(tile_map_ptr + tl.num_programs(0) + tl.program_id(0))
        split = 0
    else:
        entry = tl.program_id(0)
        split = tl.program_id(2) % SPLITS
        first = tl.program_id(2) // SPLITS * QUERY_TILE  # the tile's first query, in the entry
    start = tl.load(starts_ptr + entry)
    length = tl.load(lens_ptr + entry)
    hist = tl.load(hist_ptr + entry)
    m = tl.arange(0, BLOCK_M)
    qi = first + m // GROUP
    live = (m < QUERY_TILE * GROUP) & (qi < length)
    d = tl.arange(0, BLOCK_D)
    token = (start + qi)[:, None]
    q_head = (head * GROUP + m % GROUP)[:, None]
    row_mask = live[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + token * q_stride_t + q_head * q_stride_h + d[None, :], mask=row_mask,
                other=0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_mult = qk_scale
    v_mult = 1.0
    if FP8:
        k_mult = qk_scale * tl.load(k_scale_ptr)
        v_mult = tl.load(v_scale_ptr)

    lo, hi, s_lo, s_hi = KEYS(hist, first, length, window, split, QUERY_TILE, BLOCK_N,
                              WINDOWED, SPLITS)

    m_i = tl.full([BLOCK_M], NO_SCORE, tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    m_i, l_i, acc = HISTORY(
        q, m_i, l_i, acc, pk_ptr, pv_ptr, table_ptr + tl.load(rows_ptr + entry) * table_stride,
        lo, hi, head * p_stride_h, hist + qi, window, k_mult, v_mult, table_width, p_stride_b,
        p_stride_s, TOKENS_PER_BLOCK, BLOCK_N, BLOCK_D, HEAD_DIM, WINDOWED, FP8, PRECISION,
        UPDATE)
    s_off = start * s_stride_t + head * s_stride_h
    m_i, l_i, acc = STAGED(q, m_i, l_i, acc, sk_ptr + s_off, sv_ptr + s_off, s_lo, s_hi, qi,
                           window, qk_scale, s_stride_t, BLOCK_S, BLOCK_D, HEAD_DIM, WINDOWED,
                           PRECISION, UPDATE)

    part = (entry * tl.num_programs(1) + head).to(tl.int64) * tl.num_programs(2) \
        + tl.program_id(2)
    STORE(out_ptr + token * o_stride_t + q_head * o_stride_h + d[None, :], row_mask, live,
          part_acc_ptr, part_ml_ptr, part, m, d, m_i, l_i, acc, BLOCK_M, BLOCK_D, SPLITS)


def _store_rows(out_at, row_mask, live, part_acc_ptr, part_ml_ptr, part, m, d, m_i, l_i, acc,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    """A program's rows: their output at ``out_at`` (one split), or their partial softmax
    for `_combine_splits` to merge, as its ``part``: ``(entry, program of the entry, query
    tile x split)`` in `_combine_splits`'s order."""
    if SPLITS == 1:
        # A live row always sees its own staged token, so its sum is positive.
        out = acc / tl.where(live, l_i, 1.0)[:, None]
        tl.store(out_at, out.to(out_at.dtype.element_ty), mask=row_mask)
    else:
        tl.store(part_acc_ptr + (part * BLOCK_M + m[:, None]) * BLOCK_D + d[None, :], acc)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + m, m_i)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + m, l_i)


def _combine_splits(part_acc_ptr, part_ml_ptr, starts_ptr, lens_ptr, out_ptr, o_stride_t,
                    o_stride_h, GROUP: tl.constexpr, QUERY_TILE: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    SPLITS: tl.constexpr, VALUE_SPLIT: tl.constexpr):
    """Program ``(entry, kv_head x value chunk, query_tile)``: its ``SPLITS`` partial
    softmaxes into one. The rows' output columns are cut into ``VALUE_SPLIT`` chunks of
    ``HEAD_DIM`` (the latent kernel's value split; 1 for the GQA kernel's whole head), each
    merged by its own program."""
    entry = tl.program_id(0)
    head = tl.program_id(1) // VALUE_SPLIT
    col = tl.program_id(1) % VALUE_SPLIT * HEAD_DIM
    first = tl.program_id(2) * QUERY_TILE
    start = tl.load(starts_ptr + entry)
    m = tl.arange(0, BLOCK_M)
    qi = first + m // GROUP
    live = (m < QUERY_TILE * GROUP) & (qi < tl.load(lens_ptr + entry))
    d = tl.arange(0, BLOCK_D)
    first_part = ((entry * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)
                  * tl.num_programs(2) + tl.program_id(2)) * SPLITS
    parts = first_part + tl.arange(0, SPLITS)
    m_s = tl.load(part_ml_ptr + parts[:, None] * 2 * BLOCK_M + m[None, :])  # [SPLITS, BLOCK_M]
    top = tl.reduce(m_s, 0, _max)
    total = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    # One split's rows at a time: all of them at once would need SPLITS x BLOCK_M x BLOCK_D
    # floats on chip, past the shared memory of 128 rows of a 256-wide latent chunk.
    for split in tl.static_range(SPLITS):
        part = first_part + split
        weight = tl.exp2(tl.load(part_ml_ptr + part * 2 * BLOCK_M + m) - top)
        total += weight * tl.load(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + m)
        acc += weight[:, None] * tl.load(part_acc_ptr + (part * BLOCK_M + m[:, None]) * BLOCK_D
                                         + d[None, :])
    out = acc / tl.where(live, total, 1.0)[:, None]
    o_off = (start + qi)[:, None] * o_stride_t + (head * GROUP + m % GROUP)[:, None] * o_stride_h
    tl.store(out_ptr + o_off + col + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (d < HEAD_DIM)[None, :])


pool_attention_jit = triton.jit(_pool_attention)
combine_splits_jit = triton.jit(_combine_splits)
_HELPERS = {"HISTORY": _attend_history, "STAGED": _attend_staged, "UPDATE": _online_update,
            "STORE": _store_rows, "KEYS": _key_range}
HELPERS_JIT = {name: triton.jit(fn) for name, fn in _HELPERS.items()}
