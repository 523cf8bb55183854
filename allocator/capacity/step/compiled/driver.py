"""The compiled step's driver: `_step` runs the phases in `reference_step`'s order, and
`CompiledStep` runs it over one manager's `CapacityState`.

`_step` calls the phase modules' functions, named as the reference's phases, with the same
arguments (the state and the step's scratch arrays as `tuples`' named tuples): ``validate``,
``settle_step``, ``plan_grants``, ``plan_prefill``, ``serve_blocks``, then, when nothing can
fail any more, ``replace_state`` and ``move_blocks``, and, in a windowed group, `release`
(`WindowRelease.release`, which runs after `reference_step` in the numpy step). It is the one
function compiled on its own: every phase is inlined into it, so the step is one native routine
with one signature.

Invariants: a phase that writes ``error`` ends the step with empty outputs, before the row state,
the pool or the table changed; `CompiledStep` copies the stack tops back, and marks the table's
changed cells, only after a step that ran to its end.
"""
from __future__ import annotations

from dataclasses import asdict
from operator import attrgetter

import numpy as np
from kvalloc.allocator.capacity.state import COUNTER_NAMES, POLICY_CODES, CapacityState, RowState
from kvalloc.allocator.capacity.step import codes
from kvalloc.allocator.capacity.step.compiled.demand import plan_grants, plan_prefill
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.move import changes, move_blocks
from kvalloc.allocator.capacity.step.compiled.release import release
from kvalloc.allocator.capacity.step.compiled.replace import replace_state
from kvalloc.allocator.capacity.step.compiled.serve import serve_blocks
from kvalloc.allocator.capacity.step.compiled.settle import settle_step
from kvalloc.allocator.capacity.step.compiled.tuples import (
    COUNT_ADDED,
    COUNT_EVICTED,
    COUNT_FREED,
    COUNT_NOT_ADDED,
    NUM_EVICTED,
    NUM_FREE,
    NUM_FREE_ROWS,
    HitArrays,
    Limits,
    Plan,
    Pool,
    Rows,
    Scratch,
    Settled,
    State,
    Table,
    Window,
)
from kvalloc.allocator.capacity.step.compiled.validate import validate
from kvalloc.allocator.capacity.step.plan import PlanArrays, StepOutcome
from kvalloc.allocator.capacity.step.reference import NO_HITS, Hits, StepRun
from kvalloc.allocator.capacity.windows.release import WindowRelease
from kvalloc.allocator.common.jit import jit, numba, views


def available() -> bool:
    """Whether numba imports here (the manager's default then is the compiled step)."""
    return numba is not None


def _step(plan: tuple, strict: bool, lag: int, state: tuple, hits: tuple, settled: tuple,
          scratch: tuple, window: tuple, error: np.ndarray, deltas: np.ndarray,
          apply: bool) -> tuple:
    """One step: `reference_step`. The arguments come as plain tuples (numba types a named
    tuple argument on a slow path, a microsecond a call) of the fields of `Plan`, `State` (its
    ``limits``, ``rows``, ``pool`` and ``table`` the same), `HitArrays`, `Settled`, `Scratch`
    and `Window`. Returns the outcome's arrays as four (its bool columns joined, its int64
    columns joined, the refusals, the changed ids) and the number of changed rows, or empty ones
    when ``error`` stops the step or, with ``apply`` False, once every check has passed (nothing
    changed); ``deltas``: the counter deltas."""
    plan, hits = Plan(*plan), HitArrays(*hits)
    settled, scratch = Settled(*settled), Scratch(*scratch)
    limits, rows, pool, table, tops = state
    state = State(Limits(*limits), Rows(*rows), Pool(*pool), Table(*table), tops)
    validate(plan, state, scratch.seen, error)
    if error[0]:
        return _no_outcome()
    settle_step(plan, state, settled, error)
    if error[0]:
        return _no_outcome()
    demand = plan_grants(plan, lag, state, settled, scratch, error)
    if error[0]:
        return _no_outcome()
    plan_prefill(plan, state, settled, demand, error)
    if error[0]:
        return _no_outcome()
    served = serve_blocks(plan, strict, state, settled, demand, hits, scratch, error)
    if error[0] or not apply:
        return _no_outcome()
    replace_state(plan, lag, state, settled, demand, served, deltas)
    admitted_rows, cached_tokens = move_blocks(plan, state, served, hits, scratch)
    release(plan, lag, state, Window(*window), served.prefill_ok, served.prefill_starts,
            admitted_rows, cached_tokens, scratch.released_from)
    changed_rows, changed_from, changed_blocks, changed_ids, changed_cells = changes(
        state.rows.num_blocks, scratch.old_blocks, scratch.rewritten, scratch.released_from,
        state.table.host)
    deltas[COUNT_EVICTED] = tops[NUM_EVICTED]
    admitted = served.refusals.size - np.count_nonzero(served.refusals)
    deltas[COUNT_ADDED] = admitted
    deltas[COUNT_NOT_ADDED] = served.refusals.size - admitted
    deltas[COUNT_FREED] = plan.finished_rows.size
    # Four arrays, not twelve: each array returned costs a conversion (`CompiledStep.run` cuts
    # them into `StepOutcome`'s views).
    return (np.concatenate((served.granted, served.prefill_ok)),
            np.concatenate((admitted_rows, cached_tokens, served.grant_starts,
                            served.prefill_starts, changed_rows, changed_from, changed_blocks,
                            changed_cells)),
            served.refusals, changed_ids, changed_rows.size)


