"""`server.service.registry`: the compiled handle check and row taking equal their numpy references
on random registries and calls, forged handles included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.common.jit import numba
from kvalloc.server.service import registry

pytestmark = pytest.mark.skipif(numba is None, reason="numba is not installed")

ROWS = 12
SESSION = 77


@st.composite
def calls(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A registry of ROWS rows (plus the sentinel) some of which SESSION owns, and a call's
    handles: live ones of SESSION, and forged ones of every kind."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    generations = rng.integers(0, 5, ROWS + 1)
    generations[-1] = 0
    row_handles = generations << registry.ROW_BITS | np.arange(ROWS + 1)
    owner = rng.choice([registry.NO_OWNER, SESSION, SESSION + 1], ROWS + 1)
    owner[-1] = registry.NO_OWNER
    owner[generations == 0] = registry.NO_OWNER
    n = draw(st.integers(0, 20))
    handles = row_handles[rng.integers(0, ROWS, n)]
    forged = rng.random(n) < draw(st.sampled_from([0.0, 0.1, 0.5]))
    kinds = rng.integers(0, 4, n)
    fakes = np.select([kinds == 0, kinds == 1, kinds == 2],
                      [handles + (1 << registry.ROW_BITS),  # a later generation of its row
                       rng.integers(ROWS, 1 << registry.ROW_BITS, n),  # past the table
                       rng.integers(-(1 << 40), 0, n)],  # negative
                      rng.integers(0, 1 << 62, n))  # anything
    return np.where(forged, fakes, handles), row_handles, owner


@settings(max_examples=300, deadline=None)
@given(calls(), st.lists(st.integers(0, 20), min_size=5, max_size=5))
def test_the_compiled_check_equals_the_reference(call: tuple[np.ndarray, ...],
                                                 cuts: list[int]) -> None:
    handles, row_handles, owner = call
    # A call's six lists of handles, some empty.
    lists = tuple(part.copy() for part in np.split(handles, np.minimum(sorted(cuts),
                                                                       handles.size)))
    want_rows, want_list, want_index = registry.live_rows_reference(lists, row_handles, owner,
                                                                    SESSION)
    got_rows, got_list, got_index = registry.live_rows(lists, row_handles, owner, SESSION)
    assert (got_list, got_index) == (want_list, want_index)
    if want_list < 0:
        assert np.array_equal(got_rows, want_rows) and got_rows.dtype == np.int64
    else:  # the first bad handle is the first one the reference finds not live
        first = sum(part.size for part in lists[:want_list]) + want_index
        live = (owner[want_rows] == SESSION) & (row_handles[want_rows] == handles)
        assert live[:first].all() and not live[first]


def test_the_reference_names_the_first_handle_not_live() -> None:
    row_handles = np.array([1 << 20, 2 << 20 | 1, 2], dtype=np.int64)  # rows 0, 1, sentinel
    owner = np.array([SESSION, SESSION + 1, registry.NO_OWNER], dtype=np.int64)
    mine, theirs = row_handles[0], row_handles[1]

    def first_bad(check, *lists: list[int]) -> tuple[int, int]:  # type: ignore[no-untyped-def]
        arrays = tuple(np.array(part, dtype=np.int64) for part in lists)
        return check(arrays, row_handles, owner, SESSION)[1:]

    for check in (registry.live_rows_reference, registry.live_rows):
        rows, *bad = check((np.array([mine, mine], dtype=np.int64),), row_handles, owner,
                           SESSION)
        assert (rows.tolist(), bad) == ([0, 0], [-1, -1])
        assert first_bad(check, [mine, theirs]) == (0, 1)
        assert first_bad(check, [mine, 5]) == (0, 1)
        assert first_bad(check, [-1]) == (0, 0)
        assert first_bad(check, [mine], [], [mine, mine, theirs]) == (2, 2)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, ROWS))
def test_taking_rows_compiled_equals_the_reference(seed: int, new: int) -> None:
    rng = np.random.default_rng(seed)
    row_handles = rng.integers(0, 5, ROWS + 1) << registry.ROW_BITS | np.arange(ROWS + 1)
    owner = np.full(ROWS + 1, registry.NO_OWNER)
    rows = np.where(rng.random(new) < 0.3, -1, rng.permutation(ROWS)[:new])
    want_handles, want_owner = row_handles.copy(), owner.copy()
    want = registry.take_rows_reference(rows, want_handles, want_owner, SESSION)
    got = registry.take_rows(rows, row_handles, owner, SESSION)
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert np.array_equal(row_handles, want_handles) and np.array_equal(owner, want_owner)


def test_a_taken_row_gets_its_next_generation_and_a_refused_entry_none() -> None:
    row_handles = np.arange(3, dtype=np.int64)  # rows 0, 1 and the sentinel, generation 0
    owner = np.full(3, registry.NO_OWNER, dtype=np.int64)
    for take in (registry.take_rows_reference, registry.take_rows):
        handles, mine = row_handles.copy(), owner.copy()
        got = take(np.array([1, -1], dtype=np.int64), handles, mine, SESSION)
        assert got.tolist() == [1 << registry.ROW_BITS | 1, -1]
        assert handles.tolist() == [0, 1 << registry.ROW_BITS | 1, 2]
        assert mine.tolist() == [registry.NO_OWNER, SESSION, registry.NO_OWNER]
