"""The slot rule, for any holder of a block table: ``slot = table[row, pos // tpb] * tpb +
pos % tpb``, int64, and -1 where a position is padding (< 0), lies past the table's width or
falls in a column that holds -1 (past its row's blocks), so a bad position skips its write
instead of faulting.

One rule, three implementations, tested against each other:

- `slots_reference`: the specification in numpy, one token at a time (a host table);
- `run_slots`: the same compiled (numba), over runs of consecutive positions, which is how a
  step schedules its tokens: one table read per block instead of one per token
  (`run_slots_reference` states it through the specification);
- `slot_mapping`: in torch, on the table's device: a worker that mapped the service's shared
  table calls it directly, with no round trip to the service; `padded_slot_mapping` is the same
  where a row may lie past the table (a worker's spare row, which pads a batch and holds no
  block: every slot -1).
"""

from __future__ import annotations

import numpy as np
import torch
from kvalloc.allocator.common.jit import jit, numba


def slots_reference(table: np.ndarray, rows: np.ndarray, positions: np.ndarray,
                    tokens_per_block: int) -> np.ndarray:
    """int64 slots of ``positions`` in ``table``'s ``rows`` (same-length integer arrays)."""
    positions = np.asarray(positions, dtype=np.int64)
    valid = positions >= 0
    column = np.where(valid, positions // tokens_per_block, 0)
    in_row = column < table.shape[1]
    block = table[rows, np.where(in_row, column, 0)].astype(np.int64)
    keep = valid & in_row & (block >= 0)
    return np.where(keep, block * tokens_per_block + positions % tokens_per_block, -1)


def run_slots_reference(table: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                        num_tokens: np.ndarray, tokens_per_block: int) -> np.ndarray:
    """Slots of runs of tokens, concatenated: run ``i`` is ``num_tokens[i]`` (>= 0) tokens at
    positions ``starts[i]``, ``starts[i] + 1``, ... of row ``rows[i]``."""
    run = np.repeat(np.arange(rows.size), num_tokens)
    first = np.cumsum(num_tokens) - num_tokens
    positions = starts[run] + np.arange(run.size) - first[run]
    return slots_reference(table, rows[run], positions, tokens_per_block)


def _run_slots_loop(table, rows, starts, num_tokens,  # type: ignore[no-untyped-def]
                    tokens_per_block):  # pragma: no cover
    # Compiled by numba; `run_slots_reference` states what it computes.
    out = np.empty(num_tokens.sum(), np.int64)
    width = table.shape[1]
    t = 0
    for i in range(rows.size):
        position, end = starts[i], starts[i] + num_tokens[i]
        while position < min(end, 0):  # padding
            out[t] = -1
            t += 1
            position += 1
        while position < end:  # the tokens of one block at a time: one read, no division
            column = position // tokens_per_block
            within = position - column * tokens_per_block
            count = min(tokens_per_block - within, end - position)
            block = table[rows[i], column] if column < width else -1
            for k in range(count):
                out[t] = block * tokens_per_block + within + k if block >= 0 else -1
                t += 1
            position += count
    return out


# A dozen whole-batch array operations over every scheduled token a step otherwise.
run_slots = jit(_run_slots_loop) if numba is not None else run_slots_reference


def slot_mapping(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                 tokens_per_block: int) -> torch.Tensor:
    """`slots_reference` on the table's device: ``rows`` and ``positions`` same-length integer
    tensors there, ``table`` int32 ``[max_batch_size, max_blocks_per_seq]``."""
    positions = positions.to(torch.int64)
    valid = positions >= 0
    safe_pos = torch.where(valid, positions, torch.zeros_like(positions))
    col = safe_pos // tokens_per_block
    in_row = col < table.shape[1]
    col = torch.where(in_row, col, torch.zeros_like(col))
    block = table[rows.to(torch.int64), col].to(torch.int64)
    slot = block * tokens_per_block + safe_pos % tokens_per_block
    keep = valid & in_row & (block >= 0)
    return torch.where(keep, slot, torch.full_like(slot, -1))


def padded_slot_mapping(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                        tokens_per_block: int) -> torch.Tensor:
    """`slot_mapping`, with -1 for a row at or past ``table.shape[0]``: a row no table holds,
    such as the spare row a worker pads its batches with, has no blocks."""
    in_table = rows < table.shape[0]
    slots = slot_mapping(table, torch.where(in_table, rows, 0), positions, tokens_per_block)
    return torch.where(in_table, slots, -1)