@inlined
def _no_outcome() -> tuple:
    """`_step`'s outcome, empty."""
    return (np.empty(0, dtype=np.bool_), np.empty(0, dtype=np.int64),
            np.empty(0, dtype=np.int8), np.empty(0, dtype=np.int32), 0)


if numba is not None:
    # The one function compiled on its own, and cached on disk: every other is inlined into it.
    _step = jit(_step)

_plan_lists = len(Plan._fields)
_row_arrays = attrgetter(*Rows._fields)
_pool_arrays = attrgetter(*Pool._fields)
_table_arrays = attrgetter(*Table._fields)


class CompiledStep:
    """The compiled step over one manager's `CapacityState`, with its scratch arrays."""

    def __init__(self, state: CapacityState, window: WindowRelease | None = None) -> None:
        """``window``: a windowed group's release, which the step runs as its last phase."""
        if numba is None:
            raise ImportError("the compiled step needs numba (pip install numba)")
        limits = state.limits
        n = limits.max_batch_size
        self.limits = tuple(Limits(**{**asdict(limits), "overlap": bool(limits.overlap),
                                      "policy": POLICY_CODES[limits.policy]}))

        def counts(size: int = n) -> np.ndarray:
            return np.zeros(size, dtype=np.int64)

        def marks(size: int = n) -> np.ndarray:
            return np.zeros(size, dtype=bool)

        # `_step` takes them as plain tuples.
        like = RowState.empty(1)
        self.settled = tuple(np.zeros(n, dtype=getattr(like, name).dtype)
                             for name in Settled._fields)
        blocks = state.pool.num_blocks
        self.scratch = Scratch(item_rows=counts(), is_new_grant=marks(), wanted_draft=counts(),
                               target_capacity=counts(), item_ok=marks(), seen=marks(),
                               claimed=marks(blocks), rewritten=marks(), old_blocks=counts(),
                               released_from=np.full(n, -1, dtype=np.int64),
                               evicted=counts(blocks))
        self.window = tuple(
            Window(0, *(counts(0),) * 3, marks(0), counts(0), counts(0), marks(0))
            if window is None else Window(
                window.window, window.read_from, window.last_start, window.held_back,
                window.registering, window.keep_from, counts(), marks()))
        self.scratch_arrays = tuple(self.scratch)
        self.tops = np.zeros(3, dtype=np.int64)
        self.no_hits = counts()

    def run(self, plan: PlanArrays, state: CapacityState, hits: Hits = NO_HITS,
            apply: bool = True) -> StepRun:
        rows, pool, table = state.rows, state.pool, state.table
        error = np.zeros(codes.ERROR_SLOTS, dtype=np.int64)
        deltas = np.zeros(len(COUNTER_NAMES), dtype=np.int64)
        self.tops[NUM_FREE] = pool.num_free
        self.tops[NUM_FREE_ROWS] = table.num_free_rows
        num_new = plan.prompt_lens.size
        hit_counts = hits.counts if hits.counts.size == num_new else self.no_hits[:num_new]
        released = (hits.released if hits.released is not None and hits.released.size == num_new
                    else self.no_hits[:num_new])
        step_state = (self.limits, _row_arrays(rows), _pool_arrays(pool), _table_arrays(table),
                      self.tops)
        flags, values, refusals, changed_ids, num_changed = _step(
            plan[:_plan_lists], plan.strict_grants, plan.lag, step_state,
            (hit_counts, hits.blocks, released),
            self.settled, self.scratch_arrays, self.window, error, deltas, apply)
        if error[0] or not apply:
            return StepRun(error)
        num_grants, num_chunks = plan.grant_rows.size, plan.prefill_rows.size
        granted, chunk_ok = views(flags, (num_grants,))
        (admitted_rows, cached_tokens, grant_starts, chunk_starts, changed_rows, changed_from,
         changed_blocks, changed_cells) = views(values, (num_new, num_new, num_grants, num_chunks,
                                                         num_changed, num_changed, num_changed))
        pool.num_free = int(self.tops[NUM_FREE])
        table.num_free_rows = int(self.tops[NUM_FREE_ROWS])
        table.mark_cells(changed_cells)
        table.sync()
        outcome = StepOutcome(
            granted=granted, prefill_granted=chunk_ok, admitted_rows=admitted_rows,
            new_refusals=refusals, grant_starts=grant_starts, prefill_starts=chunk_starts,
            changed_rows=changed_rows, changed_from=changed_from,
            changed_num_blocks=changed_blocks, changed_block_ids=changed_ids,
            num_blocks=rows.num_blocks.copy(), cached_tokens=cached_tokens,
        )
        return StepRun(error, outcome, deltas,
                          self.scratch.evicted[: self.tops[NUM_EVICTED]].copy())
