"""The rows' device state: admitted rows go live with their counts; the spare row past the table
is never admitted, so never alive."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator.errors import InvariantViolation
from kvalloc.worker.step.rows import DeviceRows


def test_an_admitted_row_is_live_with_its_counts_and_the_spare_row_is_not() -> None:
    rows = DeviceRows(4, torch.device("cpu"))
    rows.admit(np.array([2]), np.array([3]), np.array([10]))
    assert rows.spare == 4
    assert rows.alive.tolist() == [False, False, True, False, False]
    assert (rows.generated[2].item(), rows.limit[2].item()) == (3, 10)
    rows.check_invariants()


@pytest.mark.parametrize("row", [4, -1])
def test_a_row_outside_the_table_is_refused_and_nothing_changes(row: int) -> None:
    rows = DeviceRows(4, torch.device("cpu"))
    with pytest.raises(InvariantViolation, match=f"row {row}, outside the table"):
        rows.admit(np.array([0, row]), np.array([0, 0]), np.array([5, 5]))
    assert not rows.alive.any()


def test_a_live_spare_row_breaks_the_invariants() -> None:
    rows = DeviceRows(4, torch.device("cpu"))
    rows.alive[rows.spare] = True
    with pytest.raises(InvariantViolation, match="spare"):
        rows.check_invariants()
