"""A step's metadata: the Triton kernel equals its torch reference (in Triton's interpreter on
CPU, compiled on a GPU), the reference says what it should on a worked example, and the
kernel's slots are the allocator's slot rule (`allocator.capacity.slots.slots_reference`), a
row past the table holding no block, in every group of a grouped pool (each its own table and
block size; a windowed group's given-back columns hold no block either)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.allocator.capacity.slots import slots_reference
from kvalloc.worker.step.step_metadata import (
    EntryColumns,
    GroupTable,
    metadata_reference,
    step_metadata,
)
from triton_interpreter import needs_triton_interpreter

TOKENS_PER_BLOCK = 4


def _table(rng: np.random.Generator, rows_in_table: int, width: int) -> torch.Tensor:
    """Rows holding a few blocks each (-1 past them), a windowed group's leading ones given
    back (-2) in some."""
    table = torch.full((rows_in_table, width), -1, dtype=torch.int32)
    for row in range(rows_in_table):
        held = int(rng.integers(0, width + 1))
        table[row, :held] = torch.from_numpy(rng.permutation(64)[:held].astype(np.int32))
        table[row, :int(rng.integers(0, held + 1))] = RELEASED
    return table


def _layout(rng: np.random.Generator, device: str) -> tuple:
    """Random entries over the tables of one to three groups (their block sizes differ), some
    entries behind an unread step, some reaching past their row's blocks, some on the spare
    row."""
    rows_in_table = 8
    tables = [GroupTable(_table(rng, rows_in_table, width).to(device), per_block)
              for width, per_block in [(6, TOKENS_PER_BLOCK), (3, 8), (12, 2)][
                  :int(rng.integers(1, 4))]]
    r = int(rng.integers(1, rows_in_table + 1))
    rows = rng.permutation(rows_in_table)[:r]
    rows = np.concatenate([rows, np.full(int(rng.integers(0, 3)), rows_in_table)])
    r = rows.size
    num_tokens = rng.integers(1, 9, r)
    offsets = np.cumsum(num_tokens) - num_tokens
    cols = EntryColumns(*(torch.as_tensor(a, dtype=torch.int64, device=device) for a in (
        rows, offsets, rng.integers(0, 20, r), rng.integers(0, 2, r), rng.integers(0, 2, r),
        np.repeat(np.arange(r), num_tokens), rng.integers(0, 1000, int(num_tokens.sum())))))
    lead = torch.as_tensor(rng.integers(0, 4, rows_in_table + 1), device=device)
    pending = torch.as_tensor(rng.integers(1000, 2000, rows_in_table + 1), device=device)
    return cols, lead, pending, tables


def test_the_reference_on_a_worked_example() -> None:
    table = torch.tensor([[5, 9, -1], [2, -1, -1]], dtype=torch.int32)
    # A second group's table, blocks of 8: row 0's first block given back behind a window.
    windowed = torch.tensor([[RELEASED, 4], [6, -1]], dtype=torch.int32)
    # Entry 0: a decode of row 0 behind an unread step (lead 2), 3 tokens from start 3.
    # Entry 1: a prefill chunk of row 1, 2 tokens from start 3 (its second block: none).
    # Entry 2: a padded decode on the spare row 2, past the table: no slots.
    cols = EntryColumns(*(torch.tensor(a) for a in (
        [0, 1, 2], [0, 3, 5], [3, 3, 0], [1, 0, 0], [1, 0, 1], [0, 0, 0, 1, 1, 2, 2],
        [0, 70, 71, 80, 81, 0, 0])))
    meta = metadata_reference(cols, torch.tensor([2, 7, 0]), torch.tensor([42, 43, 44]),
                              [GroupTable(table, 4), GroupTable(windowed, 8)])
    assert meta.history.tolist() == [5, 3, 0]
    assert meta.positions.tolist() == [5, 6, 7, 3, 4, 0, 1]
    assert meta.slots.tolist() == [[37, 38, 39, 11, -1, -1, -1],
                                   [-1, -1, -1, 51, 52, -1, -1]]
    assert meta.ids.tolist() == [42, 70, 71, 80, 81, 44, 0]


@needs_triton_interpreter
@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_is_the_reference_in_the_interpreter(seed: int) -> None:
    cols, lead, pending, tables = _layout(np.random.default_rng(seed), "cpu")
    want = metadata_reference(cols, lead, pending, tables)
    got = step_metadata(cols, lead, pending, tables, backend="triton")
    for name, a, b in zip(want._fields, want, got, strict=True):
        assert torch.equal(a, b), name


@needs_triton_interpreter
def test_the_kernels_slots_are_the_slot_rule_in_the_interpreter() -> None:
    """Over random tables with -1 past each row's blocks, entries reaching past them and entries
    on the spare row: the slot rule's numpy specification, over the table with a row of -1 for
    the spare one (which the cases do draw, as they draw -1 slots on the table's own rows)."""
    rng = np.random.default_rng(100)
    spare_rows = unwritable = groups = 0
    for _ in range(8):
        cols, lead, pending, tables = _layout(rng, "cpu")
        got = step_metadata(cols, lead, pending, tables, backend="triton")
        rows = cols.rows[cols.token_entry].numpy()
        assert got.slots.shape == (len(tables), rows.size)
        for (table, per_block), slots in zip(tables, got.slots, strict=True):
            spare = np.full((1, table.shape[1]), -1, dtype=np.int32)
            want = slots_reference(np.concatenate([table.numpy(), spare]), rows,
                                   got.positions.numpy(), per_block)
            np.testing.assert_array_equal(slots.numpy(), want)
            unwritable += int(((want == -1) & (rows < table.shape[0])).sum())
        spare_rows += int((rows == tables[0].table.shape[0]).sum())
        groups += len(tables) > 1
    assert spare_rows and unwritable and groups


@pytest.mark.gpu
def test_the_compiled_kernel_is_the_reference(cuda_device: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(50):
        cols, lead, pending, tables = _layout(rng, cuda_device)
        want = metadata_reference(cols, lead, pending, tables)
        got = step_metadata(cols, lead, pending, tables)
        for name, a, b in zip(want._fields, want, got, strict=True):
            assert torch.equal(a, b), name
