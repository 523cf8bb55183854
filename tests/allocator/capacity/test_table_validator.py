"""The block-table validator counts exactly the entries a step addresses that hold no block."""

from __future__ import annotations

import torch
from kvalloc.allocator.capacity.table_validator import TableValidator


def test_counts_holes_and_positions_past_the_row() -> None:
    table = torch.tensor([[4, 7, -1, -1], [2, -1, -1, -1], [1, 3, 5, 6]], dtype=torch.int32)
    validator = TableValidator(torch.device("cpu"))
    # Row 0 holds 2 blocks of 4: reach 8 is inside, reach 9 needs a third block.
    validator.check(table, torch.tensor([0, 1]), torch.tensor([8, 4]), 4)
    assert validator.count() == 0
    validator.check(table, torch.tensor([0, 1]), torch.tensor([9, 13]), 4)
    assert validator.count() == 1 + 3  # row 0's third block; row 1's second to fourth
    validator.check(table, torch.tensor([2]), torch.tensor([17]), 4)  # a fifth block: no row
    assert validator.count() == 5
