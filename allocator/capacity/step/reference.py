"""The batched step in numpy: the executable specification of what one step does.

`reference_step` applies a coerced plan to a `CapacityState` in named phases:

1. ``validate``: list by list in plan order, every row live and listed once and every count at
   least its least value (`codes.NAMES_ROWS`, ``LEAST_VALUE``); then the upper bounds; then
   no request in two lists that exclude each other;
2. ``settle``: reverts, then results, on copies of the row state (`Settled`);
3. ``plan_grants`` / ``plan_prefill``: the capacity each grant, padding and prefill chunk wants
   (`Demand`);
4. ``serve_blocks``: row overflow, then blocks served in order (rows whose results outgrew
   their blocks, then running requests, then prefill, then new requests), then rows for the new
   requests (`Served`); parked blocks (unowned cached content, `block_pool`) count as
   available, except those a new request reuses;

and only then, when nothing can fail any more,

5. ``replace_state``: the settled and granted state replaces the old one;
6. ``move_blocks``: new requests first take their cached prefix blocks (`Hits`), then every
   row's blocks follow its capacity (finished rows go back to the pool, their cached blocks to
   the LRU tail, the prefix's end first so that it is evicted first), then new requests are
   admitted. A block is taken from the free stack, or, when it is empty, evicted from the LRU
   head (the caller drops the evicted blocks' hashes: `StepRun.evicted`).

A phase that finds bad input stops the step with a ``[kind, subject, index, detail]`` error (see
`codes`) before any state changed. With ``apply=False`` the step stops after phase 4 either way:
it says whether the plan would run, changing nothing (`KVCacheManager.step_arrays`).
`step.compiled` is the same step compiled, phase for phase; the two are tested against each other
on random plans.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NoReturn

import numpy as np
from kvalloc.allocator.capacity.accounting import (
    blocks_for,
    lag2_slack,
    released_behind,
    revert,
    settle,
    settle_behind,
    slack_for,
)
from kvalloc.allocator.capacity.block_pool import BlockPool
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.allocator.capacity.state import (
    COUNTER_INDEX,
    COUNTER_NAMES,
    POLICY_CODES,
    CapacityState,
    RowState,
    StepLimits,
)
from kvalloc.allocator.capacity.step import codes
from kvalloc.allocator.capacity.step.plan import (
    REFUSED_BATCH_FULL,
    REFUSED_OUT_OF_BLOCKS,
    PlanArrays,
    StepOutcome,
)
from kvalloc.allocator.config import SlackPolicy


@dataclass
class StepRun:
    """One run of the step over a plan (the reference's or the compiled one's): ``error[0] != 0``
    (and nothing changed), or its outcome and the counter deltas (one per `ManagerCounters`
    field)."""

    error: np.ndarray
    outcome: StepOutcome | None = None
    counter_deltas: np.ndarray | None = None
    evicted: np.ndarray | None = None  # int64: parked blocks this step evicted, in order


@dataclass(frozen=True)
class Hits:
    """Cached prefix blocks each new request reuses (looked up by the caller before the step):
    ``counts`` per new request, their ids concatenated in ``blocks``; ``released`` per new
    request: the leading columns before them that its row starts with `RELEASED` (a windowed
    group's hit needs no block behind its window, `prefix_cache`; None: none). A hit covers
    ``released + counts`` columns."""

    counts: np.ndarray
    blocks: np.ndarray
    released: np.ndarray | None = None

    def leading(self) -> np.ndarray:
        """Per new request: the columns its hit covers, released ones included."""
        return self.counts if self.released is None else self.counts + self.released


NO_HITS = Hits(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


class _Failed(Exception):
    def __init__(self, kind: int, subject: int, index: int, detail: int = 0) -> None:
        super().__init__(kind)
        self.error = np.array([kind, subject, index, detail], dtype=np.int64)


def _fail(kind: int, subject: int, index: int, detail: int = 0) -> NoReturn:
    raise _Failed(kind, subject, int(index), int(detail))


@dataclass
class Settled:
    """Row state after this step's reverts and results (copies; the state itself is untouched)."""

    capacity: np.ndarray
    history: np.ndarray
    slack: np.ndarray
    draft_len: np.ndarray
    pending: np.ndarray
    lead: np.ndarray
    ahead: np.ndarray
    behind: np.ndarray
    behind_draft: np.ndarray
    behind_slack: np.ndarray


@dataclass
class Demand:
    """What this step's grants, padding and prefill chunks ask for."""

    item_rows: np.ndarray  # padding of earlier grants (top-ups), then this step's grants
    num_topups: int
    is_new_grant: np.ndarray  # bool per row
    wanted_draft: np.ndarray  # per row: D after this step's grants and padding
    target_capacity: np.ndarray  # per row: capacity if every item and chunk is served


@dataclass
class Served:
    item_ok: np.ndarray
    granted: np.ndarray  # this step's grants' part of item_ok
    prefill_ok: np.ndarray
    admitted: np.ndarray  # bool per new request
    refusals: np.ndarray  # int8 per new request
    first_tokens: np.ndarray  # per new request: tokens its admission reserves (hits included)
    hit_counts: np.ndarray  # per new request: cached blocks it reuses
    hit_columns: np.ndarray  # per new request: columns its hit covers (released ones too)
    grant_starts: np.ndarray  # per grant: `grant_starts`
    prefill_starts: np.ndarray  # per prefill chunk: history before it


def reference_step(plan: PlanArrays, state: CapacityState, hits: Hits = NO_HITS,
                   apply: bool = True) -> StepRun:
    if hits.counts.size != plan.prompt_lens.size:  # no lookups: no new request reuses a block
        hits = Hits(np.zeros(plan.prompt_lens.size, dtype=np.int64), NO_HITS.blocks)
    if hits.released is None:
        hits = Hits(hits.counts, hits.blocks, np.zeros_like(hits.counts))
    try:
        validate(plan, state)
        settled = settle_step(plan, state)
        demand = plan_grants(plan, state, settled)
        plan_prefill(plan, state, settled, demand)
        served = serve_blocks(plan, state, settled, demand, hits)
    except _Failed as failed:
        return StepRun(failed.error)
    if not apply:
        return StepRun(codes.no_error())
    deltas = replace_state(plan, state, settled, demand, served)
    evicted: list[int] = []
    outcome = move_blocks(plan, state, served, hits, evicted)
    deltas[COUNTER_INDEX["evicted_blocks"]] = len(evicted)
    deltas[COUNTER_INDEX["requests_added"]] = int(served.admitted.sum())
    deltas[COUNTER_INDEX["requests_refused"]] = int((~served.admitted).sum())
    deltas[COUNTER_INDEX["requests_freed"]] = plan.finished_rows.size
    return StepRun(codes.no_error(), outcome, deltas, np.array(evicted, dtype=np.int64))


# ---------------------------------------------------------------------- 1. validate

def validate(plan: PlanArrays, state: CapacityState) -> None:
    live, limits = state.rows.live, state.limits
    for subject, values in enumerate(plan[: len(codes.NAMES_ROWS)]):
        if codes.NAMES_ROWS[subject]:
            _check_rows(values, subject, live)
        else:
            _check_minimum(values, subject, codes.LEAST_VALUE[subject])
    _check_maximum(plan.draft_lens, codes.DRAFTS, limits.max_draft_len, codes.ABOVE_MAX_DRAFT)
    _check_maximum(plan.padded_draft_lens, codes.PADDED, limits.max_draft_len,
                   codes.ABOVE_MAX_DRAFT)
    _check_maximum(plan.prompt_lens, codes.PROMPTS, limits.max_seq_len, codes.PROMPT_TOO_LONG)
    _first_where(plan.first_chunks > plan.prompt_lens, codes.CHUNK_PAST_PROMPT,
                 codes.FIRST_CHUNKS)
    num_rows = live.size
    # A request with a step behind its pending grant may see both: results settle the older
    # step, the revert undoes the newer.
    single = plan.result_rows[~state.rows.behind[plan.result_rows]]
    _check_apart(single, codes.RESULTS, [plan.revert_rows], num_rows,
                 codes.REVERTED_AND_SETTLED, positions=np.flatnonzero(
                     ~state.rows.behind[plan.result_rows]))
    _check_apart(plan.finished_rows, codes.FINISHED,
                 [plan.grant_rows, plan.padding_rows, plan.prefill_rows], num_rows,
                 codes.FINISHED_AND_SCHEDULED)
    _check_apart(plan.prefill_rows, codes.GRANTS, [plan.grant_rows], num_rows,
                 codes.SCHEDULED_AND_PREFILLED)
    _check_apart(plan.prefill_rows, codes.PADDING, [plan.padding_rows], num_rows,
                 codes.SCHEDULED_AND_PREFILLED)


def _first_where(bad: np.ndarray, kind: int, subject: int, detail: int = 0) -> None:
    if bad.any():
        _fail(kind, subject, np.argmax(bad), detail)


def _check_rows(rows: np.ndarray, subject: int, live: np.ndarray) -> None:
    """Every row in range and live, then none listed twice."""
    if rows.size == 0:
        return
    in_range = (rows >= 0) & (rows < live.size)
    _first_where(~in_range, codes.UNKNOWN_ROW, subject)
    _first_where(~live[rows], codes.UNKNOWN_ROW, subject)
    if rows.size > 1:
        order = np.argsort(rows, kind="stable")
        repeats = order[1:][rows[order[1:]] == rows[order[:-1]]]
        if repeats.size:
            _fail(codes.DUPLICATE_ROW, subject, repeats.min())


def _check_minimum(values: np.ndarray, subject: int, minimum: int) -> None:
    if values.size:
        _first_where(values < minimum, codes.BELOW_MINIMUM, subject, minimum)


def _check_maximum(values: np.ndarray, subject: int, maximum: int, kind: int) -> None:
    if values.size:
        _first_where(values > maximum, kind, subject, maximum)


def _check_apart(rows: np.ndarray, subject: int, others: list[np.ndarray], num_rows: int,
                 kind: int, positions: np.ndarray | None = None) -> None:
    """The first of ``rows`` that also appears in one of ``others`` fails the step (its index
    in the plan list: ``positions[i]`` when ``rows`` is a selection of that list)."""
    if rows.size == 0 or not any(o.size for o in others):
        return
    listed = np.zeros(num_rows, dtype=bool)
    for other in others:
        listed[other] = True
    bad = listed[rows]
    if bad.any():
        i = int(np.argmax(bad))
        _fail(kind, subject, i if positions is None else positions[i])


# ---------------------------------------------------------------------- 2. settle

def settle_step(plan: PlanArrays, state: CapacityState) -> Settled:
    s = Settled(*(getattr(state.rows, f.name).copy() for f in fields(Settled)))
    reverts = plan.revert_rows
    if reverts.size:
        _first_where(~s.pending[reverts], codes.NO_PENDING_GRANT, codes.REVERTS)
        s.capacity[reverts] = revert(s.capacity[reverts], s.history[reverts],
                                     s.draft_len[reverts], s.slack[reverts])
        _revert_to_behind(s, reverts)
    results, accepted = plan.result_rows, plan.num_accepted
    if results.size:
        _first_where(~s.pending[results], codes.NO_PENDING_GRANT, codes.RESULTS)
        behind = s.behind[results]  # after the reverts: a reverted row's older step is pending
        drafts = np.where(behind, s.behind_draft[results], s.draft_len[results])
        over = accepted > drafts
        if over.any():
            i = int(np.argmax(over))
            _fail(codes.ACCEPTED_EXCEEDS_DRAFTS, codes.ACCEPTED, i, drafts[i])
        _settle_single(s, results[~behind], accepted[~behind], state.limits.policy)
        _settle_behind(s, results[behind], accepted[behind], state.limits.policy)
    return s


def _revert_to_behind(s: Settled, rows: np.ndarray) -> None:
    """The newest grant is gone; a step behind it (its forward ran) is the pending one again."""
    behind = rows[s.behind[rows]]
    s.pending[rows] = s.ahead[rows] = False
    s.slack[rows] = s.draft_len[rows] = 0
    s.pending[behind] = s.ahead[behind] = True
    s.draft_len[behind], s.slack[behind] = s.behind_draft[behind], s.behind_slack[behind]
    s.behind[behind] = False
    s.behind_draft[behind] = s.behind_slack[behind] = 0


def _settle_single(s: Settled, rows: np.ndarray, accepted: np.ndarray,
                   policy: SlackPolicy) -> None:
    s.capacity[rows], s.history[rows] = settle(s.capacity[rows], s.history[rows],
                                               s.draft_len[rows], s.slack[rows], accepted, policy)
    s.pending[rows] = s.ahead[rows] = False
    s.lead[rows] = accepted
    s.slack[rows] = s.draft_len[rows] = 0


def _settle_behind(s: Settled, rows: np.ndarray, accepted: np.ndarray,
                   policy: SlackPolicy) -> None:
    """The older of two unsettled steps settles; the newer grant stays pending."""
    s.capacity[rows], s.history[rows] = settle_behind(
        s.capacity[rows], s.history[rows], s.behind_draft[rows], s.behind_slack[rows], accepted,
        POLICY_CODES[policy])
    s.lead[rows] = accepted
    s.behind[rows] = False
    s.behind_draft[rows] = s.behind_slack[rows] = 0


# ---------------------------------------------------------------------- 3. grants and prefill

def plan_grants(plan: PlanArrays, state: CapacityState, settled: Settled) -> Demand:
    limits = state.limits
    grants, padding = plan.grant_rows, plan.padding_rows
    if grants.size:
        _check_grantable(plan, settled)
        _first_where(settled.history[grants] < state.rows.prompt_len[grants],
                     codes.PREFILL_INCOMPLETE, codes.GRANTS)
    is_new_grant = np.zeros(limits.max_batch_size, dtype=bool)
    is_new_grant[grants] = True
    wanted = settled.draft_len.copy()
    wanted[grants] = plan.draft_lens
    if padding.size:
        _first_where(~(settled.pending[padding] | is_new_grant[padding]), codes.NO_PENDING_GRANT,
                     codes.PADDING)
        below = plan.padded_draft_lens < wanted[padding]
        if below.any():
            i = int(np.argmax(below))
            _fail(codes.PADDING_BELOW_DRAFT, codes.PADDED, i, wanted[padding[i]])
        wanted[padding] = plan.padded_draft_lens
    # Padding of grants made in earlier calls cannot be refused (the forward is already
    # planned), so it is served before this step's new grants.
    topups = padding[~is_new_grant[padding]]
    items = np.concatenate([topups, grants])
    target = settled.capacity.copy()
    if items.size:
        new = is_new_grant[items]
        ahead = np.where(new, plan.lag == 2, settled.ahead[items])
        draft = wanted[items]
        new_slack = grant_slack(draft, ahead, settled.lead[items], limits)
        added = np.where(new, 1 + draft + new_slack - released_behind(
            np.where(settled.pending[items], settled.draft_len[items], 0),
            POLICY_CODES[limits.policy]),
            (draft - settled.draft_len[items]) + (new_slack - settled.slack[items]))
        # Never below history: only `released_behind` (the crash policy) could go there.
        target[items] = np.maximum(settled.capacity[items] + added, settled.history[items])
    return Demand(items, topups.size, is_new_grant, wanted, target)


def _check_grantable(plan: PlanArrays, settled: Settled) -> None:
    """At lag 1 a grant needs the request's previous step settled; at lag 2 it may find one
    step unsettled, granted at lag 2 too (that step goes behind the new grant)."""
    grants = plan.grant_rows
    pending = settled.pending[grants]
    if plan.lag == 1:
        _first_where(pending, codes.GRANT_PENDING, codes.GRANTS)
        return
    _first_where(settled.behind[grants], codes.TWO_UNSETTLED, codes.GRANTS)
    _first_where(pending & ~settled.ahead[grants], codes.LAG1_PENDING, codes.GRANTS)


def grant_slack(draft: np.ndarray, ahead: np.ndarray, lead: np.ndarray,
                limits: StepLimits) -> np.ndarray:
    """The slack each grant records: `lag2_slack` for one made at lag 2, `slack_for` else."""
    return np.where(ahead, lag2_slack(draft, POLICY_CODES[limits.policy]),
                    slack_for(draft, limits.overlap, limits.policy, lead))


def plan_prefill(plan: PlanArrays, state: CapacityState, settled: Settled,
                 demand: Demand) -> None:
    rows, tokens = plan.prefill_rows, plan.prefill_tokens
    if rows.size == 0:
        return
    prompt = state.rows.prompt_len[rows]
    past = settled.history[rows] + tokens > prompt
    if past.any():
        i = int(np.argmax(past))
        _fail(codes.PREFILL_PAST_PROMPT, codes.CHUNK_TOKENS, i, prompt[i])
    demand.target_capacity[rows] = settled.capacity[rows] + tokens


# ---------------------------------------------------------------------- 4. blocks and rows

def serve_blocks(plan: PlanArrays, state: CapacityState, settled: Settled,
                 demand: Demand, hits: Hits) -> Served:
    limits = state.limits
    tpb = limits.tokens_per_block
    grow_rows = np.concatenate([demand.item_rows, plan.prefill_rows])
    grow_blocks = blocks_for(demand.target_capacity[grow_rows], tpb)
    over = grow_blocks > limits.max_blocks_per_seq
    if over.any():
        _fail(codes.ROW_OVERFLOW, codes.GRANTS, grow_rows[np.argmax(over)],
              limits.max_blocks_per_seq)

    # What the settled state frees (finished rows included, their cached blocks excepted: they
    # are parked, not free, until evicted), then each demand in order.
    finished = plan.finished_rows
    base_capacity = settled.capacity.copy()
    base_capacity[finished] = 0
    base_blocks = blocks_for(base_capacity, tpb)
    # A finished row frees its columns past both its cached ones and its released ones (a
    # windowed group's, which hold no block; a released column may be a cached one).
    kept = np.maximum(state.rows.cached[finished], state.rows.released[finished])
    released = int((state.rows.num_blocks - base_blocks).sum() - kept.sum())
    available = state.pool.num_free + state.pool.num_parked + released
    if available < 0:
        _fail_settled_growth(plan.result_rows, base_blocks, state.rows.num_blocks, available)
    hit_counts, hit_columns = hits.counts, hits.leading()
    first_tokens = admitted_tokens(plan.prompt_lens, plan.first_chunks, hit_columns * tpb)
    demands = grow_blocks - base_blocks[grow_rows]
    fresh = blocks_for(first_tokens, tpb) - hit_columns
    ok = serve_in_order(demands, available)
    left = available - int(demands[ok].sum())
    if hits.blocks.size:
        admitted = serve_hits_in_order(fresh, hits, state.pool.refcounts, left)
    else:
        admitted = serve_in_order(fresh, left)
    num_items = demand.item_rows.size
    item_ok = ok[:num_items]
    prefill_ok = ok[num_items:]
    refusals = np.where(admitted, 0, REFUSED_OUT_OF_BLOCKS).astype(np.int8)
    # Rows are the other resource: admit in order while rows last.
    free_rows = state.table.num_free_rows + plan.finished_rows.size
    if int(admitted.sum()) > free_rows:
        no_row = admitted & (np.cumsum(admitted) > free_rows)
        admitted = admitted & ~no_row
        refusals[no_row] = REFUSED_BATCH_FULL
    # Padding of an earlier grant, and strict grants, are not allowed to be refused.
    must = ~demand.is_new_grant[demand.item_rows] | plan.strict_grants
    refused = must & ~item_ok
    if refused.any():
        _fail(codes.OUT_OF_BLOCKS, codes.GRANTS, demand.item_rows[np.argmax(refused)], available)
    return Served(item_ok, item_ok[demand.num_topups :], prefill_ok, admitted, refusals,
                  first_tokens, np.where(admitted, hit_counts, 0),
                  np.where(admitted, hit_columns, 0),
                  grant_starts(plan.grant_rows, settled), settled.history[plan.prefill_rows])


def _fail_settled_growth(results: np.ndarray, base_blocks: np.ndarray, num_blocks: np.ndarray,
                         available: int) -> NoReturn:
    """Results that commit more tokens than their row holds blocks for (only under ``none`` at
    lag 2: the device kept drafts the host gave back, `accounting.released_behind`) grow the row
    before anything else is served; a pool that cannot cover them stops the step. Fails on the
    first such row, quoting the blocks there were before any row grew."""
    grows = base_blocks[results] > num_blocks[results]
    growth = int(np.maximum(base_blocks - num_blocks, 0).sum())
    _fail(codes.OUT_OF_BLOCKS, codes.RESULTS, results[np.argmax(grows)], available + growth)


def grant_starts(grants: np.ndarray, settled: Settled) -> np.ndarray:
    """Position of each grant's first token: the settled history, plus, behind an unsettled
    step, that step's one sure token (the device adds the drafts it accepts, which the host
    learns a call later)."""
    return settled.history[grants] + settled.pending[grants]


def admitted_tokens(prompt_lens: np.ndarray, first_chunks: np.ndarray,
                    cached_tokens: np.ndarray) -> np.ndarray:
    """Tokens an admission reserves: the cached prefix, then the first chunk past it (0: the
    rest of the prompt), never past the prompt."""
    rest = prompt_lens - cached_tokens
    return cached_tokens + np.where(first_chunks == 0, rest, np.minimum(first_chunks, rest))


def serve_hits_in_order(fresh: np.ndarray, hits: Hits, refcounts: np.ndarray,
                        available: int) -> np.ndarray:
    """`serve_in_order` for new requests that reuse cached blocks: a parked block a request
    takes back is no longer available to evict, so it costs one block, once, to the first
    request served that takes it."""
    ok = np.zeros(fresh.size, dtype=bool)
    claimed: set[int] = set()
    left = available
    ends = np.cumsum(hits.counts)
    for i, need in enumerate(fresh.tolist()):
        taken = hits.blocks[ends[i] - hits.counts[i] : ends[i]].tolist()
        parked = {b for b in taken if refcounts[b] == 0} - claimed
        if need + len(parked) <= left:
            ok[i] = True
            left -= need + len(parked)
            claimed |= parked
    return ok


def serve_in_order(demands: np.ndarray, available: int) -> np.ndarray:
    """Which demands are met when served in order, each one only if it still fits."""
    if int(demands.sum()) <= available:
        return np.ones(demands.size, dtype=bool)
    ok = np.zeros(demands.size, dtype=bool)
    left = available
    for i, need in enumerate(demands.tolist()):
        if need <= left:
            ok[i] = True
            left -= need
    return ok


# ---------------------------------------------------------------------- 5. replace_state

def replace_state(plan: PlanArrays, state: CapacityState, settled: Settled, demand: Demand,
                  served: Served) -> np.ndarray:
    """The settled and granted state replaces the row state; returns the counter deltas."""
    rows = state.rows
    granted = demand.item_rows[served.item_ok]
    _record_grants(plan, state.limits, settled, demand, granted)
    chunks = plan.prefill_rows[served.prefill_ok]
    tokens = plan.prefill_tokens[served.prefill_ok]
    settled.capacity[chunks] += tokens
    settled.history[chunks] += tokens

    deltas = np.zeros(len(COUNTER_NAMES), dtype=np.int64)
    results = plan.result_rows
    fresh = int(demand.is_new_grant[granted].sum())
    deltas[COUNTER_INDEX["reverts"]] = plan.revert_rows.size
    deltas[COUNTER_INDEX["updates"]] = results.size
    # What the results settled: the step behind the pending grant where there was one.
    drafts = np.where(rows.behind[results], rows.behind_draft[results], rows.draft_len[results])
    slack = np.where(rows.behind[results], rows.behind_slack[results], rows.slack[results])
    deltas[COUNTER_INDEX["rewound_tokens"]] = int((drafts - plan.num_accepted).sum())
    if state.limits.policy is SlackPolicy.RECLAIM:
        deltas[COUNTER_INDEX["reclaimed_slack_tokens"]] = int(slack.sum())
    deltas[COUNTER_INDEX["grants"]] = fresh
    deltas[COUNTER_INDEX["grants_refused"]] = plan.grant_rows.size - fresh
    deltas[COUNTER_INDEX["padding_topups"]] = plan.padding_rows.size

    for name in (f.name for f in fields(Settled)):
        np.copyto(getattr(rows, name), getattr(settled, name))
    return deltas


def _record_grants(plan: PlanArrays, limits: StepLimits, settled: Settled, demand: Demand,
                   granted: np.ndarray) -> None:
    """Served grants and top-ups become the pending grant; a lag-2 grant first moves the step it
    found unsettled behind itself."""
    behind = granted[demand.is_new_grant[granted] & settled.pending[granted]]
    settled.behind[behind] = True
    settled.behind_draft[behind] = settled.draft_len[behind]
    settled.behind_slack[behind] = settled.slack[behind]
    new = granted[demand.is_new_grant[granted]]
    settled.ahead[new] = plan.lag == 2
    settled.capacity[granted] = demand.target_capacity[granted]
    settled.slack[granted] = grant_slack(demand.wanted_draft[granted], settled.ahead[granted],
                                         settled.lead[granted], limits)
    settled.draft_len[granted] = demand.wanted_draft[granted]
    settled.pending[granted] = True


# ---------------------------------------------------------------------- 6. blocks follow

def move_blocks(plan: PlanArrays, state: CapacityState, served: Served, hits: Hits,
                evicted: list[int]) -> StepOutcome:
    """New requests take their cached blocks; every row's blocks follow
    ceil(capacity / tokens_per_block); finished rows go back to the pool (cached blocks parked);
    admitted requests take rows and their first blocks. Returns the outcome."""
    rows, pool, table = state.rows, state.pool, state.table
    tpb = state.limits.tokens_per_block
    finished = plan.finished_rows
    hit_starts = np.cumsum(hits.counts) - hits.counts
    for i in np.flatnonzero(served.hit_counts).tolist():
        for block in hits.blocks[hit_starts[i] : hit_starts[i] + served.hit_counts[i]].tolist():
            if pool.refcounts[block] == 0:
                pool.unpark(block)
            pool.refcounts[block] += 1
    old_blocks = rows.num_blocks.copy()
    target = blocks_for(rows.capacity, tpb)
    target[finished] = 0
    for row in finished[rows.cached[finished] > rows.released[finished]].tolist():
        _park_prefix(state, row)
    # Cached columns are parked above, never shrunk; released columns hold no block (a rewind
    # never reaches them: they lie behind history).
    start = np.maximum(np.maximum(target, rows.cached), rows.released)
    delta = target - old_blocks
    shrink = np.flatnonzero(start < old_blocks)
    if shrink.size:
        pool.release_unique(table.truncate(shrink, start[shrink],
                                           old_blocks[shrink] - start[shrink]))
    grow = np.flatnonzero(delta > 0)
    if grow.size:
        table.append(grow, old_blocks[grow], delta[grow],
                     _take(pool, int(delta[grow].sum()), evicted))
    rows.num_blocks[:] = target
    for row in finished.tolist():
        rows.reset(row)
        table.release_row(row)

    rewritten = np.zeros(rows.live.size, dtype=bool)  # freed or admitted: from column 0
    rewritten[finished] = True
    admitted_rows = _admit(plan, rows, state, served, hits.blocks, hit_starts, evicted)
    rewritten[admitted_rows[admitted_rows >= 0]] = True
    table.sync()

    new_blocks = rows.num_blocks
    changed = np.flatnonzero((new_blocks != old_blocks) | rewritten)
    starts = np.where(rewritten[changed], 0, np.minimum(old_blocks, new_blocks)[changed])
    counts = new_blocks[changed] - starts
    r = np.repeat(changed, counts)
    c = np.repeat(starts, counts) + np.arange(int(counts.sum())) - np.repeat(
        np.cumsum(counts) - counts, counts)
    return StepOutcome(
        granted=served.granted,
        prefill_granted=served.prefill_ok,
        admitted_rows=admitted_rows,
        new_refusals=served.refusals,
        grant_starts=served.grant_starts,
        prefill_starts=served.prefill_starts,
        changed_rows=changed,
        changed_from=starts,
        changed_num_blocks=new_blocks[changed],
        changed_block_ids=table.host[r, c],
        num_blocks=new_blocks.copy(),
        cached_tokens=served.hit_columns * tpb,
    )


def _park_prefix(state: CapacityState, row: int) -> None:
    """Release a finished row's cached columns that hold a block (those past its released
    ones), last first: a block nobody else holds is parked at the LRU tail (so a prefix's end is
    evicted before its start)."""
    pool, host = state.pool, state.table.host
    first, end = int(state.rows.released[row]), int(state.rows.cached[row])
    for column in range(end - 1, first - 1, -1):
        block = int(host[row, column])
        pool.refcounts[block] -= 1
        if pool.refcounts[block] == 0:
            pool.park(block)
    if end > first:
        state.table.truncate(np.array([row]), np.array([first]), np.array([end - first]))


def _take(pool: BlockPool, n: int, evicted: list[int]) -> np.ndarray:
    """``n`` blocks with refcount 1: from the free stack, then, one at a time, evicted from the
    LRU head."""
    taken = [pool.allocate(min(n, pool.num_free))]
    for _ in range(n - taken[0].size):
        evicted.append(pool.evict_oldest())
        taken.append(pool.allocate(1))
    return np.concatenate(taken)


def _admit(plan: PlanArrays, rows: RowState, state: CapacityState, served: Served,
           hit_blocks: np.ndarray, hit_starts: np.ndarray, evicted: list[int]) -> np.ndarray:
    tpb = state.limits.tokens_per_block
    admitted_rows = np.full(plan.prompt_lens.size, -1, dtype=np.int64)
    for i in np.flatnonzero(served.admitted).tolist():
        row = state.table.acquire_row()
        tokens = int(served.first_tokens[i])
        n = int(blocks_for(tokens, tpb))
        held, columns = int(served.hit_counts[i]), int(served.hit_columns[i])
        ids = np.concatenate([np.full(columns - held, RELEASED, dtype=np.int64),
                              hit_blocks[hit_starts[i] : hit_starts[i] + held],
                              _take(state.pool, n - columns, evicted)])
        state.table.append(np.array([row]), np.array([0]), np.array([n]), ids)
        rows.live[row] = True
        rows.capacity[row] = rows.history[row] = tokens
        rows.prompt_len[row] = plan.prompt_lens[i]
        rows.num_blocks[row] = n
        rows.cached[row] = columns
        rows.released[row] = columns - held
        admitted_rows[i] = row
    return admitted_rows
