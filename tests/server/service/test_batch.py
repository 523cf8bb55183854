"""`server.service.batch`: what a settling call says of each request, and the slots it commits,
compiled and in numpy, agree; worked examples state the rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.server.service import batch

pytestmark = pytest.mark.skipif(batch.numba is None, reason="numba is not installed")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 8), st.sampled_from([np.int32, np.int64]))
def test_the_compiled_mask_unowned_slots_equals_the_reference(seed: int, requests: int,
                                                             block_dtype: type) -> None:
    rng = np.random.default_rng(seed)
    rows = rng.permutation(2 * requests)[:requests]
    num_tokens = rng.integers(0, 6, requests)
    token_offsets = np.cumsum(num_tokens) - num_tokens
    start_positions = rng.integers(0, 64, requests)
    slots = rng.integers(-1, 1000, int(num_tokens.sum()))
    dropped = rng.random(requests) < 0.3
    # A table whose cells sometimes hold the block a slot names, sometimes RELEASED or -1.
    table = rng.integers(-2, 250, (max(2 * requests, 1), 20)).astype(block_dtype)
    for e in range(requests):
        first, cols = token_offsets[e], (start_positions[e] + np.arange(num_tokens[e])) // 4
        held = cols < table.shape[1]
        keep = held & (rng.random(num_tokens[e]) < 0.7)
        table[rows[e], cols[keep]] = slots[first:first + num_tokens[e]][keep] // 4
    args = (rows, token_offsets, num_tokens, start_positions, slots, dropped, table, 4)
    want = batch.mask_unowned_slots_reference(*args)
    got = batch.mask_unowned_slots(*args)
    assert got.dtype == np.int64 and np.array_equal(got, want)


def test_a_dropped_request_and_positions_past_its_blocks_commit_nothing() -> None:
    # request 0 (row 1, positions 6-7) is dropped; request 1 (row 0, positions 6-8) owns 2
    # blocks (positions 0-7: blocks 3 and 5), so position 8 is past them
    table = np.array([[3, 5, -1], [2, 2, -1]], dtype=np.int32)
    got = batch.mask_unowned_slots_reference(
        np.array([1, 0]), np.array([0, 2]), np.array([2, 3]), np.array([6, 6]),
        np.array([10, 11, 22, 23, 24]), np.array([True, False]), table, 4)
    assert got.tolist() == [-1, -1, 22, 23, -1]


def test_a_column_the_step_gave_back_commits_nothing() -> None:
    # a windowed row (row 0) staged positions 2-5 in blocks 7 and 9; the settling step gave
    # its first column back (RELEASED): block 7 may be another row's now, so only 4-5 land
    table = np.array([[-2, 9, -1]], dtype=np.int32)
    got = batch.mask_unowned_slots_reference(
        np.array([0]), np.array([0]), np.array([4]), np.array([2]),
        np.array([30, 31, 36, 37]), np.array([False]), table, 4)
    assert got.tolist() == [-1, -1, 36, 37]


ROWS = 16


@st.composite
def settling_calls(draw: st.DrawFn) -> tuple[object, ...]:
    """A batch of requests on distinct rows (its first ``num_decodes`` decodes) and a settling
    call reporting, reverting and finishing rows, in and out of the batch, some twice."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = rng.permutation(ROWS)[:draw(st.integers(0, ROWS))]
    num_decodes = draw(st.integers(0, rows.size))
    results = rng.permutation(ROWS)[:draw(st.integers(0, ROWS))]
    accepted = rng.integers(0, 4, results.size)
    reverts = rng.permutation(ROWS)[:draw(st.integers(0, 4))]
    finished = rng.permutation(ROWS)[:draw(st.integers(0, 4))]
    return rows, num_decodes, results, accepted, reverts, finished, ROWS


@settings(max_examples=300, deadline=None)
@given(settling_calls())
def test_the_compiled_settlement_equals_the_reference(call: tuple[object, ...]) -> None:
    want = batch.settle_rows_reference(*call)
    got = batch.settle_rows(*call)
    assert got[2:] == want[2:]
    for name, a, b in zip(("accepted", "dropped"), got[:2], want[:2], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_a_settlement_drops_what_was_reverted_or_finished_and_names_the_first_unsettled() -> None:
    i64 = np.int64
    # requests on rows 5, 2, 7 (decodes) and 9 (a new request: it needs no settling)
    accepted, dropped, first, unsettled = batch.settle_rows_reference(
        np.array([5, 2, 7, 9]), 3, np.array([5, 2], i64), np.array([3, 1], i64),
        np.array([2], i64), np.zeros(0, i64), ROWS)
    # row 2 was reported and reverted: dropped wins, and it accepts nothing
    assert accepted.tolist() == [3, 0, 0, 0] and dropped.tolist() == [False, True, False, False]
    assert (first, unsettled) == (2, 1)  # row 7
