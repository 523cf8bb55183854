"""Phase 4 of the compiled step, `reference.serve_blocks`: row overflow, then blocks served in
order (rows whose results outgrew their blocks, rows that grow, then new requests with their
cached blocks), then rows for the new requests (`Served`).

Invariants: parked blocks count as available, except those a new request takes back; padding
of an earlier grant, and strict grants, are never refused (the step stops instead); nothing but
the scratch changes, and ``claimed`` is all False on entry and on return.
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.step import codes
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.loops import copy_into, fail
from kvalloc.allocator.capacity.step.compiled.rules import admitted_tokens, blocks_for
from kvalloc.allocator.capacity.step.compiled.tuples import (
    LRU_LENGTH,
    NUM_FREE,
    NUM_FREE_ROWS,
    Demand,
    HitArrays,
    Plan,
    Scratch,
    Served,
    Settled,
    State,
)
from kvalloc.allocator.capacity.step.plan import REFUSED_BATCH_FULL, REFUSED_OUT_OF_BLOCKS


@inlined
def serve_blocks(plan: Plan, strict: bool, state: State, settled: Settled, demand: Demand,
                 hits: HitArrays, scratch: Scratch, error: np.ndarray) -> Served:
    """`reference.serve_blocks`; returns the `Served` (unfinished when it stopped the step)."""
    grants, chunks, finished = plan.grant_rows, plan.prefill_rows, plan.finished_rows
    prompt_lens, first_chunks = plan.prompt_lens, plan.first_chunks
    tpb, max_blocks = state.limits.tokens_per_block, state.limits.max_blocks_per_seq
    num_blocks, cached, refcounts = state.rows.num_blocks, state.rows.cached, state.pool.refcounts
    # Parked blocks count: they are evicted when the stack runs dry.
    free_blocks = state.tops[NUM_FREE] + state.pool.lru[LRU_LENGTH]
    rows_left = state.tops[NUM_FREE_ROWS] + finished.size
    capacity, history, pending = settled.capacity, settled.history, settled.pending
    items, num_topups, target = demand.item_rows, demand.num_topups, demand.target_capacity
    claimed = scratch.claimed
    # The demand's item rows are the scratch's first ones: the prefill rows go after them.
    grow_rows = scratch.item_rows[: items.size + chunks.size]
    copy_into(grow_rows[items.size :], chunks)
    served = Served(scratch.item_ok[: grow_rows.size], np.zeros(grants.size, dtype=np.bool_),
                    np.zeros(chunks.size, dtype=np.bool_),
                    np.zeros(prompt_lens.size, dtype=np.int8),
                    np.empty(grants.size, dtype=np.int64), np.empty(chunks.size, dtype=np.int64))
    item_ok, granted, prefill_ok, refusals, grant_starts, prefill_starts = served
    for row in grow_rows:
        if blocks_for(target[row], tpb) > max_blocks:
            fail(error, codes.ROW_OVERFLOW, codes.GRANTS, row, max_blocks)
            return served
    available = free_blocks + _released(num_blocks, cached, state.rows.released, capacity,
                                        finished, tpb)
    if available < 0:
        _fail_settled_growth(plan.result_rows, finished, num_blocks, capacity, tpb, available,
                             scratch.seen, error)
        return served
    left = serve_in_order(grow_rows, target, capacity, tpb, available, item_ok)
    serve_hits_in_order(prompt_lens, first_chunks, hits, refcounts, tpb, left, claimed, refusals)
    # Rows are the other resource: admit in order while rows last.
    for i in range(refusals.size):
        if refusals[i] == 0:
            if rows_left > 0:
                rows_left -= 1
            else:
                refusals[i] = REFUSED_BATCH_FULL
    # Padding of an earlier grant, and strict grants, are not allowed to be refused.
    for k in range(items.size):
        if (k < num_topups or strict) and not item_ok[k]:
            fail(error, codes.OUT_OF_BLOCKS, codes.GRANTS, items[k], available)
            return served
    for i in range(grants.size):
        granted[i] = item_ok[num_topups + i]
        grant_starts[i] = history[grants[i]] + (1 if pending[grants[i]] else 0)
    for i in range(chunks.size):
        prefill_ok[i] = item_ok[items.size + i]
        prefill_starts[i] = history[chunks[i]]
    return served


@inlined
def _released(num_blocks: np.ndarray, cached: np.ndarray, behind_window: np.ndarray,
              capacity: np.ndarray, finished: np.ndarray, tokens_per_block: int) -> int:
    """Blocks the settled ``capacity`` frees: finished rows all theirs but their cached blocks
    (those are parked, not free, until evicted) and the columns a window released (no block;
    a released column may be a cached one)."""
    released = 0
    for row in range(num_blocks.size):
        released += num_blocks[row] - blocks_for(capacity[row], tokens_per_block)
    for row in finished:
        released += (blocks_for(capacity[row], tokens_per_block)
                     - max(cached[row], behind_window[row]))
    return released


@inlined
def _fail_settled_growth(results: np.ndarray, finished: np.ndarray, num_blocks: np.ndarray,
                         capacity: np.ndarray, tokens_per_block: int, available: int,
                         finished_mark: np.ndarray, error: np.ndarray) -> None:
    """`reference._fail_settled_growth`: OutOfBlocks on the first result row the settled
    ``capacity`` grows (a finished one grows nothing), quoting the blocks there were before any
    row grew. ``finished_mark``: a per-row scratch, all False on entry and on return."""
    for row in finished:
        finished_mark[row] = True
    growth, first = 0, -1
    for row in range(num_blocks.size):
        if not finished_mark[row]:
            growth += max(blocks_for(capacity[row], tokens_per_block) - num_blocks[row], 0)
    for row in results:
        if (first < 0 and not finished_mark[row]
                and blocks_for(capacity[row], tokens_per_block) > num_blocks[row]):
            first = row
    for row in finished:
        finished_mark[row] = False
    fail(error, codes.OUT_OF_BLOCKS, codes.RESULTS, first, available + growth)


@inlined
def serve_hits_in_order(prompt_lens: np.ndarray, first_chunks: np.ndarray, hits: HitArrays,
                        refcounts: np.ndarray, tokens_per_block: int, available: int,
                        claimed: np.ndarray, refusals: np.ndarray) -> None:
    """`reference.serve_hits_in_order` (with no hits, `serve_in_order`) for the new requests:
    those not served are refused (``refusals``) for want of blocks."""
    counts, blocks, released = hits
    left = available
    start = 0
    for i in range(prompt_lens.size):
        columns = counts[i] + released[i]
        tokens = admitted_tokens(prompt_lens[i], first_chunks[i], columns * tokens_per_block)
        need = blocks_for(tokens, tokens_per_block) - columns
        for k in range(start, start + counts[i]):  # parked blocks it takes back
            if refcounts[blocks[k]] == 0 and not claimed[blocks[k]]:
                need += 1
        if need <= left:
            left -= need
            for k in range(start, start + counts[i]):
                claimed[blocks[k]] = True
        else:
            refusals[i] = REFUSED_OUT_OF_BLOCKS
        start += counts[i]
    for k in range(blocks.size):
        claimed[blocks[k]] = False


@inlined
def serve_in_order(grow_rows: np.ndarray, target: np.ndarray, capacity: np.ndarray,
                   tokens_per_block: int, available: int, ok: np.ndarray) -> int:
    """`reference.serve_in_order` for the rows that grow from ``capacity`` to ``target``: which
    of them get their blocks (``ok``) when served in order, each one only if it still fits.
    Returns the blocks left."""
    left = available
    for k in range(grow_rows.size):
        row = grow_rows[k]
        need = (blocks_for(target[row], tokens_per_block)
                - blocks_for(capacity[row], tokens_per_block))
        ok[k] = need <= left
        if ok[k]:
            left -= need
    return left
