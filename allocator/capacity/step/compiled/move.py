"""Phase 6 of the compiled step, `reference.move_blocks`: new requests take their cached blocks,
every row's blocks follow its capacity, finished rows are reset and new requests admitted; it
returns the outcome's arrays.

Invariants: finished rows' cached blocks are parked first (in the plan's order), then every
shrink, then every growth, so block ids, the free stack and the table's cells come out as in
`reference`; ``rewritten`` marks the freed and admitted rows.
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.allocator.capacity.step.compiled.block_moves import park_prefix, take, truncate, unpark
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.rules import admitted_tokens, blocks_for
from kvalloc.allocator.capacity.step.compiled.tuples import (
    NUM_EVICTED,
    NUM_FREE_ROWS,
    HitArrays,
    Plan,
    Pool,
    Rows,
    Scratch,
    Served,
    State,
)


@inlined
def move_blocks(plan: Plan, state: State, served: Served, hits: HitArrays,
                scratch: Scratch) -> tuple[np.ndarray, np.ndarray]:
    """New requests take their cached blocks; every row's blocks follow
    ceil(capacity / tokens_per_block): finished rows' cached blocks are parked (in the plan's
    order), then all shrinks (blocks pushed on the free stack), then all growth (blocks taken);
    finished rows are reset and go back to the free rows; admitted requests take rows and their
    first blocks. Returns the admitted rows and their cached tokens (`changes` lists the cells
    once the window's release, if any, has run too)."""
    finished, prompt_lens, first_chunks = plan.finished_rows, plan.prompt_lens, plan.first_chunks
    rows, pool, table, tops = state.rows, state.pool, state.table, state.tops
    tpb, capacity, num_blocks, cached = (state.limits.tokens_per_block, rows.capacity,
                                         rows.num_blocks, rows.cached)
    host, free_rows = table.host, table.free_rows
    rewritten, old_blocks, evicted = scratch.rewritten, scratch.old_blocks, scratch.evicted
    refusals = served.refusals
    _take_hits(refusals, hits, pool)
    rewritten[:] = False  # freed or admitted: from column 0
    for row in finished:
        rewritten[row] = True
        park_prefix(pool, host, row, rows.released[row], min(cached[row], num_blocks[row]))
        for column in range(rows.released[row]):  # released columns hold no block
            host[row, column] = -1
    for row in range(num_blocks.size):
        old_blocks[row] = num_blocks[row]
        target = 0 if rewritten[row] else blocks_for(capacity[row], tpb)
        if target < num_blocks[row]:
            truncate(pool, tops, host, row, max(target, cached[row], rows.released[row]),
                     num_blocks[row])
            num_blocks[row] = target
    tops[NUM_EVICTED] = 0
    for row in range(num_blocks.size):
        target = 0 if rewritten[row] else blocks_for(capacity[row], tpb)
        if target > num_blocks[row]:
            take(pool, tops, evicted, host, row, num_blocks[row], target)
            num_blocks[row] = target
    for row in finished:
        _reset(rows, row)
        free_rows[tops[NUM_FREE_ROWS]] = row
        tops[NUM_FREE_ROWS] += 1
    return _admit(prompt_lens, first_chunks, refusals, hits, rows, pool, host, free_rows, tops,
                  tpb, rewritten, evicted)


@inlined
def _take_hits(refusals: np.ndarray, hits: HitArrays, pool: Pool) -> None:
    """Each admitted request takes a reference on its cached blocks, out of the LRU list if
    parked."""
    counts, blocks = hits.counts, hits.blocks
    refcounts = pool.refcounts
    start = 0
    for i in range(refusals.size):
        if refusals[i] == 0:
            for block in blocks[start : start + counts[i]]:
                if refcounts[block] == 0:
                    unpark(block, pool)
                refcounts[block] += 1
        start += counts[i]


@inlined
def _reset(rows: Rows, row: int) -> None:
    """`RowState.reset` (``num_blocks`` is 0 already)."""
    rows.live[row] = False
    rows.capacity[row] = rows.history[row] = rows.prompt_len[row] = 0
    rows.slack[row] = rows.draft_len[row] = rows.lead[row] = rows.cached[row] = 0
    rows.behind_draft[row] = rows.behind_slack[row] = rows.released[row] = 0
    rows.pending[row] = rows.ahead[row] = rows.behind[row] = False


@inlined
def _admit(prompt_lens: np.ndarray, first_chunks: np.ndarray, refusals: np.ndarray,
           hits: HitArrays, rows: Rows, pool: Pool, host: np.ndarray, free_rows: np.ndarray,
           tops: np.ndarray, tpb: int, rewritten: np.ndarray,
           evicted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each admitted request (refusal 0) takes a free row, its hit's released columns
    (`RELEASED`) and cached blocks, then fresh ones. Returns the admitted rows (-1: refused) and
    cached tokens, one per new request."""
    counts, blocks, released = hits
    admitted_rows = np.full(prompt_lens.size, -1, dtype=np.int64)
    cached_tokens = np.zeros(prompt_lens.size, dtype=np.int64)
    end = 0
    for i in range(prompt_lens.size):
        skipped, columns = released[i], released[i] + counts[i]
        start, end = end, end + counts[i]
        if refusals[i] != 0:
            continue
        tops[NUM_FREE_ROWS] -= 1
        row = free_rows[tops[NUM_FREE_ROWS]]
        tokens = admitted_tokens(prompt_lens[i], first_chunks[i], columns * tpb)
        n = blocks_for(tokens, tpb)
        for column in range(skipped):
            host[row, column] = RELEASED
        for column in range(skipped, columns):
            host[row, column] = blocks[start + column - skipped]
        take(pool, tops, evicted, host, row, columns, n)
        rows.live[row] = True
        rows.capacity[row] = rows.history[row] = tokens
        rows.prompt_len[row] = prompt_lens[i]
        rows.num_blocks[row] = n
        rows.cached[row] = columns
        rows.released[row] = skipped
        cached_tokens[i] = columns * tpb
        rewritten[row] = True
        admitted_rows[i] = row
    return admitted_rows, cached_tokens


@inlined
def changes(num_blocks: np.ndarray, old_blocks: np.ndarray, rewritten: np.ndarray,
            released_from: np.ndarray, host: np.ndarray) -> tuple:
    """Every row whose cells changed (`StepOutcome`'s ``changed_*``: rows, first column, block
    count, ids), and those cells as flat indices into the table: from column 0 for a row freed
    or admitted, else from the first its blocks moved or, earlier, the first a window released
    (``released_from``, -1: none)."""
    num_changed = num_ids = num_cells = 0
    for row in range(num_blocks.size):
        if rewritten[row] or num_blocks[row] != old_blocks[row] or released_from[row] >= 0:
            start = _first_changed(row, num_blocks, old_blocks, rewritten, released_from)
            num_changed += 1
            num_ids += num_blocks[row] - start
            num_cells += max(old_blocks[row], num_blocks[row]) - start
    changed_rows = np.empty(num_changed, dtype=np.int64)
    changed_from = np.empty(num_changed, dtype=np.int64)
    changed_blocks = np.empty(num_changed, dtype=np.int64)
    changed_ids = np.empty(num_ids, dtype=np.int32)
    changed_cells = np.empty(num_cells, dtype=np.int64)
    width = host.shape[1]
    k = j = c = 0
    for row in range(num_blocks.size):
        if rewritten[row] or num_blocks[row] != old_blocks[row] or released_from[row] >= 0:
            start = _first_changed(row, num_blocks, old_blocks, rewritten, released_from)
            changed_rows[k] = row
            changed_from[k] = start
            changed_blocks[k] = num_blocks[row]
            for column in range(start, num_blocks[row]):
                changed_ids[j] = host[row, column]
                j += 1
            for column in range(start, max(old_blocks[row], num_blocks[row])):
                changed_cells[c] = row * width + column
                c += 1
            k += 1
    return changed_rows, changed_from, changed_blocks, changed_ids, changed_cells


@inlined
def _first_changed(row: int, num_blocks: np.ndarray, old_blocks: np.ndarray,
                   rewritten: np.ndarray, released_from: np.ndarray) -> int:
    start = 0 if rewritten[row] else min(old_blocks[row], num_blocks[row])
    return start if released_from[row] < 0 else min(start, released_from[row])
