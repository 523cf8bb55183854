"""The batched step as one compiled loop (numba), for the hot path.

`step_reference` is the specification; this is the same step written as plain loops over int64
arrays so that numba compiles it into one native routine: the same checks in the same order (so
the same error for the same bad plan), the same block moves in the same order (so the same block
ids, free stack and table cells), the same outcome and counter deltas. Tests run both on random
plans and compare every array of the state after each step.

Nothing is changed before every check has passed: the settled state is built in scratch arrays
and copied back only then. The routine reports bad input as ``[kind, subject, index, detail]``
(`step_errors`) and returns empty outputs.

numba caches the compiled routine on disk (``cache=True``, next to this file or, when that is
not writable, in numba's user cache directory; ``NUMBA_CACHE_DIR`` overrides both), so only the
first process on a machine pays the compile.
"""

from __future__ import annotations

import numpy as np

from allocator.capacity.state import COUNTER_INDEX, COUNTER_NAMES, POLICY_CODES, CapacityState
from allocator.capacity.step import codes
from allocator.capacity.step.plan import (
    REFUSED_BATCH_FULL,
    REFUSED_OUT_OF_BLOCKS,
    PlanArrays,
    StepOutcome,
)
from allocator.capacity.step.reference import NO_HITS, Hits, StepResult
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


def _fail(error, kind, subject, index, detail):
    error[0] = kind
    error[1] = subject
    error[2] = index
    error[3] = detail
    return True


def _first_unknown(rows, live):
    """Index of the first row that is out of range or not live, or -1."""
    for i in range(rows.size):
        if rows[i] < 0 or rows[i] >= live.size or not live[rows[i]]:
            return i
    return -1


def _first_repeat(rows, seen):
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


def _first_outside(values, least, most):
    """Index of the first value below ``least`` or above ``most``, or -1."""
    for i in range(values.size):
        if values[i] < least or values[i] > most:
            return i
    return -1


def _first_listed(rows, first, second, third, seen):
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


def _validate(plan, live, max_draft_len, max_seq_len, seen, error):
    (revert_rows, result_rows, _, finished_rows, grant_rows, draft_lens, padding_rows, padded,
     prefill_rows, _, prompt_lens, first_chunks) = plan
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
            (draft_lens, codes.DRAFTS, max_draft_len, codes.ABOVE_MAX_DRAFT),
            (padded, codes.PADDED, max_draft_len, codes.ABOVE_MAX_DRAFT),
            (prompt_lens, codes.PROMPTS, max_seq_len, codes.PROMPT_TOO_LONG)):
        i = _first_outside(values, -no_limit, most)
        if i >= 0:
            return _fail(error, kind, subject, i, most)
    for i in range(first_chunks.size):
        if first_chunks[i] > prompt_lens[i]:
            return _fail(error, codes.CHUNK_PAST_PROMPT, codes.FIRST_CHUNKS, i, 0)
    none = revert_rows[:0]
    for rows, subject, first, second, third, kind in (
            (result_rows, codes.RESULTS, revert_rows, none, none, codes.REVERTED_AND_SETTLED),
            (finished_rows, codes.FINISHED, grant_rows, padding_rows, prefill_rows,
             codes.FINISHED_AND_SCHEDULED),
            (prefill_rows, codes.GRANTS, grant_rows, none, none, codes.SCHEDULED_AND_PREFILLED),
            (prefill_rows, codes.PADDING, padding_rows, none, none,
             codes.SCHEDULED_AND_PREFILLED)):
        i = _first_listed(rows, first, second, third, seen)
        if i >= 0:
            return _fail(error, kind, subject, i, 0)
    return False


def _copy_into(destination, source):
    """``destination[:] = source`` for arrays of one length (as a loop: numba's slice assignment
    brings a shape check whose error message alone takes seconds to compile)."""
    for i in range(source.size):
        destination[i] = source[i]


def _slack_for(draft, lead, overlap, policy):
    if overlap and policy != NO_SLACK:
        return max(draft, lead)
    return 0


