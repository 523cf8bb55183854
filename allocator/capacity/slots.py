"""The slot rule, for any holder of a block table: ``slot = table[row, pos // tpb] * tpb +
pos % tpb``, int64, and -1 where a position is padding (< 0) or lies past its row's blocks, so a
bad position skips its write instead of faulting.

`BlockTable` applies it to its own copies; a worker that mapped the service's shared table calls
`slot_mapping` on it directly, on the table's device, with no round trip to the service.
"""

from __future__ import annotations

import torch


def slot_mapping(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                 tokens_per_block: int) -> torch.Tensor:
    """int64 slots of ``positions`` in block-table ``rows`` (same-length integer tensors on the
    table's device; ``table`` is int32 ``[max_batch_size, max_blocks_per_seq]``)."""
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
