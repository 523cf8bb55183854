"""`server.service.batch.schedule`: the compiled layout of a step's forward equals the numpy
reference on random outcomes, and the reference states the rules (token order, offsets,
positions); the slots of the runs it lays out follow the table (`allocator.capacity.slots`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.capacity.slots import run_slots_reference
from kvalloc.server.contract.columns import Scheduled
from kvalloc.server.service import batch as sched

pytestmark = pytest.mark.skipif(sched.numba is None, reason="numba is not installed")

TPB = 4
WIDTH = 6


@st.composite
def step_outcomes(draw: st.DrawFn) -> sched.ForwardRequests:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = rng.permutation(32)
    grants, chunks, new = (draw(st.integers(0, 6)) for _ in range(3))
    grant_rows, prefill_rows, admitted_rows = np.split(rows[:grants + chunks + new],
                                                       [grants, grants + chunks])
    admitted_rows = np.where(rng.random(new) < 0.3, -1, admitted_rows)
    return sched.ForwardRequests(
        grant_handles=rng.integers(1 << 20, 1 << 30, grants),
        grant_rows=grant_rows.astype(np.int64), granted=rng.random(grants) < 0.8,
        drafts=rng.integers(0, 4, grants), grant_starts=rng.integers(0, WIDTH * TPB - 4, grants),
        prefill_handles=rng.integers(1 << 20, 1 << 30, chunks),
        prefill_rows=prefill_rows.astype(np.int64), prefill_granted=rng.random(chunks) < 0.7,
        prefill_tokens=rng.integers(1, 9, chunks),
        prefill_starts=rng.integers(0, WIDTH * TPB, chunks),
        new_handles=np.where(admitted_rows >= 0, rng.integers(1 << 20, 1 << 30, new), -1),
        admitted_rows=admitted_rows.astype(np.int64),
        prompt_tokens=rng.integers(1, WIDTH * TPB + 6, new),
        prompt_lens=rng.integers(2 * TPB + 1, WIDTH * TPB + 6, new),
        new_starts=rng.integers(0, 3, new) * TPB)


@settings(max_examples=300, deadline=None)
@given(step_outcomes())
def test_the_compiled_layout_equals_the_reference(requests: sched.ForwardRequests) -> None:
    want, want_decodes = sched.schedule_reference(requests)
    got, got_decodes = sched.schedule_compiled(requests)
    assert got_decodes == want_decodes
    assert got == want
    for name in dataclasses.fields(got):
        assert getattr(got, name.name).dtype == np.int64, name.name


def slots_of(scheduled: Scheduled, table: np.ndarray) -> list[int]:
    return run_slots_reference(table, scheduled.rows, scheduled.start_positions,
                               scheduled.num_tokens, TPB).tolist()


def new_requests(handles: list[int], rows: list[int], prompt_tokens: list[int],
                 prompt_lens: list[int], starts: list[int]) -> dict[str, np.ndarray]:
    """`ForwardRequests`' new-request fields, as int64 arrays."""
    columns = {"new_handles": handles, "admitted_rows": rows, "prompt_tokens": prompt_tokens,
               "prompt_lens": prompt_lens, "new_starts": starts}
    return {name: np.array(values, np.int64) for name, values in columns.items()}


def only_new_requests(**columns: list[int]) -> sched.ForwardRequests:
    """A step of new requests alone: no grants, no prefill chunks."""
    none, no = np.zeros(0, np.int64), np.zeros(0, bool)
    return sched.ForwardRequests(
        grant_handles=none, grant_rows=none, granted=no, drafts=none, grant_starts=none,
        prefill_handles=none, prefill_rows=none, prefill_granted=no, prefill_tokens=none,
        prefill_starts=none, **new_requests(**columns))


def test_the_reference_lays_out_decodes_then_chunks_then_new_requests() -> None:
    table = np.full((4, WIDTH), -1, dtype=np.int32)
    table[0, :2] = [7, 3]
    table[1, :1] = [9]
    table[2, :1] = [5]
    i64 = np.int64
    scheduled, num_decodes = sched.schedule_reference(sched.ForwardRequests(
        grant_handles=np.array([100, 101], i64), grant_rows=np.array([0, 3], i64),
        granted=np.array([True, False]), drafts=np.array([2, 3], i64),
        grant_starts=np.array([3, 0], i64),
        prefill_handles=np.array([200], i64), prefill_rows=np.array([1], i64),
        prefill_granted=np.array([True]), prefill_tokens=np.array([2], i64),
        prefill_starts=np.array([1], i64),
        **new_requests(handles=[300], rows=[2], prompt_tokens=[3], prompt_lens=[3], starts=[0])))
    assert scheduled.handles.tolist() == [100, 200, 300]  # the refused grant is left out
    assert scheduled.num_tokens.tolist() == [3, 2, 3]
    assert scheduled.num_drafts.tolist() == [2, 0, 0]
    assert scheduled.token_offsets.tolist() == [0, 3, 5] and num_decodes == 1
    assert scheduled.positions()[1].tolist() == [3, 4, 5, 1, 2, 0, 1, 2]
    # row 0: position 3 is block 7 offset 3, positions 4-5 are block 3 offsets 0-1
    assert slots_of(scheduled, table) == [31, 12, 13, 37, 38, 20, 21, 22]


def test_a_new_request_with_a_cached_prefix_starts_after_it() -> None:
    table = np.full((2, WIDTH), -1, dtype=np.int32)
    table[1, :3] = [4, 8, 6]
    scheduled, _ = sched.schedule_reference(only_new_requests(
        handles=[300], rows=[1], prompt_tokens=[3], prompt_lens=[11], starts=[8]))
    assert scheduled.start_positions.tolist() == [8]
    assert scheduled.positions()[1].tolist() == [8, 9, 10]
    assert slots_of(scheduled, table) == [24, 25, 26]


def test_a_new_request_runs_no_further_than_its_prompt() -> None:
    # a chunk of up to 5 tokens, 8 of the prompt's 10 cached: the last 2 run
    scheduled, _ = sched.schedule_reference(only_new_requests(
        handles=[300], rows=[1], prompt_tokens=[5], prompt_lens=[10], starts=[8]))
    assert scheduled.num_tokens.tolist() == [2]
    assert scheduled.positions()[1].tolist() == [8, 9]
