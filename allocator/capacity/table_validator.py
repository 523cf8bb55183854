"""`TableValidator`: a device-side check of the block table against what a step will address.

Before a forward, an engine's attention reads every position below a request's history and its
KV writes land at the step's own positions; each such position must fall in a block the row
holds. Where it does not, the block-table entry is -1 (or the position lies past the row) and a
real kernel reads or writes out of bounds: the illegal memory access kvalloc's accounting rules
out. TensorRT-LLM's debug validator made this check in the original report; this one counts
violations on the device, so it never synchronises and can stay on in long runs. Off by
default (it costs a few small kernels per step).

A model whose every layer slides reads, for its first query at position ``history``, no key
below ``history - window + 1``: the columns wholly below it are never addressed, and a windowed
pool may have given their blocks back (`block_table.RELEASED`). A validator made with that
``window`` starts each row's check at the window's first column; without one it checks the
whole history.
"""

from __future__ import annotations

import torch


class TableValidator:
    def __init__(self, device: torch.device, window: int | None = None) -> None:
        """``window``: the widest sliding window of a model whose every layer slides (None: a
        layer reads its whole history)."""
        self.violations = torch.zeros((), dtype=torch.int64, device=device)
        self.window = window

    def check(self, table: torch.Tensor, rows: torch.Tensor, history: torch.Tensor,
              reach: torch.Tensor, tokens_per_block: int) -> None:
        """Count the entries of ``table[rows[e]]`` that positions ``first .. reach[e] - 1``
        address and that hold no block, plus the positions' blocks past the row's end;
        ``first`` is 0, or with a window the first key the query at ``history[e]`` reads. An
        entry on a row past the table's (a padded one, on a worker's spare row) addresses
        nothing and counts nothing: device work only, so a captured step checks each replay."""
        height, width = table.shape
        padded = rows >= height
        needed = torch.where(padded, 0, (reach + tokens_per_block - 1) // tokens_per_block)
        cols = torch.arange(width, device=table.device)
        holes = (cols < needed[:, None]) & (table[rows.clamp(max=height - 1)] < 0)
        if self.window is not None:
            first = (history - self.window + 1).clamp(min=0) // tokens_per_block
            holes &= cols >= first[:, None]
        self.violations += holes.sum() + (needed - width).clamp(min=0).sum()

    def count(self) -> int:
        """Violations so far (a read back: a synchronisation on CUDA)."""
        return int(self.violations)
