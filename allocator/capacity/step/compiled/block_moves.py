"""A block between the pool and one cell of the block table, for the compiled step's last phase:
`BlockPool`'s and `BlockTable`'s moves on their arrays (release, take with eviction, park and
unpark in the LRU list).

Invariants: a block nobody holds (refcount 0) is on the free stack or parked in the LRU list,
never both; a taken block has refcount 1; the stack tops move in ``tops`` (`tuples.NUM_FREE`,
``NUM_EVICTED``).
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.tuples import (
    LRU_HEAD,
    LRU_LENGTH,
    LRU_TAIL,
    NUM_EVICTED,
    NUM_FREE,
    Pool,
)


@inlined
def park_prefix(pool: Pool, host: np.ndarray, row: int, first: int, cached: int) -> None:
    """Release a finished row's cached columns from ``first`` (its released ones hold no block)
    to ``cached``, last first: a block nobody else holds is parked at the LRU tail (so a
    prefix's end is evicted before its start)."""
    for column in range(cached - 1, first - 1, -1):
        block = _release(host, row, column, pool.refcounts)
        if block >= 0:
            park(block, pool)


@inlined
def truncate(pool: Pool, tops: np.ndarray, host: np.ndarray, row: int, start: int,
              end: int) -> None:
    """Columns ``start`` to ``end`` of ``row`` emptied (`BlockTable.truncate`) and their blocks
    released, one nobody else holds onto the free stack (`BlockPool.release_unique`)."""
    free_stack, refcounts = pool.free_stack, pool.refcounts
    for column in range(start, end):
        block = _release(host, row, column, refcounts)
        if block >= 0:
            free_stack[tops[NUM_FREE]] = block
            tops[NUM_FREE] += 1


@inlined
def _release(host: np.ndarray, row: int, column: int, refcounts: np.ndarray) -> int:
    """Empty one cell of the table; returns its block if nobody holds it any more, else -1."""
    block = host[row, column]
    host[row, column] = -1
    refcounts[block] -= 1
    return block if refcounts[block] == 0 else -1


@inlined
def take(pool: Pool, tops: np.ndarray, evicted: np.ndarray, host: np.ndarray, row: int,
          start: int, end: int) -> None:
    """`reference._take` into columns ``start`` to ``end`` of ``row``: blocks with refcount 1 off
    the free stack; when the stack is empty, the LRU head is evicted onto it first (and recorded
    in ``evicted``)."""
    free_stack, refcounts = pool.free_stack, pool.refcounts
    for column in range(start, end):
        if tops[NUM_FREE] == 0:
            block = pool.lru[LRU_HEAD]
            unpark(block, pool)
            free_stack[0] = block
            evicted[tops[NUM_EVICTED]] = block
            tops[NUM_EVICTED] += 1
            tops[NUM_FREE] = 1
        tops[NUM_FREE] -= 1
        block = free_stack[tops[NUM_FREE]]
        refcounts[block] = 1
        host[row, column] = block


@inlined
def unpark(block: int, pool: Pool) -> None:
    """`BlockPool.unpark`: ``block`` out of the LRU list."""
    lru_prev, lru_next, lru = pool.lru_prev, pool.lru_next, pool.lru
    before = lru_prev[block]
    after = lru_next[block]
    if before >= 0:
        lru_next[before] = after
    else:
        lru[LRU_HEAD] = after
    if after >= 0:
        lru_prev[after] = before
    else:
        lru[LRU_TAIL] = before
    lru_prev[block] = -1
    lru_next[block] = -1
    lru[LRU_LENGTH] -= 1


@inlined
def park(block: int, pool: Pool) -> None:
    """`BlockPool.park`: ``block`` at the LRU tail."""
    lru_prev, lru_next, lru = pool.lru_prev, pool.lru_next, pool.lru
    tail = lru[LRU_TAIL]
    lru_prev[block] = tail
    lru_next[block] = -1
    if tail >= 0:
        lru_next[tail] = block
    else:
        lru[LRU_HEAD] = block
    lru[LRU_TAIL] = block
    lru[LRU_LENGTH] += 1
