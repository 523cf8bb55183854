"""`metadata_triton`: `worker.step.step_metadata.metadata_reference` as one Triton launch.

Program ``p`` handles packed tokens ``p * BLOCK ..``: it finds each token's entry, the entry's
history (its first token's program also stores it), the token's position, its slot through the
entry's block-table row, and its input id. Imported only when the Triton backend is used.

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

from functools import cache

import torch
import triton
import triton.language as tl

from worker.step.step_metadata import EntryColumns, StepMetadata

BLOCK = 128


def _metadata(rows_ptr, offsets_ptr, starts_ptr, behind_ptr, decoding_ptr, entry_ptr,
              host_ids_ptr, lead_ptr, pending_ptr, table_ptr, history_ptr, positions_ptr,
              slots_ptr, ids_ptr, index_ptr, num_tokens, table_rows, table_width,
              TOKENS_PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = t < num_tokens
    e = tl.load(entry_ptr + t, mask=live, other=0)
    row = tl.load(rows_ptr + e, mask=live, other=0)
    history = tl.load(starts_ptr + e, mask=live, other=0) + tl.load(
        behind_ptr + e, mask=live, other=0) * tl.load(lead_ptr + row, mask=live, other=0)
    index = t - tl.load(offsets_ptr + e, mask=live, other=0)
    position = history + index
    col = position // TOKENS_PER_BLOCK
    in_row = (col < table_width) & (row < table_rows)
    block = tl.load(table_ptr + row * table_width + col, mask=live & in_row,
                    other=-1).to(tl.int64)
    slot = tl.where(in_row & (block >= 0),
                    block * TOKENS_PER_BLOCK + position % TOKENS_PER_BLOCK, -1)
    first = (index == 0) & (tl.load(decoding_ptr + e, mask=live, other=0) != 0)
    pending = tl.load(pending_ptr + row, mask=live & first, other=0)
    ids = tl.where(first, pending, tl.load(host_ids_ptr + t, mask=live, other=0))
    tl.store(positions_ptr + t, position, mask=live)
    tl.store(slots_ptr + t, slot, mask=live)
    tl.store(ids_ptr + t, ids, mask=live)
    tl.store(index_ptr + t, index, mask=live)
    tl.store(history_ptr + e, history, mask=live & (index == 0))


_metadata_jit = triton.jit(_metadata)


@cache
def _interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_metadata)


def metadata_triton(cols: EntryColumns, lead: torch.Tensor, pending: torch.Tensor,
                    table: torch.Tensor, tokens_per_block: int) -> StepMetadata:
    n = cols.token_entry.numel()
    history = torch.empty_like(cols.starts)
    positions, slots, ids, index = (torch.empty_like(cols.host_ids) for _ in range(4))
    if n:
        kernel = _metadata_jit if table.is_cuda else _interpreted()
        kernel[(triton.cdiv(n, BLOCK),)](
            cols.rows, cols.offsets, cols.starts, cols.behind, cols.decoding, cols.token_entry,
            cols.host_ids, lead, pending, table, history, positions, slots, ids, index, n,
            table.shape[0], table.shape[1], TOKENS_PER_BLOCK=tokens_per_block, BLOCK=BLOCK)
    return StepMetadata(history, positions, slots, ids, index)
