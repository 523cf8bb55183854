"""`step_metadata`: what a step's forward needs per token, computed on the device.

From the reply's columns (uploaded once) and the rows' device state, without reading anything
back: each entry's ``history`` (its start, plus its lead when it is behind a step the host has
not read), each packed token's ``position`` and pool ``slot`` in every group of the pool (from
the group's block table by the slot rule, `allocator.capacity.slots.padded_slot_mapping`: -1
past the row's blocks, and for an entry on the spare row one past the table's, a padded one:
`worker.step.rows`), and the ``ids`` the forward reads (the host's, except a decode's first
token: its request's pending token, which only the device knows on an overlap worker).

`metadata_reference` states it in torch (any device: a few dozen tiny operations);
`metadata_triton` is the same as one launch of `worker.kernels.step_metadata` (one more per
further group, its slots alone), which is what
keeps a step's host time to a few microseconds on a GPU. Tests compare the two in Triton's
interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from kvalloc.allocator import padded_slot_mapping, resolve_backend
from kvalloc.worker.kernels.helpers import kernel_for


class EntryColumns(NamedTuple):
    """Per entry ``[R]`` and per token ``[N]`` columns on the device (int64)."""

    rows: torch.Tensor
    offsets: torch.Tensor
    starts: torch.Tensor
    behind: torch.Tensor  # 1: the history starts ``lead[row]`` later
    decoding: torch.Tensor  # 1: a decode, whose first token is the row's pending one
    token_entry: torch.Tensor  # [N]
    host_ids: torch.Tensor  # [N]


class GroupTable(NamedTuple):
    """One group's block table (int32 ``[rows, columns]``) and the tokens each block holds."""

    table: torch.Tensor
    tokens_per_block: int


class StepMetadata(NamedTuple):
    history: torch.Tensor  # [R]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [G, N]: each token's slot in group g's pool
    ids: torch.Tensor  # [N]
    index: torch.Tensor  # [N]: each token's place in its entry


def metadata_reference(cols: EntryColumns, lead: torch.Tensor, pending: torch.Tensor,
                       tables: Sequence[GroupTable]) -> StepMetadata:
    history = cols.starts + cols.behind * lead[cols.rows]
    e = cols.token_entry
    index = torch.arange(e.numel(), device=e.device) - cols.offsets[e]
    positions = history[e] + index
    rows = cols.rows[e]
    slots = torch.stack([padded_slot_mapping(table, rows, positions, tokens_per_block)
                         for table, tokens_per_block in tables])
    first = (index == 0) & (cols.decoding[e] != 0)
    ids = torch.where(first, pending[rows], cols.host_ids)
    return StepMetadata(history, positions, slots, ids, index)


def step_metadata(cols: EntryColumns, lead: torch.Tensor, pending: torch.Tensor,
                  tables: Sequence[GroupTable], *,
                  backend: Literal["auto", "torch", "triton"] = "auto") -> StepMetadata:
    """`metadata_reference`, as one Triton launch per group on CUDA (``auto``) or in Triton's
    interpreter on CPU tensors (``triton``)."""
    if resolve_backend(backend, tables[0].table.device) == "torch":
        return metadata_reference(cols, lead, pending, tables)
    return metadata_triton(cols, lead, pending, tables)


def metadata_triton(cols: EntryColumns, lead: torch.Tensor, pending: torch.Tensor,
                    tables: Sequence[GroupTable]) -> StepMetadata:
    """`metadata_reference` in one launch per group (Triton's interpreter for CPU tensors): the
    first group's launch stores every column, each other group's its slots alone."""
    from kvalloc.worker.kernels import step_metadata as kernels

    n = cols.token_entry.numel()
    history = torch.empty_like(cols.starts)
    positions, ids, index = (torch.empty_like(cols.host_ids) for _ in range(3))
    slots = cols.host_ids.new_empty((len(tables), n))
    for g, (table, tokens_per_block) in enumerate(tables):
        if not n:
            break
        kernel = kernel_for(kernels.metadata_jit, table)
        kernel[(-(-n // kernels.BLOCK),)](
            cols.rows, cols.offsets, cols.starts, cols.behind, cols.decoding, cols.token_entry,
            cols.host_ids, lead, pending, table, history, positions, slots[g], ids, index, n,
            table.shape[0], table.shape[1], TOKENS_PER_BLOCK=tokens_per_block,
            BLOCK=kernels.BLOCK, ENTRY=g == 0)
    return StepMetadata(history, positions, slots, ids, index)
