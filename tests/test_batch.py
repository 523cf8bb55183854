"""`server.batch`: the slots a settling call commits, compiled and in numpy, agree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server import batch

pytestmark = pytest.mark.skipif(batch.numba is None, reason="numba is not installed")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 8), st.integers(0, 40),
       st.sampled_from([np.int32, np.int64]))
def test_the_compiled_commit_slots_equal_the_reference(seed: int, requests: int, tokens: int,
                                                       block_dtype: type) -> None:
    rng = np.random.default_rng(seed)
    tokens = tokens if requests else 0
    token_request = np.sort(rng.integers(0, max(requests, 1), tokens))
    positions = rng.integers(0, 64, tokens)
    slots = rng.integers(-1, 1000, tokens)
    dropped = rng.random(requests) < 0.3
    blocks_after = rng.integers(0, 20, requests).astype(block_dtype)
    args = (token_request, positions, slots, dropped, blocks_after, 4)
    want = batch.commit_slots_reference(*args)
    got = batch.commit_slots(*args)
    assert got.dtype == np.int64 and np.array_equal(got, want)


def test_a_dropped_request_and_positions_past_its_blocks_commit_nothing() -> None:
    got = batch.commit_slots_reference(
        np.array([0, 0, 1, 1, 1]), np.array([6, 7, 3, 4, 8]), np.array([10, 11, 20, 21, 22]),
        np.array([True, False]), np.array([5, 2]), 4)
    # request 0 is dropped; request 1 owns 2 blocks (positions 0-7), so position 8 is past them
    assert got.tolist() == [-1, -1, 20, 21, -1]
