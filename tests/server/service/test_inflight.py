"""`server.service.inflight`: what one call settles of an overlap worker's last two batches,
in worked examples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.server.contract.columns import Scheduled
from kvalloc.server.contract.errors import StepNotSettled
from kvalloc.server.service.inflight import Flight, InFlight, settle_compiled, settle_reference

ROWS = 8


def batch(rows: list[int], num_decodes: int, step_id: int) -> Flight:
    n = len(rows)
    ones = np.ones(n, dtype=np.int64)
    scheduled = Scheduled(handles=np.array(rows, dtype=np.int64) + 100,
                          rows=np.array(rows, dtype=np.int64), token_offsets=np.arange(n),
                          num_tokens=ones, num_drafts=0 * ones, start_positions=0 * ones)
    return Flight.of(scheduled, num_decodes, step_id)


def rows(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_results_settle_the_older_step_reverts_the_newest_and_finishes_both() -> None:
    # Step 1 decoded rows 0-3; step 2 decodes rows 0-2 and admitted row 5.
    flights = InFlight(batch([0, 1, 2, 3], 4, step_id=1), batch([0, 1, 2, 5], 3, step_id=2))
    settled = flights.settle(result_rows=rows(0, 1), revert_rows=rows(1, 3),
                             finished_rows=rows(2), num_rows=ROWS)
    older, newest = settled
    assert older is not None and newest is not None
    # Row 3 has nothing newer: its revert undid step 1. Row 1's undid its newer step.
    assert older.waiting.tolist() == [False] * 4
    assert older.dropped.tolist() == [False, False, True, True]
    # Row 0's step 2 waits for the next call; the results went to step 1, so none is early.
    assert newest.waiting.tolist() == [True, False, False, False]
    assert newest.dropped.tolist() == [False, True, True, False]
    assert flights.advance(settled, batch([0], 1, step_id=3)) is older
    assert flights.older is newest


def test_a_result_for_a_request_with_nothing_older_waiting_settles_its_newest_step() -> None:
    flights = InFlight(batch([0], 1, step_id=1), batch([0, 1], 2, step_id=2))
    older, newest = flights.settle(rows(0, 1), rows(), rows(), num_rows=ROWS)
    assert older is not None and newest is not None
    assert newest.waiting.tolist() == [True, False]  # row 0's result went to step 1


def test_an_unsettled_older_decode_is_named_and_nothing_changes() -> None:
    first, second = batch([0, 1], 2, step_id=4), batch([1], 1, step_id=5)
    flights = InFlight(first, second)
    with pytest.raises(StepNotSettled, match="handle 101 ran in step 4"):
        flights.settle(rows(0), rows(1), rows(), num_rows=ROWS)  # the revert hits step 5
    assert (flights.older, flights.newest) == (first, second)
    assert first.waiting.all() and second.waiting.all() and not first.dropped.any()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_compiled_settle_is_the_reference(data: st.DataObject) -> None:
    """Random batches and calls: the compiled loop returns exactly what the reference does."""
    def row_set(max_size: int) -> np.ndarray:
        picked = data.draw(st.lists(st.integers(0, ROWS - 1), unique=True, max_size=max_size))
        return np.array(picked, dtype=np.int64)

    def flags(n: int) -> np.ndarray:
        return np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)

    older, newest = row_set(ROWS), row_set(ROWS)
    args = (row_set(ROWS), row_set(ROWS), row_set(3), ROWS, older, flags(older.size),
            flags(older.size), newest, flags(newest.size), flags(newest.size))
    (want_dropped, want_missing, want_waiting, want_gone) = settle_reference(*args)
    (dropped, missing, waiting, gone) = settle_compiled(*args)
    assert missing == want_missing
    assert dropped.tolist() == want_dropped.tolist()
    assert waiting.tolist() == want_waiting.tolist()
    assert gone.tolist() == want_gone.tolist()
