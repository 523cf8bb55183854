"""Phase 2 of the compiled step, `reference.settle_step`: reverts, then results, settled into
the scratch copy of the row state (`Settled`).

Invariants: only ``settled`` changes (the row state is replaced by it in `replace`, once nothing
can fail); a revert or a result of a row with no pending grant, and more accepted drafts than
the step drafted, stop the step.
"""
from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.step import codes
from kvalloc.allocator.capacity.step.compiled.inlining import inlined
from kvalloc.allocator.capacity.step.compiled.loops import copy_settled, fail, first_marked
from kvalloc.allocator.capacity.step.compiled.rules import revert, settle_behind
from kvalloc.allocator.capacity.step.compiled.tuples import RECLAIM, Plan, Settled, State


@inlined
def settle_step(plan: Plan, state: State, settled: Settled, error: np.ndarray) -> None:
    """`reference.settle_step`, into ``settled``. Loops read arrays, never the tuple: an inlined
    helper given a tuple per row costs a reference count per array in it."""
    reverts, results, accepted = plan.revert_rows, plan.result_rows, plan.num_accepted
    policy = state.limits.policy
    copy_settled(settled, state.rows)
    capacity, history, slack, draft_len = (settled.capacity, settled.history, settled.slack,
                                           settled.draft_len)
    pending, ahead, lead = settled.pending, settled.ahead, settled.lead
    behind, behind_draft, behind_slack = settled.behind, settled.behind_draft, settled.behind_slack
    i = first_marked(reverts, pending, False)
    if i >= 0:
        return fail(error, codes.NO_PENDING_GRANT, codes.REVERTS, i, 0)
    for row in reverts:
        capacity[row] = revert(capacity[row], history[row], draft_len[row], slack[row])
        if behind[row]:  # the step behind (its forward ran) is the pending one again
            draft_len[row], slack[row] = behind_draft[row], behind_slack[row]
            behind[row] = False
            behind_draft[row] = behind_slack[row] = 0
        else:
            pending[row] = ahead[row] = False
            slack[row] = draft_len[row] = 0
    i = first_marked(results, pending, False)
    if i >= 0:
        return fail(error, codes.NO_PENDING_GRANT, codes.RESULTS, i, 0)
    for i in range(results.size):
        row = results[i]
        drafts = behind_draft[row] if behind[row] else draft_len[row]
        if accepted[i] > drafts:
            return fail(error, codes.ACCEPTED_EXCEEDS_DRAFTS, codes.ACCEPTED, i, drafts)
    for i in range(results.size):
        row, count = results[i], accepted[i]
        if behind[row]:  # `accounting.settle_behind`: the newer grant stays pending
            capacity[row], history[row] = settle_behind(
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