def _blocks_for(tokens, tokens_per_block):
    return -(-tokens // tokens_per_block)


def _unlink(block, lru_prev, lru_next, lru):
    """Take ``block`` out of the LRU list (``BlockPool.unpark``)."""
    before = lru_prev[block]
    after = lru_next[block]
    if before >= 0:
        lru_next[before] = after
    else:
        lru[0] = after
    if after >= 0:
        lru_prev[after] = before
    else:
        lru[1] = before
    lru_prev[block] = -1
    lru_next[block] = -1
    lru[2] -= 1


def _park(block, lru_prev, lru_next, lru):
    """Append ``block`` at the LRU tail (``BlockPool.park``)."""
    tail = lru[1]
    lru_prev[block] = tail
    lru_next[block] = -1
    if tail >= 0:
        lru_next[tail] = block
    else:
        lru[0] = block
    lru[1] = block
    lru[2] += 1


def _pop(free_stack, top, lru_prev, lru_next, lru, evicted, tops):
    """A block off the free stack (its new top is ``top - 1``); when the stack is empty, the LRU
    head is evicted onto it first and recorded in ``evicted[tops[2]]``."""
    if top == 0:
        block = lru[0]
        _unlink(block, lru_prev, lru_next, lru)
        free_stack[0] = block
        evicted[tops[2]] = block
        tops[2] += 1
        top = 1
    return free_stack[top - 1]


def _step(plan, strict, limits, overlap, counts, live, pending, free_stack, refcounts, host,
          free_rows, tops, lru_prev, lru_next, lru, hit_counts, hit_blocks, claimed, evicted,
          scratch, flags, items, item_ok, error, deltas):
    """One step. ``counts``: capacity, history, prompt_len, slack, draft_len, lead, num_blocks,
    cached (int64 per row); ``limits``: max_batch_size, tokens_per_block, max_blocks_per_seq,
    max_draft_len, max_seq_len, policy; ``tops``: free blocks, free rows, evicted blocks
    (updated); ``lru_*``: the pool's LRU list (updated); ``hit_counts`` (one per new request)
    and ``hit_blocks``: the cached blocks new requests reuse. Scratch: ``scratch`` int64
    [8, rows], ``flags`` bool [4, rows], ``items`` int64 and ``item_ok`` bool [rows] (top-ups,
    grants and prefill chunks name distinct rows), ``claimed`` bool [blocks] (all False on entry
    and on return), ``evicted`` int64 [blocks] (filled from ``tops[2]`` on)."""
    (revert_rows, result_rows, num_accepted, finished_rows, grant_rows, draft_lens, padding_rows,
     padded, prefill_rows, prefill_tokens, prompt_lens, first_chunks) = plan
    n, tpb, max_blocks, max_draft_len, max_seq_len, policy = limits
    capacity, history, prompt_len, slack, draft_len, lead, num_blocks, cached = counts
    flags[:] = False
    seen, is_new_grant, settled_pending, rewritten = flags[0], flags[1], flags[2], flags[3]
    settled_capacity, settled_history, settled_slack, settled_draft = (
        scratch[0], scratch[1], scratch[2], scratch[3])
    settled_lead, wanted, target, old_blocks = scratch[4], scratch[5], scratch[6], scratch[7]
    num_grants, num_chunks, num_new = grant_rows.size, prefill_rows.size, prompt_lens.size
    granted = np.zeros(num_grants, dtype=np.bool_)
    chunk_ok = np.zeros(num_chunks, dtype=np.bool_)
    admitted_rows = np.full(num_new, -1, dtype=np.int64)
    refusals = np.zeros(num_new, dtype=np.int8)
    grant_starts = np.empty(num_grants, dtype=np.int64)
    chunk_starts = np.empty(num_chunks, dtype=np.int64)
    cached_tokens = np.zeros(num_new, dtype=np.int64)
    nothing = np.empty(0, dtype=np.int64)
    failed = (granted, chunk_ok, admitted_rows, refusals, grant_starts, chunk_starts, nothing,
              nothing, nothing, np.empty(0, dtype=np.int32), nothing, cached_tokens)

    # ---- 1. validate
    if _validate(plan, live, max_draft_len, max_seq_len, seen, error):
        return failed

    # ---- 2. settle reverts and results (in scratch)
    # The settled copies of the counts, in the same order.
    settled = (settled_capacity, settled_history, settled_slack, settled_draft, settled_lead)
    current = (capacity, history, slack, draft_len, lead)
    for which in range(len(settled)):
        _copy_into(settled[which], current[which])
    _copy_into(settled_pending, pending)
    for i in range(revert_rows.size):
        if not settled_pending[revert_rows[i]]:
            _fail(error, codes.NO_PENDING_GRANT, codes.REVERTS, i, 0)
            return failed
    for row in revert_rows:
        settled_capacity[row] -= 1 + settled_draft[row] + settled_slack[row]
        settled_pending[row] = False
        settled_slack[row] = 0
        settled_draft[row] = 0
    for i in range(result_rows.size):
        if not settled_pending[result_rows[i]]:
            _fail(error, codes.NO_PENDING_GRANT, codes.RESULTS, i, 0)
            return failed
    for i in range(result_rows.size):
        drafts = settled_draft[result_rows[i]]
        if num_accepted[i] > drafts:
            _fail(error, codes.ACCEPTED_EXCEEDS_DRAFTS, codes.ACCEPTED, i, drafts)
            return failed
    for i in range(result_rows.size):
        row, accepted = result_rows[i], num_accepted[i]
        new_history = settled_history[row] + 1 + accepted
        reclaimed = settled_slack[row] if policy == RECLAIM else 0
        settled_capacity[row] = max(
            settled_capacity[row] - (settled_draft[row] - accepted) - reclaimed, new_history)
        settled_history[row] = new_history
        settled_pending[row] = False
        settled_lead[row] = accepted
        settled_slack[row] = 0
        settled_draft[row] = 0

    # ---- 3. grants, padding, prefill: the capacity each one wants
    for i in range(num_grants):
        if settled_pending[grant_rows[i]]:
            _fail(error, codes.GRANT_PENDING, codes.GRANTS, i, 0)
            return failed
    for i in range(num_grants):
        row = grant_rows[i]
        if settled_history[row] < prompt_len[row]:
            _fail(error, codes.PREFILL_INCOMPLETE, codes.GRANTS, i, 0)
            return failed
    for row in padding_rows:
        wanted[row] = settled_draft[row]
    for i in range(num_grants):
        is_new_grant[grant_rows[i]] = True
        wanted[grant_rows[i]] = draft_lens[i]
    for i in range(padding_rows.size):
        row = padding_rows[i]
        if not (settled_pending[row] or is_new_grant[row]):
            _fail(error, codes.NO_PENDING_GRANT, codes.PADDING, i, 0)
            return failed
    for i in range(padding_rows.size):
        if padded[i] < wanted[padding_rows[i]]:
            _fail(error, codes.PADDING_BELOW_DRAFT, codes.PADDED, i, wanted[padding_rows[i]])
            return failed
    num_items = 0
    for i in range(padding_rows.size):
        row = padding_rows[i]
        wanted[row] = padded[i]
        if not is_new_grant[row]:  # top-ups of earlier grants are served first
            items[num_items] = row
            num_items += 1
    num_topups = num_items
    for row in grant_rows:
        items[num_items] = row
        num_items += 1
    for k in range(num_items):
        row = items[k]
        new_slack = _slack_for(wanted[row], settled_lead[row], overlap, policy)
        if is_new_grant[row]:
            added = 1 + wanted[row] + new_slack
        else:
            added = (wanted[row] - settled_draft[row]) + (new_slack - settled_slack[row])
        target[row] = settled_capacity[row] + added
    for i in range(num_chunks):
        row = prefill_rows[i]
        if settled_history[row] + prefill_tokens[i] > prompt_len[row]:
            _fail(error, codes.PREFILL_PAST_PROMPT, codes.CHUNK_TOKENS, i, prompt_len[row])
            return failed
        target[row] = settled_capacity[row] + prefill_tokens[i]
    for i in range(num_chunks):  # rows are distinct across items and chunks: <= rows in all
        items[num_items + i] = prefill_rows[i]
    num_grown = num_items + num_chunks

    # ---- 4. blocks, served in order, then rows for the new requests
    for k in range(num_grown):
        row = items[k]
        if _blocks_for(target[row], tpb) > max_blocks:
            _fail(error, codes.ROW_OVERFLOW, codes.GRANTS, row, max_blocks)
            return failed
    for row in finished_rows:
        rewritten[row] = True  # finished rows free all their blocks (and may be rewritten)
    # Parked blocks count (they are evicted when the stack runs dry); a finished row's cached
    # blocks do not: they are parked only if nobody else holds them.
    available = tops[0] + lru[2]
    for row in range(n):
        if rewritten[row]:
            available += num_blocks[row] - cached[row]
        else:
            available += num_blocks[row] - _blocks_for(settled_capacity[row], tpb)
    left = available
    for k in range(num_grown):
        row = items[k]
        need = _blocks_for(target[row], tpb) - _blocks_for(settled_capacity[row], tpb)
        item_ok[k] = need <= left
        if item_ok[k]:
            left -= need
    start = 0
    for i in range(num_new):
        tokens = _admitted_tokens(prompt_lens[i], first_chunks[i], hit_counts[i] * tpb)
        need = _blocks_for(tokens, tpb) - hit_counts[i]
        for k in range(start, start + hit_counts[i]):  # parked blocks it takes back
            if refcounts[hit_blocks[k]] == 0 and not claimed[hit_blocks[k]]:
                need += 1
        if need <= left:
            left -= need
            for k in range(start, start + hit_counts[i]):
                claimed[hit_blocks[k]] = True
        else:
            refusals[i] = REFUSED_OUT_OF_BLOCKS
        start += hit_counts[i]
    for k in range(hit_blocks.size):
        claimed[hit_blocks[k]] = False
    rows_left = tops[1] + finished_rows.size
    for i in range(num_new):
        if refusals[i] == 0:
            if rows_left > 0:
                rows_left -= 1
            else:
                refusals[i] = REFUSED_BATCH_FULL
    for k in range(num_items):
        if (k < num_topups or strict) and not item_ok[k]:
            _fail(error, codes.OUT_OF_BLOCKS, codes.GRANTS, items[k], available)
            return failed

    # ---- validated: from here on nothing fails. 5. replace_state
    for i in range(num_grants):
        grant_starts[i] = settled_history[grant_rows[i]]
        granted[i] = item_ok[num_topups + i]
    for i in range(num_chunks):
        chunk_starts[i] = settled_history[prefill_rows[i]]
        chunk_ok[i] = item_ok[num_items + i]
    deltas[:] = 0
    for i in range(result_rows.size):
        deltas[COUNT_REWOUND] += draft_len[result_rows[i]] - num_accepted[i]
        if policy == RECLAIM:
            deltas[COUNT_RECLAIMED] += slack[result_rows[i]]
    deltas[COUNT_REVERTS] = revert_rows.size
    deltas[COUNT_UPDATES] = result_rows.size
    deltas[COUNT_TOPUPS] = padding_rows.size
    for which in range(len(settled)):
        _copy_into(current[which], settled[which])
    _copy_into(pending, settled_pending)
    for k in range(num_items):
        if item_ok[k]:
            row = items[k]
            capacity[row] = target[row]
            slack[row] = _slack_for(wanted[row], lead[row], overlap, policy)
            draft_len[row] = wanted[row]
            pending[row] = True
            if is_new_grant[row]:
                deltas[COUNT_GRANTS] += 1
    deltas[COUNT_REFUSED] = num_grants - deltas[COUNT_GRANTS]
    for i in range(num_chunks):
        if chunk_ok[i]:
            capacity[prefill_rows[i]] += prefill_tokens[i]
            history[prefill_rows[i]] += prefill_tokens[i]

    # ---- 6. admitted requests take their cached blocks; blocks follow capacity: finished rows'
    # cached blocks parked (last first), then all shrinks (LIFO pushes), then all growth (pops)
    start = 0
    for i in range(num_new):
        if refusals[i] == 0:
            for k in range(start, start + hit_counts[i]):
                block = hit_blocks[k]
                if refcounts[block] == 0:
                    _unlink(block, lru_prev, lru_next, lru)
                refcounts[block] += 1
        start += hit_counts[i]
    top = tops[0]
    tops[2] = 0
    for row in finished_rows:  # in the plan's order: it is the LRU order of their blocks
        for column in range(min(cached[row], num_blocks[row]) - 1, -1, -1):
            block = host[row, column]
            host[row, column] = -1
            refcounts[block] -= 1
            if refcounts[block] == 0:
                _park(block, lru_prev, lru_next, lru)
    for row in range(n):
        old_blocks[row] = num_blocks[row]
        new = 0 if rewritten[row] else _blocks_for(capacity[row], tpb)
        for column in range(max(new, cached[row]), num_blocks[row]):
            block = host[row, column]
            host[row, column] = -1
            refcounts[block] -= 1
            if refcounts[block] == 0:
                free_stack[top] = block
                top += 1
        num_blocks[row] = min(new, num_blocks[row])
    for row in range(n):
        new = 0 if rewritten[row] else _blocks_for(capacity[row], tpb)
        for column in range(num_blocks[row], new):
            block = _pop(free_stack, top, lru_prev, lru_next, lru, evicted, tops)
            top = max(top, 1) - 1
            host[row, column] = block
            refcounts[block] = 1
        num_blocks[row] = max(new, num_blocks[row])
    free_top = tops[1]
    for row in finished_rows:
        live[row] = False
        capacity[row] = history[row] = prompt_len[row] = 0
        slack[row] = draft_len[row] = lead[row] = cached[row] = 0
        pending[row] = False
        free_rows[free_top] = row
        free_top += 1
    admitted = 0
    start = 0
    for i in range(num_new):
        start += hit_counts[i]
        if refusals[i] != 0:
            continue
        free_top -= 1
        row = free_rows[free_top]
        tokens = _admitted_tokens(prompt_lens[i], first_chunks[i], hit_counts[i] * tpb)
        blocks = _blocks_for(tokens, tpb)
        for column in range(hit_counts[i]):
            host[row, column] = hit_blocks[start - hit_counts[i] + column]
        for column in range(hit_counts[i], blocks):
            block = _pop(free_stack, top, lru_prev, lru_next, lru, evicted, tops)
            top = max(top, 1) - 1
            host[row, column] = block
            refcounts[block] = 1
        cached[row] = hit_counts[i]
        cached_tokens[i] = hit_counts[i] * tpb
        live[row] = True
        capacity[row] = history[row] = tokens
        prompt_len[row] = prompt_lens[i]
        num_blocks[row] = blocks
        rewritten[row] = True
        admitted_rows[i] = row
        admitted += 1
    tops[0] = top
    tops[1] = free_top
    deltas[COUNT_ADDED] = admitted
    deltas[COUNT_NOT_ADDED] = num_new - admitted
    deltas[COUNT_FREED] = finished_rows.size
    deltas[COUNT_EVICTED] = tops[2]

    # ---- the outcome: every row whose cells changed, and those cells (flat indices)
    num_changed = 0
    num_ids = 0
    num_cells = 0
    for row in range(n):
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
    k = 0
    j = 0
    c = 0
    for row in range(n):
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
    return (granted, chunk_ok, admitted_rows, refusals, grant_starts, chunk_starts, changed_rows,
            changed_from, changed_blocks, changed_ids, changed_cells, cached_tokens)


def _admitted_tokens(prompt_len, first_chunk, cached_tokens):
    """`step_reference.admitted_tokens` for one request."""
    rest = prompt_len - cached_tokens
    return cached_tokens + (rest if first_chunk == 0 else min(first_chunk, rest))


if numba is not None:
    # Helpers take no constant arguments: numba compiles a separate variant of a function for
    # every distinct constant it is called with. The one that does (the error setter) is
    # inlined instead.
    _fail = jit(_fail, inline="always")
    _first_unknown = jit(_first_unknown)
    _first_repeat = jit(_first_repeat)
    _first_outside = jit(_first_outside)
    _first_listed = jit(_first_listed)
    _validate = jit(_validate)
    _copy_into = jit(_copy_into)
    _slack_for = jit(_slack_for)
    _blocks_for = jit(_blocks_for)
    _unlink = jit(_unlink)
    _park = jit(_park)
    _pop = jit(_pop)
    _admitted_tokens = jit(_admitted_tokens)
    _step = jit(_step)


class CompiledStep:
    """The compiled step over one manager's `CapacityState`, with its scratch arrays."""

    def __init__(self, state: CapacityState) -> None:
        if numba is None:
            raise ImportError("the compiled step needs numba (pip install numba)")
        limits = state.limits
        n = limits.max_batch_size
        self.limits = np.array([n, limits.tokens_per_block, limits.max_blocks_per_seq,
                                limits.max_draft_len, limits.max_seq_len,
                                POLICY_CODES[limits.policy]], dtype=np.int64)
        self.overlap = bool(limits.overlap)
        self.scratch = np.zeros((8, n), dtype=np.int64)
        self.flags = np.zeros((4, n), dtype=bool)
        self.items = np.zeros(n, dtype=np.int64)
        self.item_ok = np.zeros(n, dtype=bool)
        self.tops = np.zeros(3, dtype=np.int64)
        self.claimed = np.zeros(state.pool.num_blocks, dtype=bool)
        self.evicted = np.zeros(state.pool.num_blocks, dtype=np.int64)
        self.no_hits = np.zeros(n, dtype=np.int64)

    def run(self, plan: PlanArrays, state: CapacityState, hits: Hits = NO_HITS) -> StepResult:
        rows, pool, table = state.rows, state.pool, state.table
        error = np.zeros(codes.ERROR_SLOTS, dtype=np.int64)
        deltas = np.zeros(len(COUNTER_NAMES), dtype=np.int64)
        self.tops[0] = pool.num_free
        self.tops[1] = table.num_free_rows
        counts = (rows.capacity, rows.history, rows.prompt_len, rows.slack, rows.draft_len,
                  rows.lead, rows.num_blocks, rows.cached)
        num_new = plan.prompt_lens.size
        hit_counts = hits.counts if hits.counts.size == num_new else self.no_hits[:num_new]
        (granted, chunk_ok, admitted_rows, refusals, grant_starts, chunk_starts, changed_rows,
         changed_from, changed_blocks, changed_ids, changed_cells, cached_tokens) = _step(
            tuple(plan[:12]), plan.strict_grants, self.limits, self.overlap, counts, rows.live,
            rows.pending, pool.free_stack, pool.refcounts, table.host, table.free_rows,
            self.tops, pool.lru_prev, pool.lru_next, pool.lru, hit_counts, hits.blocks,
            self.claimed, self.evicted, self.scratch, self.flags, self.items, self.item_ok,
            error, deltas)
        if error[0]:
            return StepResult(error)
        pool.num_free = int(self.tops[0])
        table.num_free_rows = int(self.tops[1])
        table.mark_cells(changed_cells)
        table.sync()
        outcome = StepOutcome(
            granted=granted, prefill_granted=chunk_ok, admitted_rows=admitted_rows,
            new_refusals=refusals, grant_starts=grant_starts, prefill_starts=chunk_starts,
            changed_rows=changed_rows, changed_from=changed_from,
            changed_num_blocks=changed_blocks, changed_block_ids=changed_ids,
            num_blocks=rows.num_blocks.copy(), cached_tokens=cached_tokens,
        )
        return StepResult(error, outcome, deltas, self.evicted[: self.tops[2]].copy())
