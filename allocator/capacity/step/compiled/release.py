"""Phase 7 of the compiled step, a windowed group's only: `windows.release.WindowRelease.release`
(its reference, run after `reference_step`), row by row. Each live row's ``read_from`` moves to
the lowest position a step that is scheduled, or yet to come, still reads; the leading columns
wholly behind its window (``max(0, (read_from - W + 1) // T)``) go back to the pool, and the
table says `RELEASED` there, short of the row's first column kept for its prefix cache
(``keep_from``: its ``cached`` columns where it is ``registering``, else none). A released block
nobody holds any more is parked when it is a cached one (one of the row's ``cached`` columns:
the prefix cache keeps it, evictable), else pushed on the free stack.

Invariants: a full-attention step (``window`` 0) runs none of it; rows are released in order,
each row's columns in order, so the free stack and the LRU list come out as the reference's;
``released_from`` holds the first column a row released this step, -1 where it released none
(`move.changes` starts that row's changes there).
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.allocator.capacity.step.compiled.block_moves import park
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.tuples import NUM_FREE, Plan, State, Window
from kvalloc.allocator.capacity.windows.release import NO_HOLD


@inlined
def release(plan: Plan, lag: int, state: State, window: Window, prefill_ok: np.ndarray,
            prefill_starts: np.ndarray, admitted_rows: np.ndarray, cached_tokens: np.ndarray,
            released_from: np.ndarray) -> None:
    """`WindowRelease.release` after a step that ran: move ``read_from``, give back the columns
    behind it, and mark in ``released_from`` where each row's release began."""
    size = window.size
    if size == 0:
        return
    rows, tops, tpb = state.rows, state.tops, state.limits.tokens_per_block
    live, history, released, cached = rows.live, rows.history, rows.released, rows.cached
    host, free_stack, refcounts = state.table.host, state.pool.free_stack, state.pool.refcounts
    starts, fresh = window.starts, window.fresh
    read_from, last_start, held_back = window.read_from, window.last_start, window.held_back
    registering, keep_from = window.registering, window.keep_from
    for row in range(live.size):
        starts[row] = history[row]
        fresh[row] = False
    for i in range(prefill_ok.size):
        if prefill_ok[i]:
            starts[plan.prefill_rows[i]] = prefill_starts[i]
    for i in range(admitted_rows.size):
        if admitted_rows[i] >= 0:
            starts[admitted_rows[i]] = cached_tokens[i]
            fresh[admitted_rows[i]] = True
    for row in range(live.size):
        released_from[row] = -1
        keep_from[row] = NO_HOLD
        if not live[row]:
            read_from[row] = last_start[row] = 0
            continue
        start = starts[row]
        earlier = start if fresh[row] or lag == 1 else last_start[row]
        lowest = min(start, earlier, history[row] - held_back[row])
        read_from[row] = start if fresh[row] else max(read_from[row], lowest)
        last_start[row] = start
        if registering[row] and not fresh[row]:
            keep_from[row] = cached[row]
        target = min(max(0, (read_from[row] - size + 1) // tpb), keep_from[row])
        if target <= released[row]:
            continue
        released_from[row] = released[row]
        for column in range(released[row], target):
            block = host[row, column]
            host[row, column] = RELEASED
            refcounts[block] -= 1
            if refcounts[block] == 0:
                if column < cached[row]:
                    park(block, state.pool)
                else:
                    free_stack[tops[NUM_FREE]] = block
                    tops[NUM_FREE] += 1
        released[row] = target
