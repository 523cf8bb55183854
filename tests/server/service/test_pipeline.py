"""`server.service.pipeline`: the step's token demand, compiled and in numpy, agree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.common.jit import numba
from kvalloc.server.service import pipeline

pytestmark = pytest.mark.skipif(numba is None, reason="numba is not installed")


@settings(max_examples=200, deadline=None)
@given(*(st.lists(st.integers(0, 1 << 20), max_size=20) for _ in range(3)))
def test_the_compiled_demand_equals_the_reference(drafts: list[int], prefill: list[int],
                                                  prompts: list[int]) -> None:
    args = [np.array(values, dtype=np.int64) for values in (drafts, prefill, prompts)]
    assert pipeline.token_demand(*args) == pipeline.token_demand_reference(*args)


def test_a_grant_runs_its_drafts_and_one_token_more() -> None:
    assert pipeline.token_demand_reference(
        np.array([3, 0]), np.array([7]), np.zeros(0, dtype=np.int64)) == (5, 7, 0)
