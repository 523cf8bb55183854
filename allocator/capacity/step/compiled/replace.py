"""Phase 5 of the compiled step, `reference.replace_state`: once nothing can fail, the settled
and granted state replaces the row state, and the counters' deltas are counted.

Invariants: a grant served on a row with a step unsettled puts that step behind it; refused
grants and chunks leave their rows as settled.
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.loops import copy_settled
from kvalloc.allocator.capacity.step.compiled.rules import grant_slack
from kvalloc.allocator.capacity.step.compiled.tuples import (
    COUNT_GRANTS,
    COUNT_RECLAIMED,
    COUNT_REFUSED,
    COUNT_REVERTS,
    COUNT_REWOUND,
    COUNT_TOPUPS,
    COUNT_UPDATES,
    RECLAIM,
    Demand,
    Plan,
    Served,
    Settled,
    State,
)


@inlined
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
    copy_settled(rows, settled)
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
            slack[row] = grant_slack(wanted[row], ahead[row], lead[row], overlap, policy)
            draft_len[row] = wanted[row]
            pending[row] = True
    deltas[COUNT_REFUSED] = num_grants - deltas[COUNT_GRANTS]
    for i in range(chunks.size):
        if prefill_ok[i]:
            capacity[chunks[i]] += tokens[i]
            history[chunks[i]] += tokens[i]
