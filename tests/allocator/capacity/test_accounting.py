"""`allocator.capacity.accounting`: the slack rule, one function for both steps.

Rules (docs/design.md "Capacity accounting"):
- under the overlap scheduler a grant's slack is its D, or the previous step's accepted drafts
  (the device's lead) when those are more;
- without overlap, or under the ``none`` policy, there is no slack;
- the compiled step runs the same function on integers that the numpy step runs on arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.capacity.accounting import slack_for
from kvalloc.allocator.capacity.state import POLICY_CODES
from kvalloc.allocator.capacity.step import compiled
from kvalloc.allocator.capacity.step.compiled import rules
from kvalloc.allocator.config import SlackPolicy


def test_the_slack_is_the_drafts_or_the_lead_when_that_is_larger() -> None:
    drafts, leads = np.array([3, 3, 0, 2]), np.array([0, 3, 3, 5])
    assert slack_for(drafts, True, SlackPolicy.RECLAIM, leads).tolist() == [3, 3, 3, 5]
    assert slack_for(drafts, True, SlackPolicy.UNRECLAIMED, leads).tolist() == [3, 3, 3, 5]


@pytest.mark.parametrize("overlap, policy", [(False, SlackPolicy.RECLAIM),
                                             (True, SlackPolicy.NONE)])
def test_without_overlap_or_under_policy_none_there_is_no_slack(overlap: bool,
                                                                policy: SlackPolicy) -> None:
    got = slack_for(np.array([3, 1]), overlap, policy, np.array([5, 0]))
    assert got.dtype == np.int64 and got.tolist() == [0, 0]


@pytest.mark.skipif(not compiled.available(), reason="numba is not installed")
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64)), min_size=1, max_size=8),
       st.booleans(), st.sampled_from(list(SlackPolicy)))
def test_the_compiled_step_computes_the_same_slack(pairs: list[tuple[int, int]], overlap: bool,
                                                   policy: SlackPolicy) -> None:
    drafts, leads = (np.array(column, dtype=np.int64) for column in zip(*pairs, strict=True))
    want = slack_for(drafts, overlap, policy, leads)
    got = [rules.slack_for(d, lead, overlap, POLICY_CODES[policy])
           for d, lead in pairs]
    assert got == want.tolist()
