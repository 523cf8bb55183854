"""The block-table validator counts exactly the entries a step addresses that hold no block."""

from __future__ import annotations

import torch
from kvalloc.allocator.capacity.table_validator import TableValidator


def test_counts_holes_and_positions_past_the_row() -> None:
    table = torch.tensor([[4, 7, -1, -1], [2, -1, -1, -1], [1, 3, 5, 6]], dtype=torch.int32)
    validator = TableValidator(torch.device("cpu"))
    # Row 0 holds 2 blocks of 4: reach 8 is inside, reach 9 needs a third block.
    validator.check(table, torch.tensor([0, 1]), torch.tensor([7, 3]), torch.tensor([8, 4]), 4)
    assert validator.count() == 0
    validator.check(table, torch.tensor([0, 1]), torch.tensor([8, 12]), torch.tensor([9, 13]), 4)
    assert validator.count() == 1 + 3  # row 0's third block; row 1's second to fourth
    # A fifth block: no row has one.
    validator.check(table, torch.tensor([2]), torch.tensor([16]), torch.tensor([17]), 4)
    assert validator.count() == 5


def test_a_window_checks_only_the_columns_its_first_query_reads() -> None:
    """Row 0 gave its first two columns back (RELEASED, -2): a window of 6 from history 13
    reads keys 8.. (column 2 on), so only its missing fourth block counts; a window of 7 reads
    key 7 too, in column 1."""
    table = torch.tensor([[-2, -2, 5, -1], [-2, 3, 6, 8]], dtype=torch.int32)
    rows, history, reach = torch.tensor([0, 1]), torch.tensor([13, 13]), torch.tensor([14, 14])
    validator = TableValidator(torch.device("cpu"), window=6)
    validator.check(table, rows, history, reach, 4)
    assert validator.count() == 1
    validator = TableValidator(torch.device("cpu"), window=7)
    validator.check(table, rows, history, reach, 4)
    assert validator.count() == 2
    validator = TableValidator(torch.device("cpu"))
    validator.check(table, rows, history, reach, 4)
    assert validator.count() == 3 + 1


def test_an_entry_on_a_row_past_the_table_is_padding_and_counts_nothing() -> None:
    """A worker's padded entries run on its spare row, one past the table's: whatever their
    reach, they address no block. A real entry beside them still counts."""
    table = torch.tensor([[4, -1], [2, 3]], dtype=torch.int32)
    validator = TableValidator(torch.device("cpu"))
    validator.check(table, torch.tensor([1, 2, 2]), torch.tensor([0, 0, 40]),
                    torch.tensor([8, 99, 99]), 4)
    assert validator.count() == 0
    validator.check(table, torch.tensor([0, 2]), torch.tensor([4, 0]), torch.tensor([5, 99]), 4)
    assert validator.count() == 1  # row 0's second block
