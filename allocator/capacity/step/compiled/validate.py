"""Phase 1 of the compiled step, `reference.validate`: the whole plan checked before anything
changes, in the reference's order (so the same error for the same bad plan).

List by list in plan order, every row live and listed once and every count at least its least
value (`codes.NAMES_ROWS`, ``LEAST_VALUE``); then the upper bounds; then every first chunk within
its prompt, a row both reverted and settled only with a step behind its grant, and no request in
two lists that exclude each other.

Invariants: ``seen`` is all False on entry and on return; the first failed check writes
``error`` and ends the phase.
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.step import codes
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.loops import fail
from kvalloc.allocator.capacity.step.compiled.tuples import Plan, State


@inlined
def validate(plan: Plan, state: State, seen: np.ndarray, error: np.ndarray) -> None:
    """`reference.validate`: the first check the plan fails, written into ``error``."""
    live, limits = state.rows.live, state.limits
    no_limit = np.iinfo(np.int64).max
    for subject in range(len(plan)):
        values = plan[subject]
        if codes.NAMES_ROWS[subject]:
            i = _first_unknown(values, live)
            if i >= 0:
                return fail(error, codes.UNKNOWN_ROW, subject, i, 0)
            i = _first_repeat(values, seen)
            if i >= 0:
                return fail(error, codes.DUPLICATE_ROW, subject, i, 0)
        else:
            least = codes.LEAST_VALUE[subject]
            i = _first_outside(values, least, no_limit)
            if i >= 0:
                return fail(error, codes.BELOW_MINIMUM, subject, i, least)
    for values, subject, most, kind in (
            (plan.draft_lens, codes.DRAFTS, limits.max_draft_len, codes.ABOVE_MAX_DRAFT),
            (plan.padded_draft_lens, codes.PADDED, limits.max_draft_len, codes.ABOVE_MAX_DRAFT),
            (plan.prompt_lens, codes.PROMPTS, limits.max_seq_len, codes.PROMPT_TOO_LONG)):
        i = _first_outside(values, -no_limit, most)
        if i >= 0:
            return fail(error, kind, subject, i, most)
    for i in range(plan.first_chunks.size):
        if plan.first_chunks[i] > plan.prompt_lens[i]:
            return fail(error, codes.CHUNK_PAST_PROMPT, codes.FIRST_CHUNKS, i, 0)
    i = _first_reverted_alone(plan.result_rows, plan.revert_rows, state.rows.behind, seen)
    if i >= 0:
        return fail(error, codes.REVERTED_AND_SETTLED, codes.RESULTS, i, 0)
    none = plan.revert_rows[:0]
    for rows, subject, first, second, third, kind in (
            (plan.finished_rows, codes.FINISHED, plan.grant_rows, plan.padding_rows,
             plan.prefill_rows, codes.FINISHED_AND_SCHEDULED),
            (plan.prefill_rows, codes.GRANTS, plan.grant_rows, none, none,
             codes.SCHEDULED_AND_PREFILLED),
            (plan.prefill_rows, codes.PADDING, plan.padding_rows, none, none,
             codes.SCHEDULED_AND_PREFILLED)):
        i = _first_listed(rows, first, second, third, seen)
        if i >= 0:
            return fail(error, kind, subject, i, 0)
    return None


@inlined
def _first_unknown(rows: np.ndarray, live: np.ndarray) -> int:
    """Index of the first row that is out of range or not live, or -1."""
    for i in range(rows.size):
        if rows[i] < 0 or rows[i] >= live.size or not live[rows[i]]:
            return i
    return -1


@inlined
def _first_repeat(rows: np.ndarray, seen: np.ndarray) -> int:
    """Index of the first row listed earlier in ``rows``, or -1 (``seen``: all False on entry
    and on return)."""
    repeat = -1
    for i in range(rows.size):
        if seen[rows[i]]:
            repeat = i
            break
        seen[rows[i]] = True
    for i in range(rows.size):
        seen[rows[i]] = False
    return repeat


@inlined
def _first_outside(values: np.ndarray, least: int, most: int) -> int:
    """Index of the first value below ``least`` or above ``most``, or -1."""
    for i in range(values.size):
        if values[i] < least or values[i] > most:
            return i
    return -1


@inlined
def _first_listed(rows: np.ndarray, first: np.ndarray, second: np.ndarray, third: np.ndarray,
                  seen: np.ndarray) -> int:
    """Index of the first of ``rows`` also in ``first``, ``second`` or ``third``, or -1."""
    for others in (first, second, third):
        for i in range(others.size):
            seen[others[i]] = True
    found = -1
    for i in range(rows.size):
        if seen[rows[i]]:
            found = i
            break
    for others in (first, second, third):
        for i in range(others.size):
            seen[others[i]] = False
    return found


@inlined
def _first_reverted_alone(results: np.ndarray, reverts: np.ndarray, behind: np.ndarray,
                          seen: np.ndarray) -> int:
    """Index of the first of ``results`` also reverted while no step is behind its grant (with
    one, results settle the older step and the revert undoes the newer), or -1."""
    for row in reverts:
        seen[row] = True
    found = -1
    for i in range(results.size):
        if seen[results[i]] and not behind[results[i]]:
            found = i
            break
    for row in reverts:
        seen[row] = False
    return found
