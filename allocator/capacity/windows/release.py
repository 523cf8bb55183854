"""Sliding-window accounting: a windowed group gives back the blocks behind every window.

A layer with window ``W`` reads, for a query at position ``p``, only the keys in ``(p - W, p]``.
Its group's rows grow at the end exactly as a full-attention row does (capacity, slack and
reclaim are the manager's, unchanged), and this module adds one phase after each step: the
leading columns no unsettled or future step can read go back to the pool, and the table says
`block_table.RELEASED` there. `WindowRelease.release` is that phase in numpy, run after
`reference_step`; the compiled step runs it as its last phase (`step.compiled.release`), and the
two are tested against each other.

**What may still be read.** A row's ``read_from`` is the lowest query position of any step that
is scheduled and may not have run, or is yet to come:

- a step's *start*: a prefill chunk's first position; else the settled history, since every
  unsettled generation step starts at or after it (the device may be ahead of the host's
  history by the drafts it accepted, never behind it);
- at lag 1 the previous step has run when the host plans this one, so ``read_from`` is this
  step's start; at lag 2 the previous step may still be in flight, so it is the lower of this
  step's start and the previous one's (a prefill chunk counts as history once scheduled, so
  without this the chunk still running would lose its window's blocks).

Blocks handed to another row are written only by later steps of the same stream, so a block is
free to go once no step that is scheduled or to come reads it.

**Released columns.** ``released = max(0, floor((read_from - W + 1) / T))``: every position in
those columns is below ``read_from - W + 1``, the first key any such query reads. Or fewer: the
release stops at ``keep_from``, a row's first prompt block its prefix cache may still register
(below).

**Cached columns.** With prefix caching a row's first ``cached`` columns are registered prompt
blocks (`prefix_cache`), and the window passes them like any other: a released block that is a
cached one and that nobody else holds is *parked* (the cache keeps it, evictable, and a later
request whose hit needs it takes it back), never pushed on the free stack. Its column says
`RELEASED` all the same; ``cached`` still counts it, so a row's cached blocks in hand are its
columns ``[released, cached)``. The cached blocks are the row's leading ones, so the free stack
gets the released blocks that are not, in the order the compiled step pushes them, and the LRU
list the cached ones, in order too.

**Blocks still to register.** A cache that registers a block only once its caller says it is
written (``register_when_written``) hears so after the step that settles it, and at lag 2 a call
later still: by then the window has usually passed it. A block released unregistered would be
lost to the cache (its content is gone once another row takes it), so the release keeps a row's
columns from ``keep_from`` on: the row's first unregistered prompt block while its prompt may
still register (`PrefixCache.registering`, which it reads in place), `NO_HOLD` otherwise.
Once the block registers, the next step releases it, parked like any cached block the window
passed. A request that finishes or is preempted first gives its kept blocks back with the rest
of its row. A row admitted in the step keeps nothing (its hit is registered). A cache that
registers at scheduling has registered a block before any window passes it: nothing is kept.

Invariants (``check_invariants``, with the manager's):

- ``released[r] == min(max(0, (read_from[r] - W + 1) // T), keep_from[r])`` for a live row, 0
  otherwise, and ``read_from[r] <= history[r]``; a kept row's ``keep_from`` is at most its
  ``cached`` columns (registering only adds to them; a row not live keeps nothing);
- the table holds `RELEASED` in ``[0, released)`` and a real block in every column from there
  to the row's last block (`BlockTable.check_invariants`): every column a reach can touch, read
  or write, is a real block;
- a row holds ``num_blocks - released <= config.window_row_blocks(W, capacity - read_from, T)``
  blocks (the exact bound, derived there) besides the ones it keeps to register; a decoding
  row's span ``capacity - read_from`` is at most `config.decode_span`, so a long request holds a
  bounded number of blocks whatever its length (`PoolConfig.max_live_blocks_per_seq`) once its
  prompt has registered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from kvalloc.allocator.capacity.state import CapacityState, RowState
from kvalloc.allocator.capacity.step.plan import PlanArrays, StepOutcome, with_changes
from kvalloc.allocator.config import window_row_blocks
from kvalloc.allocator.errors import InvariantViolation

if TYPE_CHECKING:  # the cache's hits import this module
    from kvalloc.allocator.capacity.prefix_cache import PrefixCache

# ``keep_from`` of a row that keeps nothing for its prefix cache: past any column.
NO_HOLD = np.iinfo(np.int64).max


def _cached_cells(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                  cached: np.ndarray) -> np.ndarray:
    """Per cell of the ragged ranges ``[starts[i], ends[i])`` of ``rows[i]``, row after row:
    whether it is one of the row's cached columns."""
    counts = ends - starts
    columns = np.repeat(starts, counts) + np.arange(int(counts.sum())) - np.repeat(
        np.cumsum(counts) - counts, counts)
    return columns < np.repeat(cached[rows], counts)


