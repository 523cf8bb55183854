"""Phase 3 of the compiled step, `reference.plan_grants` and `reference.plan_prefill`: the
capacity each grant, padding top-up and prefill chunk wants (`Demand`).

Invariants: the `Demand`'s arrays are the scratch's (``item_rows`` a view of its first rows:
top-ups first, then this step's grants); nothing but the scratch changes.
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.step import codes
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.loops import fail, first_marked
from kvalloc.allocator.capacity.step.compiled.rules import grant_slack, released_behind
from kvalloc.allocator.capacity.step.compiled.tuples import Demand, Plan, Scratch, Settled, State


@inlined
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
            fail(error, codes.PREFILL_INCOMPLETE, codes.GRANTS, i, 0)
            return stopped
    is_new_grant[:] = False
    for row in padding:  # `wanted` is read at padding and grant rows only
        wanted[row] = draft_len[row]
    for i in range(grants.size):
        is_new_grant[grants[i]] = True
        wanted[grants[i]] = draft_lens[i]
    for i in range(padding.size):
        if not (pending[padding[i]] or is_new_grant[padding[i]]):
            fail(error, codes.NO_PENDING_GRANT, codes.PADDING, i, 0)
            return stopped
    for i in range(padding.size):
        if padded[i] < wanted[padding[i]]:
            fail(error, codes.PADDING_BELOW_DRAFT, codes.PADDED, i, wanted[padding[i]])
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
        new_slack = grant_slack(wanted[row], at_lag2, lead[row], limits.overlap, limits.policy)
        if is_new_grant[row]:
            released = released_behind(draft_len[row], limits.policy) if pending[row] else 0
            added = 1 + wanted[row] + new_slack - released
        else:
            added = (wanted[row] - draft_len[row]) + (new_slack - slack[row])
        target[row] = max(capacity[row] + added, history[row])
    return Demand(items[: num_topups + grants.size], num_topups, is_new_grant, wanted, target)


@inlined
def _grantable(grants: np.ndarray, lag: int, pending: np.ndarray, ahead: np.ndarray,
               behind: np.ndarray, error: np.ndarray) -> bool:
    """`reference._check_grantable`: False, with ``error`` set, when a grant is not allowed."""
    if lag == 1:
        i = first_marked(grants, pending, True)
        if i >= 0:
            fail(error, codes.GRANT_PENDING, codes.GRANTS, i, 0)
            return False
        return True
    i = first_marked(grants, behind, True)
    if i >= 0:
        fail(error, codes.TWO_UNSETTLED, codes.GRANTS, i, 0)
        return False
    for i in range(grants.size):
        if pending[grants[i]] and not ahead[grants[i]]:
            fail(error, codes.LAG1_PENDING, codes.GRANTS, i, 0)
            return False
    return True


@inlined
def plan_prefill(plan: Plan, state: State, settled: Settled, demand: Demand,
                 error: np.ndarray) -> None:
    rows, tokens = plan.prefill_rows, plan.prefill_tokens
    prompt_len, target = state.rows.prompt_len, demand.target_capacity
    capacity, history = settled.capacity, settled.history
    for i in range(rows.size):
        row = rows[i]
        if history[row] + tokens[i] > prompt_len[row]:
            return fail(error, codes.PREFILL_PAST_PROMPT, codes.CHUNK_TOKENS, i, prompt_len[row])
        target[row] = capacity[row] + tokens[i]
    return None
