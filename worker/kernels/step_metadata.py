"""The step-metadata kernel (Triton). Imported only where Triton is installed; its reference is
`worker.step.step_metadata.metadata_reference`, its launch
`worker.step.step_metadata.metadata_triton`.

Program ``p`` handles packed tokens ``p * BLOCK ..``: it finds each token's entry, the entry's
history (its first token's program also stores it), the token's position, its slot through the
entry's block-table row (the slot rule of `allocator.capacity.slots`, with -1 for a row past the
table: a padded entry's spare row), and its input id. ``ENTRY`` False stores the slots alone: a
grouped pool's further groups, whose tables differ but whose entries are the first group's.

The function is plain Python: `metadata_jit` is it compiled for a GPU; for CPU tensors the
launch runs it in Triton's interpreter (`worker.kernels.helpers.kernel_for`).

No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr`` annotations as
objects, not strings.
"""

import triton
import triton.language as tl

BLOCK = 128  # packed tokens a program handles


def _metadata(rows_ptr, offsets_ptr, starts_ptr, behind_ptr, decoding_ptr, entry_ptr,
              host_ids_ptr, lead_ptr, pending_ptr, table_ptr, history_ptr, positions_ptr,
              slots_ptr, ids_ptr, index_ptr, num_tokens, table_rows, table_width,
              TOKENS_PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr, ENTRY: tl.constexpr):
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
    tl.store(slots_ptr + t, slot, mask=live)
    if ENTRY:
        tl.store(positions_ptr + t, position, mask=live)
        tl.store(ids_ptr + t, ids, mask=live)
        tl.store(index_ptr + t, index, mask=live)
        tl.store(history_ptr + e, history, mask=live & (index == 0))


metadata_jit = triton.jit(_metadata)