def released_columns(read_from: np.ndarray, window: int, tokens_per_block: int) -> np.ndarray:
    """Leading columns wholly behind the first key a query at ``read_from`` reads."""
    return np.maximum(0, (read_from - window + 1) // tokens_per_block)


class WindowRelease:
    """The release phase of one windowed manager: ``read_from`` and the previous step's start
    per row, and the phase itself (`release`). Its arrays change only in place: the compiled
    step holds them from the manager's start."""

    def __init__(self, window: int, tokens_per_block: int, num_rows: int,
                 cache: PrefixCache | None = None) -> None:
        """``cache``: the group's prefix cache, whose rows that may still register blocks
        (`PrefixCache.registering`) the release reads in place."""
        self.window = window
        self.tokens_per_block = tokens_per_block
        self.read_from = np.zeros(num_rows, dtype=np.int64)
        self.last_start = np.zeros(num_rows, dtype=np.int64)
        # Tokens at the end of a row's history that its caller may still schedule again: a chunk
        # this group served ahead of the other groups (`groups`), which runs when all have it.
        self.held_back = np.zeros(num_rows, dtype=np.int64)
        self.registering = (np.zeros(num_rows, dtype=bool) if cache is None
                            else cache.registering)
        # The first column the last release kept for the prefix cache (`NO_HOLD`: none).
        self.keep_from = np.full(num_rows, NO_HOLD, dtype=np.int64)

    def release(self, plan: PlanArrays, outcome: StepOutcome,
                state: CapacityState) -> StepOutcome:
        """After a step that ran: move ``read_from``, give back the columns behind it, and
        return the outcome with those cells among its changes."""
        rows, table = state.rows, state.table
        start = rows.history.copy()
        chunks = plan.prefill_rows[outcome.prefill_granted]
        start[chunks] = outcome.prefill_starts[outcome.prefill_granted]
        admitted = outcome.admitted_rows[outcome.admitted_rows >= 0]
        start[admitted] = outcome.cached_tokens[outcome.admitted_rows >= 0]
        fresh = np.zeros(start.size, dtype=bool)
        fresh[admitted] = True
        earlier = np.where(fresh | (plan.lag == 1), start, self.last_start)
        lowest = np.minimum(np.minimum(start, earlier), rows.history - self.held_back)
        read_from = np.where(rows.live, np.maximum(self.read_from, lowest), 0)
        read_from[fresh] = start[fresh]
        self.read_from[:] = read_from
        self.last_start[:] = np.where(rows.live, start, 0)
        self.keep_from[:] = np.where(self.registering & rows.live & ~fresh, rows.cached, NO_HOLD)
        target = np.where(rows.live, np.minimum(released_columns(
            read_from, self.window, self.tokens_per_block), self.keep_from), 0)
        moved = np.flatnonzero(target > rows.released)
        if moved.size == 0:
            return outcome
        old = rows.released[moved].copy()
        blocks = table.release_leading(moved, old, target[moved])
        cached = _cached_cells(moved, old, target[moved], rows.cached)
        state.pool.release_unique(blocks[~cached])
        for block in blocks[cached].tolist():
            state.pool.refcounts[block] -= 1
            if state.pool.refcounts[block] == 0:
                state.pool.park(block)
        rows.released[moved] = target[moved]
        table.sync()
        return with_changes(outcome, moved, old, rows.num_blocks, table.host)

    def check_invariants(self, rows: RowState) -> None:
        dead, live = ~rows.live, np.flatnonzero(rows.live)
        if (self.read_from[dead].any() or self.last_start[dead].any() or rows.released[dead].any()
                or (self.keep_from[dead] != NO_HOLD).any()):
            raise InvariantViolation("a row that is not live records a window")
        if (self.read_from[live] > rows.history[live]).any():
            raise InvariantViolation("read_from is past the history")
        keep = self.keep_from[live]
        if ((keep != NO_HOLD) & (keep > rows.cached[live])).any():
            raise InvariantViolation("a row keeps columns from past its cached ones")
        want = released_columns(self.read_from[live], self.window, self.tokens_per_block)
        if not np.array_equal(rows.released[live], np.minimum(want, keep)):
            raise InvariantViolation("released columns != min(max(0, (read_from - W + 1) // T), "
                                     "keep_from)")
        bound = window_row_blocks(self.window, rows.capacity[live] - self.read_from[live],
                                  self.tokens_per_block)
        if (rows.num_blocks[live] - want > bound).any():
            raise InvariantViolation("a windowed row holds more blocks than its window needs")
