"""`allocator.capacity.slots`: one slot rule, three implementations that agree.

Rules (docs/design.md "Words": block table and slot):
- a token at position ``pos`` of row ``row`` lives at slot ``table[row, pos // tpb] * tpb +
  pos % tpb``, an int64;
- the slot is -1 for padding (a negative position), past the table's width, and in a column
  that holds -1 (past the row's blocks);
- the compiled run form gives, run after run, the slots of consecutive positions, exactly what
  the numpy reference gives for those positions one by one; torch gives the same on the table's
  device; a row past the table (a worker's spare row) holds no block, so its slots are -1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.capacity import slots
from kvalloc.allocator.common.jit import numba

TPB = 4
# row 0: blocks 7, 2; row 1: block 5; row 2: none.
TABLE = np.array([[7, 2, -1], [5, -1, -1], [-1, -1, -1]], dtype=np.int32)


# (row, position, slot): why
CASES = [
    (0, 1, 7 * TPB + 1),  # row 0's first block
    (0, 6, 2 * TPB + 2),  # across its block boundary, in its second block
    (1, 2, 5 * TPB + 2),
    (0, -1, -1),  # padding
    (1, 5, -1),  # past row 1's only block: a -1 column
    (2, 0, -1),  # row 2 holds no block
    (0, 3 * TPB, -1),  # past the table's width
]


def test_the_reference_maps_positions_to_block_offsets_and_bad_ones_to_minus_one() -> None:
    rows, positions, want = (np.array(column) for column in zip(*CASES, strict=True))
    got = slots.slots_reference(TABLE, rows, positions, TPB)
    assert got.dtype == np.int64
    assert got.tolist() == want.tolist()


def test_runs_are_consecutive_positions_concatenated_in_run_order() -> None:
    got = slots.run_slots_reference(TABLE, np.array([1, 0, 2]), np.array([2, 3, 0]),
                                    np.array([3, 2, 0]), TPB)
    assert got.tolist() == [22, 23, -1, 31, 8]


@st.composite
def tables_and_runs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                              int]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tpb = draw(st.sampled_from([1, 3, 4, 16]))
    num_rows, width, runs = (draw(st.integers(1, 8)), draw(st.integers(1, 6)),
                             draw(st.integers(0, 12)))
    table = rng.integers(-1, 500, size=(num_rows, width)).astype(np.int32)
    rows = rng.integers(0, num_rows, runs)
    starts = rng.integers(-2 * tpb, (width + 1) * tpb, runs)
    num_tokens = rng.integers(0, 3 * tpb + 2, runs)
    return table, rows, starts, num_tokens, tpb


@pytest.mark.skipif(numba is None, reason="numba is not installed")
@settings(max_examples=300, deadline=None)
@given(tables_and_runs())
def test_the_compiled_runs_equal_the_reference(case: tuple[object, ...]) -> None:
    want = slots.run_slots_reference(*case)
    got = slots.run_slots(*case)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_torch_on_the_device_equals_the_reference(device: str) -> None:
    rng = np.random.default_rng(11)
    dev = torch.device(device)
    for tpb in (1, 3, 16):
        table = rng.integers(-1, 200, size=(8, 6)).astype(np.int32)
        rows = rng.integers(0, 8, size=500)
        positions = rng.integers(-5, 6 * tpb + 10, size=500)
        got = slots.slot_mapping(torch.from_numpy(table).to(dev), torch.from_numpy(rows).to(dev),
                                 torch.from_numpy(positions).to(dev), tpb)
        assert got.dtype == torch.int64
        np.testing.assert_array_equal(got.cpu().numpy(),
                                      slots.slots_reference(table, rows, positions, tpb))


def test_a_row_past_the_table_has_no_slots_in_torch() -> None:
    """`padded_slot_mapping` is the reference over the table with rows of -1 past its own."""
    rng = np.random.default_rng(12)
    for tpb in (1, 3, 16):
        table = rng.integers(-1, 200, size=(8, 6)).astype(np.int32)
        rows = rng.integers(0, 10, size=500)  # rows 8 and 9: past the table
        positions = rng.integers(-5, 6 * tpb + 10, size=500)
        got = slots.padded_slot_mapping(torch.from_numpy(table), torch.from_numpy(rows),
                                        torch.from_numpy(positions), tpb)
        padded = np.concatenate([table, np.full((2, 6), -1, np.int32)])
        assert got.dtype == torch.int64
        np.testing.assert_array_equal(got.numpy(),
                                      slots.slots_reference(padded, rows, positions, tpb))
        assert (got.numpy()[rows >= 8] == -1).all()
