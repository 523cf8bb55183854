"""A worker's own block table (`OwnTable`): the host mirror follows each reply's changes, and
the device copy follows it at once, or, once a launcher folds the changes into its own step,
from what that launcher takes (here a CPU tensor stands for the device copy, and a numpy
scatter for the step's)."""

from __future__ import annotations

import numpy as np
import torch
from kvalloc.server.client import OwnTable
from kvalloc.server.contract.columns import TableChanges

SHAPE = (4, 8)


def changes(rows: list[int], starts: list[int], num_blocks: list[int],
            block_ids: list[int]) -> TableChanges:
    return TableChanges(*(np.array(v, dtype=np.int64) for v in (rows, starts, num_blocks,
                                                                  block_ids)))


def own_table() -> OwnTable:
    return OwnTable.like(torch.full(SHAPE, 7, dtype=torch.int32))


def device(table: OwnTable) -> np.ndarray:
    return table.device.tensor.numpy()


def scatter(table: OwnTable, cells: np.ndarray, values: np.ndarray) -> None:
    """What the launcher's step does with what it took."""
    device(table).reshape(-1)[cells] = values


def test_it_starts_empty_and_follows_each_change_at_once() -> None:
    table = own_table()
    assert (device(table) == -1).all() and (table.host == -1).all()
    table.apply(changes([1, 3], [0, 0], [3, 1], [10, 11, 12, 20]))
    assert table.host[1, :3].tolist() == [10, 11, 12] and table.host[3, 0] == 20
    np.testing.assert_array_equal(device(table), table.host)
    table.apply(changes([1], [1], [1], []))  # row 1 shrinks to one block
    assert table.host[1].tolist() == [10] + [-1] * 7
    np.testing.assert_array_equal(device(table), table.host)


def test_folded_changes_wait_for_the_launcher_that_takes_them() -> None:
    table = own_table()
    table.fold()
    table.apply(changes([0], [0], [2], [5, 6]))
    table.apply(changes([2], [0], [1], [9]))
    assert (device(table) == -1).all()  # nothing uploaded yet
    cells, values = np.full(6, -5, dtype=np.int64), np.full(6, -5, dtype=np.int64)
    table.take(cells, values)
    assert cells[:3].tolist() == [0, 1, 16] and values[:3].tolist() == [5, 6, 9]
    assert (cells[3:] == 0).all() and (values[3:] == 5).all()  # the first pair, again
    scatter(table, cells, values)
    np.testing.assert_array_equal(device(table), table.host)
    table.take(cells, values)  # nothing pending: cell 0 with its own value
    assert (cells == 0).all() and (values == 5).all()


def test_more_changes_than_a_step_carries_are_uploaded_at_once() -> None:
    table = own_table()
    table.fold()
    table.apply(changes([0, 1], [0, 0], [3, 2], [1, 2, 3, 4, 5]))
    cells, values = np.empty(4, dtype=np.int64), np.empty(4, dtype=np.int64)
    table.take(cells, values)
    np.testing.assert_array_equal(device(table), table.host)
    assert (cells == 0).all() and (values == 1).all()  # padding alone


def test_a_flush_uploads_what_no_launcher_took() -> None:
    table = own_table()
    table.fold()
    table.apply(changes([3], [0], [2], [4, 8]))
    table.flush()
    np.testing.assert_array_equal(device(table), table.host)
    cells, values = np.empty(2, dtype=np.int64), np.empty(2, dtype=np.int64)
    table.take(cells, values)
    assert (cells == 0).all()  # nothing left to take: padding alone
