"""`step_metadata`: what a step's forward needs per token, computed on the device.

From the reply's columns (uploaded once) and the rows' device state, without reading anything
back: each entry's ``history`` (its start, plus its lead when it is behind a step the host has
not read), each packed token's ``position`` and pool ``slot`` (from the shared block table by
the slot rule, `allocator.capacity.slots.padded_slot_mapping`: -1 past the row's blocks, and for
an entry on the spare row one past the table's, a padded one: `worker.step.rows`), and the
``ids`` the forward reads (the host's, except a decode's first token: its request's pending
token, which only the device knows on an overlap worker).

`metadata_reference` states it in torch (any device: a few dozen tiny operations);
`metadata_triton` is the same as one launch of `worker.kernels.step_metadata`, which is what
keeps a step's host time to a few microseconds on a GPU. Tests compare the two in Triton's
interpreter.
"""

from __future__ import annotations

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


class StepMetadata(NamedTuple):
    history: torch.Tensor  # [R]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]
    ids: torch.Tensor  # [N]
    index: torch.Tensor  # [N]: each token's place in its entry


def metadata_reference(cols: EntryColumns, lead: torch.Tensor, pending: torch.Tensor,
                       table: torch.Tensor, tokens_per_block: int) -> StepMetadata:
    history = cols.starts + cols.behind * lead[cols.rows]
    e = cols.token_entry
    index = torch.arange(e.numel(), device=e.device) - cols.offsets[e]
    positions = history[e] + index
    rows = cols.rows[e]
    slots = padded_slot_mapping(table, rows, positions, tokens_per_block)
    first = (index == 0) & (cols.decoding[e] != 0)
    ids = torch.where(first, pending[rows], cols.host_ids)
    return StepMetadata(history, positions, slots, ids, index)


def step_metadata(cols: EntryColumns, lead: torch.Tensor, pending: torch.Tensor,
                  table: torch.Tensor, tokens_per_block: int, *,
                  backend: Literal["auto", "torch", "triton"] = "auto") -> StepMetadata:
    """`metadata_reference`, as one Triton launch on CUDA (``auto``) or in Triton's
    interpreter on CPU tensors (``triton``)."""
    if resolve_backend(backend, table.device) == "torch":
        return metadata_reference(cols, lead, pending, table, tokens_per_block)
    return metadata_triton(cols, lead, pending, table, tokens_per_block)


def metadata_triton(cols: EntryColumns, lead: torch.Tensor, pending: torch.Tensor,
                    table: torch.Tensor, tokens_per_block: int) -> StepMetadata:
    """`metadata_reference` in one launch (Triton's interpreter for CPU tensors)."""
    from kvalloc.worker.kernels import step_metadata as kernels

    n = cols.token_entry.numel()
    history = torch.empty_like(cols.starts)
    positions, slots, ids, index = (torch.empty_like(cols.host_ids) for _ in range(4))
    if n:
        kernel = kernel_for(kernels.metadata_jit, table)
        kernel[(-(-n // kernels.BLOCK),)](
            cols.rows, cols.offsets, cols.starts, cols.behind, cols.decoding, cols.token_entry,
            cols.host_ids, lead, pending, table, history, positions, slots, ids, index, n,
            table.shape[0], table.shape[1], TOKENS_PER_BLOCK=tokens_per_block,
            BLOCK=kernels.BLOCK)
    return StepMetadata(history, positions, slots, ids, index)
