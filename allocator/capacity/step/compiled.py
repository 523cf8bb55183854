"""The batched step compiled with numba, for the hot path: `reference`'s phases, one for one.

`reference_step` is the specification; this is the same step written as plain loops over int64
arrays so that numba compiles it to native code: the same checks in the same order (so the same
error for the same bad plan), the same block moves in the same order (so the same block ids,
free stack and table cells), the same outcome and counter deltas. Tests run both on random plans
and compare every array of the state after each step.

`_step` is `reference_step`'s driver: it calls functions named as the reference's phases, in its
order, with the same arguments (the state and the step's scratch arrays as named tuples, so that
the two files read side by side):

1. ``validate``;
2. ``settle_step``: reverts, then results, into `Settled` (scratch copies of the row state);
3. ``plan_grants`` (returns the `Demand`) and ``plan_prefill``;
4. ``serve_blocks``: row overflow, blocks served in order (`serve_in_order`, then
   `serve_hits_in_order` for the new requests), rows for the new requests (returns `Served`);

and only then, when nothing can fail any more,

5. ``replace_state``: the settled and granted state replaces the row state;
6. ``move_blocks``: new requests take their cached blocks, every row's blocks follow its
   capacity (``_park_prefix``, ``_truncate``, ``_take``), finished rows are reset, new requests
   are admitted (``_admit``); returns the outcome's arrays.

A phase that finds bad input writes ``[kind, subject, index, detail]`` (`codes`) into ``error``
and returns at once (its result unfinished); `_step` then returns empty outputs. Nothing is
changed before every check has passed: the settled state is built in scratch arrays and copied
back only then.

Every function here is compiled into `_step` (``inline="always"``, see the note where they are
compiled), so the step is still one native routine, and `_step` its one compiled signature.
numba caches it on disk (``cache=True``, next to this file or, when that is not writable, in
numba's user cache directory; ``NUMBA_CACHE_DIR`` overrides both), so only the first process on
a machine pays the compile.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import asdict, fields
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from allocator.capacity.accounting import blocks_for as _blocks_for
from allocator.capacity.accounting import lag2_slack as _lag2_slack
from allocator.capacity.accounting import released_behind as _released_behind
from allocator.capacity.accounting import settle_behind as _settle_behind
from allocator.capacity.accounting import slack_rule as _slack_for
from allocator.capacity.state import (
    COUNTER_INDEX,
    COUNTER_NAMES,
    POLICY_CODES,
    CapacityState,
    RowState,
    StepLimits,
)
from allocator.capacity.step import codes, reference
from allocator.capacity.step.plan import (
    REFUSED_BATCH_FULL,
    REFUSED_OUT_OF_BLOCKS,
    PlanArrays,
    StepOutcome,
)
from allocator.capacity.step.reference import NO_HITS, Hits, StepRun
from allocator.common.jit import jit, numba
from allocator.config import SlackPolicy


def available() -> bool:
    """Whether numba imports here (the manager's default then is the compiled step)."""
    return numba is not None


RECLAIM = POLICY_CODES[SlackPolicy.RECLAIM]
NO_SLACK = POLICY_CODES[SlackPolicy.NONE]
COUNT_GRANTS = COUNTER_INDEX["grants"]
COUNT_REFUSED = COUNTER_INDEX["grants_refused"]
COUNT_REVERTS = COUNTER_INDEX["reverts"]
COUNT_UPDATES = COUNTER_INDEX["updates"]
COUNT_REWOUND = COUNTER_INDEX["rewound_tokens"]
COUNT_RECLAIMED = COUNTER_INDEX["reclaimed_slack_tokens"]
COUNT_TOPUPS = COUNTER_INDEX["padding_topups"]
COUNT_ADDED = COUNTER_INDEX["requests_added"]
COUNT_NOT_ADDED = COUNTER_INDEX["requests_refused"]
COUNT_FREED = COUNTER_INDEX["requests_freed"]
COUNT_EVICTED = COUNTER_INDEX["evicted_blocks"]

# `State.tops`: the stack tops the step moves (numba cannot assign a tuple's fields).
NUM_FREE = 0  # `BlockPool.num_free`
NUM_FREE_ROWS = 1  # `BlockTable.num_free_rows`
NUM_EVICTED = 2  # blocks this step evicted, in `Scratch.evicted`
# `BlockPool.lru`'s entries.
LRU_HEAD, LRU_TAIL, LRU_LENGTH = 0, 1, 2


# The named tuples the step's functions take (numba compiles a field read to a struct read).
# These four have the fields of `PlanArrays` (its lists: all int64, so that `validate` can index
# them by subject code), `StepLimits` (the policy as its code, `POLICY_CODES`), `RowState` and
# `reference.Settled` (in scratch arrays).
Plan = namedtuple("Plan", [name for name in PlanArrays._fields
                           if name not in ("strict_grants", "lag")])
Limits = namedtuple("Limits", [field.name for field in fields(StepLimits)])
Rows = namedtuple("Rows", [field.name for field in fields(RowState)])
Settled = namedtuple("Settled", [field.name for field in fields(reference.Settled)])


class Pool(NamedTuple):
    """`BlockPool`'s arrays (its ``num_free`` is ``State.tops[NUM_FREE]``)."""

    free_stack: np.ndarray
    refcounts: np.ndarray
    lru_prev: np.ndarray
    lru_next: np.ndarray
    lru: np.ndarray


class Table(NamedTuple):
    """`BlockTable`'s host arrays (its ``num_free_rows`` is ``State.tops[NUM_FREE_ROWS]``)."""

    host: np.ndarray
    free_rows: np.ndarray


class State(NamedTuple):
    """`CapacityState`, and the tops of its stacks (updated)."""

    limits: Limits
    rows: Rows
    pool: Pool
    table: Table
    tops: np.ndarray  # int64 [3]: NUM_FREE, NUM_FREE_ROWS, NUM_EVICTED


class HitArrays(NamedTuple):
    """`Hits`' arrays: one count per new request, their blocks concatenated."""

    counts: np.ndarray
    blocks: np.ndarray


class Demand(NamedTuple):
    """`reference.Demand`; its arrays are `Scratch`'s, ``item_rows`` a view of its first ones."""

    item_rows: np.ndarray
    num_topups: int
    is_new_grant: np.ndarray
    wanted_draft: np.ndarray
    target_capacity: np.ndarray


class Served(NamedTuple):
    """`reference.Served` without ``admitted``, ``first_tokens`` and ``hit_counts``: a new request
    is admitted where its refusal is 0, and `_admit` works out the rest from the plan and hits."""

    item_ok: np.ndarray  # per row that grows (top-ups, grants, prefill chunks): a view of scratch
    granted: np.ndarray
    prefill_ok: np.ndarray
    refusals: np.ndarray
    grant_starts: np.ndarray
    prefill_starts: np.ndarray


class Scratch(NamedTuple):
    """The step's other working arrays, kept between steps (so a step allocates little). Per
    row: ``item_rows`` (`Demand`'s, then `serve_blocks` puts the prefill rows after them),
    ``is_new_grant``, ``wanted_draft``, ``target_capacity`` (`Demand`), ``item_ok`` (`Served`;
    top-ups, grants and prefill chunks name distinct rows, so they fit), ``seen`` (`validate`),
    ``rewritten`` (freed or admitted rows) and ``old_blocks`` (`move_blocks`). Per block:
    ``claimed`` (`serve_hits_in_order`) and ``evicted`` (`_take`). ``seen`` and ``claimed`` are
    all False on entry and on return."""

    item_rows: np.ndarray
    is_new_grant: np.ndarray
    wanted_draft: np.ndarray
    target_capacity: np.ndarray
    item_ok: np.ndarray
    seen: np.ndarray
    claimed: np.ndarray
    rewritten: np.ndarray
    old_blocks: np.ndarray
    evicted: np.ndarray


def _step(plan: tuple, strict: bool, lag: int, state: tuple, hits: tuple, settled: tuple,
          scratch: tuple, error: np.ndarray, deltas: np.ndarray) -> tuple:
    """One step: `reference_step`. The arguments come as plain tuples (numba types a named
    tuple argument on a slow path, a microsecond a call) of the fields of `Plan`, `State` (its
    ``limits``, ``rows``, ``pool`` and ``table`` the same), `HitArrays`, `Settled` and
    `Scratch`. Returns `move_blocks`' outcome, or empty arrays when ``error`` stops the step;
    ``deltas``: the counter deltas."""
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
    if error[0]:
        return _no_outcome()
    replace_state(plan, lag, state, settled, demand, served, deltas)
    outcome = move_blocks(plan, state, served, hits, scratch)
    deltas[COUNT_EVICTED] = tops[NUM_EVICTED]
    admitted = served.refusals.size - np.count_nonzero(served.refusals)
    deltas[COUNT_ADDED] = admitted
    deltas[COUNT_NOT_ADDED] = served.refusals.size - admitted
    deltas[COUNT_FREED] = plan.finished_rows.size
    return outcome


def _no_outcome() -> tuple:
    """`move_blocks`' outcome, empty."""
    nothing = np.empty(0, dtype=np.int64)
    no = np.empty(0, dtype=np.bool_)
    return (no, no, nothing, np.empty(0, dtype=np.int8), nothing, nothing, nothing, nothing,
            nothing, np.empty(0, dtype=np.int32), nothing, nothing)


def _fail(error: np.ndarray, kind: int, subject: int, index: int, detail: int) -> None:
    error[0] = kind
    error[1] = subject
    error[2] = index
    error[3] = detail


# ---------------------------------------------------------------------- 1. validate

def validate(plan: Plan, state: State, seen: np.ndarray, error: np.ndarray) -> None:
    live, limits = state.rows.live, state.limits
    no_limit = np.iinfo(np.int64).max
    for subject in range(len(plan)):
        values = plan[subject]
        if codes.NAMES_ROWS[subject]:
            i = _first_unknown(values, live)
            if i >= 0:
                return _fail(error, codes.UNKNOWN_ROW, subject, i, 0)
            i = _first_repeat(values, seen)
            if i >= 0:
                return _fail(error, codes.DUPLICATE_ROW, subject, i, 0)
        else:
            least = codes.LEAST_VALUE[subject]
            i = _first_outside(values, least, no_limit)
            if i >= 0:
                return _fail(error, codes.BELOW_MINIMUM, subject, i, least)
    for values, subject, most, kind in (
            (plan.draft_lens, codes.DRAFTS, limits.max_draft_len, codes.ABOVE_MAX_DRAFT),
            (plan.padded_draft_lens, codes.PADDED, limits.max_draft_len, codes.ABOVE_MAX_DRAFT),
            (plan.prompt_lens, codes.PROMPTS, limits.max_seq_len, codes.PROMPT_TOO_LONG)):
        i = _first_outside(values, -no_limit, most)
        if i >= 0:
            return _fail(error, kind, subject, i, most)
    for i in range(plan.first_chunks.size):
        if plan.first_chunks[i] > plan.prompt_lens[i]:
            return _fail(error, codes.CHUNK_PAST_PROMPT, codes.FIRST_CHUNKS, i, 0)
    i = _first_reverted_alone(plan.result_rows, plan.revert_rows, state.rows.behind, seen)
    if i >= 0:
        return _fail(error, codes.REVERTED_AND_SETTLED, codes.RESULTS, i, 0)
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
            return _fail(error, kind, subject, i, 0)
    return None


def _first_unknown(rows: np.ndarray, live: np.ndarray) -> int:
    """Index of the first row that is out of range or not live, or -1."""
    for i in range(rows.size):
        if rows[i] < 0 or rows[i] >= live.size or not live[rows[i]]:
            return i
    return -1


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


def _first_outside(values: np.ndarray, least: int, most: int) -> int:
    """Index of the first value below ``least`` or above ``most``, or -1."""
    for i in range(values.size):
        if values[i] < least or values[i] > most:
            return i
    return -1


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


def _first_marked(rows: np.ndarray, marks: np.ndarray, value: bool) -> int:
    """Index of the first of ``rows`` whose mark is ``value``, or -1."""
    for i in range(rows.size):
        if marks[rows[i]] == value:
            return i
    return -1


# ---------------------------------------------------------------------- 2. settle

def settle_step(plan: Plan, state: State, settled: Settled, error: np.ndarray) -> None:
    """`reference.settle_step`, into ``settled``. Loops read arrays, never the tuple: an inlined
    helper given a tuple per row costs a reference count per array in it."""
    reverts, results, accepted = plan.revert_rows, plan.result_rows, plan.num_accepted
    policy = state.limits.policy
    _copy_settled(settled, state.rows)
    capacity, history, slack, draft_len = (settled.capacity, settled.history, settled.slack,
                                           settled.draft_len)
    pending, ahead, lead = settled.pending, settled.ahead, settled.lead
    behind, behind_draft, behind_slack = settled.behind, settled.behind_draft, settled.behind_slack
    i = _first_marked(reverts, pending, False)
    if i >= 0:
        return _fail(error, codes.NO_PENDING_GRANT, codes.REVERTS, i, 0)
    for row in reverts:
        capacity[row] -= 1 + draft_len[row] + slack[row] - _released_behind(behind_draft[row],
                                                                             policy)
        if behind[row]:  # the step behind (its forward ran) is the pending one again
            draft_len[row], slack[row] = behind_draft[row], behind_slack[row]
            behind[row] = False
            behind_draft[row] = behind_slack[row] = 0
        else:
            pending[row] = ahead[row] = False
            slack[row] = draft_len[row] = 0
    i = _first_marked(results, pending, False)
    if i >= 0:
        return _fail(error, codes.NO_PENDING_GRANT, codes.RESULTS, i, 0)
    for i in range(results.size):
        row = results[i]
        drafts = behind_draft[row] if behind[row] else draft_len[row]
        if accepted[i] > drafts:
            return _fail(error, codes.ACCEPTED_EXCEEDS_DRAFTS, codes.ACCEPTED, i, drafts)
    for i in range(results.size):
        row, count = results[i], accepted[i]
        if behind[row]:  # `accounting.settle_behind`: the newer grant stays pending
            capacity[row], history[row] = _settle_behind(
                capacity[row], history[row], behind_draft[row], behind_slack[row], count, policy)
            behind[row] = False
            behind_draft[row] = behind_slack[row] = 0
        else:  # `accounting.settle`
            new_history = history[row] + 1 + count
            reclaimed = slack[row] if policy == RECLAIM else 0
            capacity[row] = max(capacity[row] - (draft_len[row] - count) - reclaimed,
                                new_history)
            history[row] = new_history
            pending[row] = ahead[row] = False
            slack[row] = draft_len[row] = 0
        lead[row] = count
    return None


def _copy_settled(destination: Settled | Rows, source: Settled | Rows) -> None:
    """`Settled`'s fields from ``source`` to ``destination``."""
    _copy_into(destination.capacity, source.capacity)
    _copy_into(destination.history, source.history)
    _copy_into(destination.slack, source.slack)
    _copy_into(destination.draft_len, source.draft_len)
    _copy_into(destination.pending, source.pending)
    _copy_into(destination.lead, source.lead)
    _copy_into(destination.ahead, source.ahead)
    _copy_into(destination.behind, source.behind)
    _copy_into(destination.behind_draft, source.behind_draft)
    _copy_into(destination.behind_slack, source.behind_slack)


def _copy_into(destination: np.ndarray, source: np.ndarray) -> None:
    """``destination[:] = source`` for arrays of one length (as a loop: numba's slice assignment
    brings a shape check whose error message alone takes seconds to compile)."""
    for i in range(source.size):
        destination[i] = source[i]


# ---------------------------------------------------------------------- 3. grants and prefill

def plan_grants(plan: Plan, lag: int, state: State, settled: Settled, scratch: Scratch,
                error: np.ndarray) -> Demand:
    """`reference.plan_grants`; the `Demand`'s arrays are ``scratch``'s (no item rows when it
    stopped the step)."""
    grants, draft_lens = plan.grant_rows, plan.draft_lens
    padding, padded = plan.padding_rows, plan.padded_draft_lens
    prompt_len, limits = state.rows.prompt_len, state.limits
    capacity, history, slack, draft_len = (settled.capacity, settled.history, settled.slack,
                                           settled.draft_len)
    pending, lead, ahead = settled.pending, settled.lead, settled.ahead
    items, is_new_grant = scratch.item_rows, scratch.is_new_grant
    wanted, target = scratch.wanted_draft, scratch.target_capacity
    stopped = Demand(items[:0], 0, is_new_grant, wanted, target)
    if not _grantable(grants, lag, pending, ahead, settled.behind, error):
        return stopped
    for i in range(grants.size):
        if history[grants[i]] < prompt_len[grants[i]]:
            _fail(error, codes.PREFILL_INCOMPLETE, codes.GRANTS, i, 0)
            return stopped
    is_new_grant[:] = False
    for row in padding:  # `wanted` is read at padding and grant rows only
        wanted[row] = draft_len[row]
    for i in range(grants.size):
        is_new_grant[grants[i]] = True
        wanted[grants[i]] = draft_lens[i]
    for i in range(padding.size):
        if not (pending[padding[i]] or is_new_grant[padding[i]]):
            _fail(error, codes.NO_PENDING_GRANT, codes.PADDING, i, 0)
            return stopped
    for i in range(padding.size):
        if padded[i] < wanted[padding[i]]:
            _fail(error, codes.PADDING_BELOW_DRAFT, codes.PADDED, i, wanted[padding[i]])
            return stopped
    # Padding of grants made in earlier calls cannot be refused (the forward is already
    # planned), so it is served before this step's new grants.
    num_topups = 0
    for i in range(padding.size):
        wanted[padding[i]] = padded[i]
        if not is_new_grant[padding[i]]:
            items[num_topups] = padding[i]
            num_topups += 1
    for i in range(grants.size):
        items[num_topups + i] = grants[i]
    for row in items[: num_topups + grants.size]:
        at_lag2 = lag == 2 if is_new_grant[row] else ahead[row]
        new_slack = _grant_slack(wanted[row], at_lag2, lead[row], limits.overlap, limits.policy)
        if is_new_grant[row]:
            released = _released_behind(draft_len[row], limits.policy) if pending[row] else 0
            added = 1 + wanted[row] + new_slack - released
        else:
            added = (wanted[row] - draft_len[row]) + (new_slack - slack[row])
        target[row] = max(capacity[row] + added, history[row])
    return Demand(items[: num_topups + grants.size], num_topups, is_new_grant, wanted, target)


def _grantable(grants: np.ndarray, lag: int, pending: np.ndarray, ahead: np.ndarray,
               behind: np.ndarray, error: np.ndarray) -> bool:
    """`reference._check_grantable`: False, with ``error`` set, when a grant is not allowed."""
    if lag == 1:
        i = _first_marked(grants, pending, True)
        if i >= 0:
            _fail(error, codes.GRANT_PENDING, codes.GRANTS, i, 0)
            return False
        return True
    i = _first_marked(grants, behind, True)
    if i >= 0:
        _fail(error, codes.TWO_UNSETTLED, codes.GRANTS, i, 0)
        return False
    for i in range(grants.size):
        if pending[grants[i]] and not ahead[grants[i]]:
            _fail(error, codes.LAG1_PENDING, codes.GRANTS, i, 0)
            return False
    return True


def _grant_slack(draft: int, at_lag2: bool, lead: int, overlap: bool, policy: int) -> int:
    """`reference.grant_slack` for one grant."""
    if at_lag2:
        return _lag2_slack(draft, policy)
    return _slack_for(draft, lead, overlap, policy)


def plan_prefill(plan: Plan, state: State, settled: Settled, demand: Demand,
                 error: np.ndarray) -> None:
    rows, tokens = plan.prefill_rows, plan.prefill_tokens
    prompt_len, target = state.rows.prompt_len, demand.target_capacity
    capacity, history = settled.capacity, settled.history
    for i in range(rows.size):
        row = rows[i]
        if history[row] + tokens[i] > prompt_len[row]:
            return _fail(error, codes.PREFILL_PAST_PROMPT, codes.CHUNK_TOKENS, i, prompt_len[row])
        target[row] = capacity[row] + tokens[i]
    return None


# ---------------------------------------------------------------------- 4. blocks and rows

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
    _copy_into(grow_rows[items.size :], chunks)
    served = Served(scratch.item_ok[: grow_rows.size], np.zeros(grants.size, dtype=np.bool_),
                    np.zeros(chunks.size, dtype=np.bool_),
                    np.zeros(prompt_lens.size, dtype=np.int8),
                    np.empty(grants.size, dtype=np.int64), np.empty(chunks.size, dtype=np.int64))
    item_ok, granted, prefill_ok, refusals, grant_starts, prefill_starts = served
    for row in grow_rows:
        if _blocks_for(target[row], tpb) > max_blocks:
            _fail(error, codes.ROW_OVERFLOW, codes.GRANTS, row, max_blocks)
            return served
    available = free_blocks + _released(num_blocks, cached, capacity, finished, tpb)
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
            _fail(error, codes.OUT_OF_BLOCKS, codes.GRANTS, items[k], available)
            return served
    for i in range(grants.size):
        granted[i] = item_ok[num_topups + i]
        grant_starts[i] = history[grants[i]] + (1 if pending[grants[i]] else 0)
    for i in range(chunks.size):
        prefill_ok[i] = item_ok[items.size + i]
        prefill_starts[i] = history[chunks[i]]
    return served


def _released(num_blocks: np.ndarray, cached: np.ndarray, capacity: np.ndarray,
              finished: np.ndarray, tokens_per_block: int) -> int:
    """Blocks the settled ``capacity`` frees: finished rows all theirs but their cached blocks
    (those are parked, not free, until evicted)."""
    released = 0
    for row in range(num_blocks.size):
        released += num_blocks[row] - _blocks_for(capacity[row], tokens_per_block)
    for row in finished:
        released += _blocks_for(capacity[row], tokens_per_block) - cached[row]
    return released


def admitted_tokens(prompt_len: int, first_chunk: int, cached_tokens: int) -> int:
    """`reference.admitted_tokens` for one request."""
    rest = prompt_len - cached_tokens
    return cached_tokens + (rest if first_chunk == 0 else min(first_chunk, rest))


def serve_hits_in_order(prompt_lens: np.ndarray, first_chunks: np.ndarray, hits: HitArrays,
                        refcounts: np.ndarray, tokens_per_block: int, available: int,
                        claimed: np.ndarray, refusals: np.ndarray) -> None:
    """`reference.serve_hits_in_order` (with no hits, `serve_in_order`) for the new requests:
    those not served are refused (``refusals``) for want of blocks."""
    counts, blocks = hits
    left = available
    start = 0
    for i in range(prompt_lens.size):
        tokens = admitted_tokens(prompt_lens[i], first_chunks[i], counts[i] * tokens_per_block)
        need = _blocks_for(tokens, tokens_per_block) - counts[i]
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


def serve_in_order(grow_rows: np.ndarray, target: np.ndarray, capacity: np.ndarray,
                   tokens_per_block: int, available: int, ok: np.ndarray) -> int:
    """`reference.serve_in_order` for the rows that grow from ``capacity`` to ``target``: which
    of them get their blocks (``ok``) when served in order, each one only if it still fits.
    Returns the blocks left."""
    left = available
    for k in range(grow_rows.size):
        row = grow_rows[k]
        need = (_blocks_for(target[row], tokens_per_block)
                - _blocks_for(capacity[row], tokens_per_block))
        ok[k] = need <= left
        if ok[k]:
            left -= need
    return left


# ---------------------------------------------------------------------- 5. replace_state

def replace_state(plan: Plan, lag: int, state: State, settled: Settled, demand: Demand,
                  served: Served, deltas: np.ndarray) -> None:
    """The settled and granted state replaces the row state; fills the counter deltas."""
    results, accepted = plan.result_rows, plan.num_accepted
    chunks, tokens = plan.prefill_rows, plan.prefill_tokens
    num_reverts, num_grants, num_padding = (plan.revert_rows.size, plan.grant_rows.size,
                                            plan.padding_rows.size)
    overlap, policy = state.limits.overlap, state.limits.policy
    rows = state.rows
    capacity, history, slack, draft_len = rows.capacity, rows.history, rows.slack, rows.draft_len
    pending, lead = rows.pending, rows.lead
    items, is_new_grant = demand.item_rows, demand.is_new_grant
    wanted, target = demand.wanted_draft, demand.target_capacity
    item_ok, prefill_ok = served.item_ok, served.prefill_ok
    deltas[:] = 0
    was_behind, was_behind_draft, was_behind_slack = (rows.behind, rows.behind_draft,
                                                      rows.behind_slack)
    for i in range(results.size):  # what they settled: the step behind, where there was one
        row = results[i]
        older = was_behind[row]
        deltas[COUNT_REWOUND] += (was_behind_draft[row] if older else draft_len[row]) - accepted[i]
        if policy == RECLAIM:
            deltas[COUNT_RECLAIMED] += was_behind_slack[row] if older else slack[row]
    deltas[COUNT_REVERTS] = num_reverts
    deltas[COUNT_UPDATES] = results.size
    deltas[COUNT_TOPUPS] = num_padding
    _copy_settled(rows, settled)
    ahead, behind, behind_draft, behind_slack = (rows.ahead, rows.behind, rows.behind_draft,
                                                 rows.behind_slack)
    for k in range(items.size):
        if item_ok[k]:
            row = items[k]
            if is_new_grant[row]:  # a step it found unsettled goes behind it
                if pending[row]:
                    behind[row] = True
                    behind_draft[row], behind_slack[row] = draft_len[row], slack[row]
                ahead[row] = lag == 2
                deltas[COUNT_GRANTS] += 1
            capacity[row] = target[row]
            slack[row] = _grant_slack(wanted[row], ahead[row], lead[row], overlap, policy)
            draft_len[row] = wanted[row]
            pending[row] = True
    deltas[COUNT_REFUSED] = num_grants - deltas[COUNT_GRANTS]
    for i in range(chunks.size):
        if prefill_ok[i]:
            capacity[chunks[i]] += tokens[i]
            history[chunks[i]] += tokens[i]


# ---------------------------------------------------------------------- 6. blocks follow

def move_blocks(plan: Plan, state: State, served: Served, hits: HitArrays,
                scratch: Scratch) -> tuple:
    """New requests take their cached blocks; every row's blocks follow
    ceil(capacity / tokens_per_block): finished rows' cached blocks are parked (in the plan's
    order), then all shrinks (blocks pushed on the free stack), then all growth (blocks taken);
    finished rows are reset and go back to the free rows; admitted requests take rows and their
    first blocks. Returns the outcome's arrays."""
    finished, prompt_lens, first_chunks = plan.finished_rows, plan.prompt_lens, plan.first_chunks
    rows, pool, table, tops = state.rows, state.pool, state.table, state.tops
    tpb, capacity, num_blocks, cached = (state.limits.tokens_per_block, rows.capacity,
                                         rows.num_blocks, rows.cached)
    host, free_rows = table.host, table.free_rows
    rewritten, old_blocks, evicted = scratch.rewritten, scratch.old_blocks, scratch.evicted
    granted, prefill_ok, refusals, grant_starts, prefill_starts = (
        served.granted, served.prefill_ok, served.refusals, served.grant_starts,
        served.prefill_starts)
    _take_hits(refusals, hits, pool)
    rewritten[:] = False  # freed or admitted: from column 0
    for row in finished:
        rewritten[row] = True
        _park_prefix(pool, host, row, min(cached[row], num_blocks[row]))
    for row in range(num_blocks.size):
        old_blocks[row] = num_blocks[row]
        target = 0 if rewritten[row] else _blocks_for(capacity[row], tpb)
        if target < num_blocks[row]:
            _truncate(pool, tops, host, row, max(target, cached[row]), num_blocks[row])
            num_blocks[row] = target
    tops[NUM_EVICTED] = 0
    for row in range(num_blocks.size):
        target = 0 if rewritten[row] else _blocks_for(capacity[row], tpb)
        if target > num_blocks[row]:
            _take(pool, tops, evicted, host, row, num_blocks[row], target)
            num_blocks[row] = target
    for row in finished:
        _reset(rows, row)
        free_rows[tops[NUM_FREE_ROWS]] = row
        tops[NUM_FREE_ROWS] += 1
    admitted_rows, cached_tokens = _admit(prompt_lens, first_chunks, refusals, hits, rows, pool,
                                          host, free_rows, tops, tpb, rewritten, evicted)
    changed_rows, changed_from, changed_blocks, changed_ids, changed_cells = _changes(
        num_blocks, old_blocks, rewritten, host)
    return (granted, prefill_ok, admitted_rows, refusals, grant_starts, prefill_starts,
            changed_rows, changed_from, changed_blocks, changed_ids, changed_cells, cached_tokens)


def _take_hits(refusals: np.ndarray, hits: HitArrays, pool: Pool) -> None:
    """Each admitted request takes a reference on its cached blocks, out of the LRU list if
    parked."""
    counts, blocks = hits
    refcounts = pool.refcounts
    start = 0
    for i in range(refusals.size):
        if refusals[i] == 0:
            for block in blocks[start : start + counts[i]]:
                if refcounts[block] == 0:
                    _unpark(block, pool)
                refcounts[block] += 1
        start += counts[i]


def _park_prefix(pool: Pool, host: np.ndarray, row: int, cached: int) -> None:
    """Release a finished row's ``cached`` columns, last first: a block nobody else holds is
    parked at the LRU tail (so a prefix's end is evicted before its start)."""
    for column in range(cached - 1, -1, -1):
        block = _release(host, row, column, pool.refcounts)
        if block >= 0:
            _park(block, pool)


def _truncate(pool: Pool, tops: np.ndarray, host: np.ndarray, row: int, start: int,
              end: int) -> None:
    """Columns ``start`` to ``end`` of ``row`` emptied (`BlockTable.truncate`) and their blocks
    released, one nobody else holds onto the free stack (`BlockPool.release_unique`)."""
    free_stack, refcounts = pool.free_stack, pool.refcounts
    for column in range(start, end):
        block = _release(host, row, column, refcounts)
        if block >= 0:
            free_stack[tops[NUM_FREE]] = block
            tops[NUM_FREE] += 1


def _release(host: np.ndarray, row: int, column: int, refcounts: np.ndarray) -> int:
    """Empty one cell of the table; returns its block if nobody holds it any more, else -1."""
    block = host[row, column]
    host[row, column] = -1
    refcounts[block] -= 1
    return block if refcounts[block] == 0 else -1


def _take(pool: Pool, tops: np.ndarray, evicted: np.ndarray, host: np.ndarray, row: int,
          start: int, end: int) -> None:
    """`reference._take` into columns ``start`` to ``end`` of ``row``: blocks with refcount 1 off
    the free stack; when the stack is empty, the LRU head is evicted onto it first (and recorded
    in ``evicted``)."""
    free_stack, refcounts = pool.free_stack, pool.refcounts
    for column in range(start, end):
        if tops[NUM_FREE] == 0:
            block = pool.lru[LRU_HEAD]
            _unpark(block, pool)
            free_stack[0] = block
            evicted[tops[NUM_EVICTED]] = block
            tops[NUM_EVICTED] += 1
            tops[NUM_FREE] = 1
        tops[NUM_FREE] -= 1
        block = free_stack[tops[NUM_FREE]]
        refcounts[block] = 1
        host[row, column] = block


def _unpark(block: int, pool: Pool) -> None:
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


def _park(block: int, pool: Pool) -> None:
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


def _reset(rows: Rows, row: int) -> None:
    """`RowState.reset` (``num_blocks`` is 0 already)."""
    rows.live[row] = False
    rows.capacity[row] = rows.history[row] = rows.prompt_len[row] = 0
    rows.slack[row] = rows.draft_len[row] = rows.lead[row] = rows.cached[row] = 0
    rows.behind_draft[row] = rows.behind_slack[row] = 0
    rows.pending[row] = rows.ahead[row] = rows.behind[row] = False


def _admit(prompt_lens: np.ndarray, first_chunks: np.ndarray, refusals: np.ndarray,
           hits: HitArrays, rows: Rows, pool: Pool, host: np.ndarray, free_rows: np.ndarray,
           tops: np.ndarray, tpb: int, rewritten: np.ndarray,
           evicted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each admitted request (refusal 0) takes a free row, its cached blocks, then fresh ones.
    Returns the admitted rows (-1: refused) and cached tokens, one per new request."""
    counts, blocks = hits
    admitted_rows = np.full(prompt_lens.size, -1, dtype=np.int64)
    cached_tokens = np.zeros(prompt_lens.size, dtype=np.int64)
    end = 0
    for i in range(prompt_lens.size):
        cached = counts[i]
        start, end = end, end + cached
        if refusals[i] != 0:
            continue
        tops[NUM_FREE_ROWS] -= 1
        row = free_rows[tops[NUM_FREE_ROWS]]
        tokens = admitted_tokens(prompt_lens[i], first_chunks[i], cached * tpb)
        n = _blocks_for(tokens, tpb)
        for column in range(cached):
            host[row, column] = blocks[start + column]
        _take(pool, tops, evicted, host, row, cached, n)
        rows.live[row] = True
        rows.capacity[row] = rows.history[row] = tokens
        rows.prompt_len[row] = prompt_lens[i]
        rows.num_blocks[row] = n
        rows.cached[row] = cached
        cached_tokens[i] = cached * tpb
        rewritten[row] = True
        admitted_rows[i] = row
    return admitted_rows, cached_tokens


def _changes(num_blocks: np.ndarray, old_blocks: np.ndarray, rewritten: np.ndarray,
             host: np.ndarray) -> tuple:
    """Every row whose cells changed (`StepOutcome`'s ``changed_*``: rows, first column, block
    count, ids), and those cells as flat indices into the table."""
    num_changed = num_ids = num_cells = 0
    for row in range(num_blocks.size):
        if rewritten[row] or num_blocks[row] != old_blocks[row]:
            start = 0 if rewritten[row] else min(old_blocks[row], num_blocks[row])
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
        if rewritten[row] or num_blocks[row] != old_blocks[row]:
            start = 0 if rewritten[row] else min(old_blocks[row], num_blocks[row])
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


if numba is not None:
    # All are inlined into `_step`. Those called with constants (`_fail`'s codes, `_first_marked`'s
    # value) or with arrays of two types (`_copy_into`) must be: compiled on their own, they would
    # be compiled again for each. The rest are too: the step runs a few per cent faster so
    # (benchmarks/bench_step.py) and compiles no slower. Inlined, a tuple argument that stays
    # alive across a loop costs a reference count taken and dropped per array in it: so each
    # function takes the arrays it uses from its tuples at its top, and the helpers called per
    # row take arrays, not `State`.
    _fail = jit(_fail, inline="always")
    _first_marked = jit(_first_marked, inline="always")
    _copy_settled = jit(_copy_settled, inline="always")
    _copy_into = jit(_copy_into, inline="always")
    _first_unknown = jit(_first_unknown, inline="always")
    _first_repeat = jit(_first_repeat, inline="always")
    _first_outside = jit(_first_outside, inline="always")
    _first_listed = jit(_first_listed, inline="always")
    validate = jit(validate, inline="always")
    settle_step = jit(settle_step, inline="always")
    plan_grants = jit(plan_grants, inline="always")
    plan_prefill = jit(plan_prefill, inline="always")
    _slack_for = jit(_slack_for, inline="always")
    _lag2_slack = jit(_lag2_slack, inline="always")
    _released_behind = jit(_released_behind, inline="always")
    _settle_behind = jit(_settle_behind, inline="always")
    _grantable = jit(_grantable, inline="always")
    _grant_slack = jit(_grant_slack, inline="always")
    _first_reverted_alone = jit(_first_reverted_alone, inline="always")
    serve_blocks = jit(serve_blocks, inline="always")
    _released = jit(_released, inline="always")
    admitted_tokens = jit(admitted_tokens, inline="always")
    serve_hits_in_order = jit(serve_hits_in_order, inline="always")
    serve_in_order = jit(serve_in_order, inline="always")
    _blocks_for = jit(_blocks_for, inline="always")
    replace_state = jit(replace_state, inline="always")
    move_blocks = jit(move_blocks, inline="always")
    _take_hits = jit(_take_hits, inline="always")
    _park_prefix = jit(_park_prefix, inline="always")
    _truncate = jit(_truncate, inline="always")
    _release = jit(_release, inline="always")
    _take = jit(_take, inline="always")
    _unpark = jit(_unpark, inline="always")
    _park = jit(_park, inline="always")
    _reset = jit(_reset, inline="always")
    _admit = jit(_admit, inline="always")
    _changes = jit(_changes, inline="always")
    _no_outcome = jit(_no_outcome, inline="always")
    _step = jit(_step)

_plan_lists = len(Plan._fields)
_row_arrays = attrgetter(*Rows._fields)
_pool_arrays = attrgetter(*Pool._fields)
_table_arrays = attrgetter(*Table._fields)


class CompiledStep:
    """The compiled step over one manager's `CapacityState`, with its scratch arrays."""

    def __init__(self, state: CapacityState) -> None:
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
                               evicted=counts(blocks))
        self.scratch_arrays = tuple(self.scratch)
        self.tops = np.zeros(3, dtype=np.int64)
        self.no_hits = counts()

    def run(self, plan: PlanArrays, state: CapacityState, hits: Hits = NO_HITS) -> StepRun:
        rows, pool, table = state.rows, state.pool, state.table
        error = np.zeros(codes.ERROR_SLOTS, dtype=np.int64)
        deltas = np.zeros(len(COUNTER_NAMES), dtype=np.int64)
        self.tops[NUM_FREE] = pool.num_free
        self.tops[NUM_FREE_ROWS] = table.num_free_rows
        num_new = plan.prompt_lens.size
        hit_counts = hits.counts if hits.counts.size == num_new else self.no_hits[:num_new]
        step_state = (self.limits, _row_arrays(rows), _pool_arrays(pool), _table_arrays(table),
                      self.tops)
        (granted, chunk_ok, admitted_rows, refusals, grant_starts, chunk_starts, changed_rows,
         changed_from, changed_blocks, changed_ids, changed_cells, cached_tokens) = _step(
            plan[:_plan_lists], plan.strict_grants, plan.lag, step_state, (hit_counts, hits.blocks),
            self.settled, self.scratch_arrays, error, deltas)
        if error[0]:
            return StepRun(error)
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
