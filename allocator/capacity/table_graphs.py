"""`TableUploadGraphs`: a block-table sync on CUDA as one CUDA graph replay.

A sync sends the changed cells and their values to the device and scatters them into the
table. Launched one by one (wait, copy, record, two views, the scatter) that is a hundred
microseconds and more of host time a step on a slow host, for next to no device time; captured
(`PinnedGraphs`), one replay.

The graph of ``rows`` rows (a power of two at least the changed cells, from `MIN_ROWS` to
`MAX_ROWS`) copies ``[cells | values]`` over, ``rows`` int64 flat cell indices then ``rows``
int32 values, and scatters them into the table through a flat view: the table keeps its shape
and address, which workers that map it rely on. The rows past the changed cells repeat the
first (cell, value) pair, so they write to that cell the value its first row writes: the padding
changes nothing, whatever order the scatter runs in. (The scatter has no index it skips, and an
index out of the table is a device assert; a cell changed twice since the last sync appears
twice, harmless in the same way, both carrying the host's value at sync time.)

``capture_all`` captures every bucket ahead of the first sync (a `BlockTable` does so when it is
made): each warm-up writes cell 0's own value into cell 0, every row of it, so it changes nothing.
A bucket captured on first use instead (graphs used without ``capture_all``) warms up over the
sync's own input, so it writes exactly what the replay writes next.

A sync of more than `MAX_ROWS` cells (many rows released at once) is rare: it, and every sync
after a capture failed, runs the eager path.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np
import torch
from kvalloc.allocator.common.pinned_graphs import PinnedGraphs, bucket, bucket_sizes
from kvalloc.allocator.errors import InvalidValue

log = logging.getLogger(__name__)

MIN_ROWS = 64  # the smallest bucket: the usual step's tens of cells share one graph
MAX_ROWS = 4096  # the largest bucket, 48 KiB of input: far past a usual step's changes
_CELL = np.dtype(np.int64).itemsize
_ROW_BYTES = _CELL + np.dtype(np.int32).itemsize
_FIRST_CELL = np.zeros(1, dtype=np.int64)  # what a warm-up ahead of the first sync writes


def rows_for(cells: int, max_rows: int = MAX_ROWS) -> int | None:
    """The bucket a sync of ``cells`` changed cells replays, or None past ``max_rows``."""
    rows = bucket(cells, MIN_ROWS)
    return rows if rows <= max_rows else None


def pack(out: np.ndarray, rows: int, cells: np.ndarray, table_cells: np.ndarray) -> None:
    """Write ``[cells | values]`` into the bytes ``out``: the changed flat ``cells`` (one to
    ``rows`` of them) and their values in ``table_cells`` (the flat host table), each padded to
    ``rows`` entries by repeating the first pair."""
    index = out[: _CELL * rows].view(np.int64)
    index[: cells.size] = cells
    index[cells.size:] = cells[0]
    np.take(table_cells, index, out=out[_CELL * rows: _ROW_BYTES * rows].view(np.int32))


class TableUploadGraphs(PinnedGraphs):
    def __init__(self, table: torch.Tensor, *, max_rows: int = MAX_ROWS,
                 max_graphs: int = 16) -> None:
        """Graphs that write the contiguous int32 CUDA tensor ``table`` in place."""
        if table.device.type != "cuda" or table.dtype != torch.int32 or not table.is_contiguous():
            raise InvalidValue(
                "block_table: upload graphs write a contiguous int32 CUDA tensor, not a "
                f"{'' if table.is_contiguous() else 'non-contiguous '}{table.dtype} one on "
                f"{table.device}", field="block_table")
        super().__init__(_ROW_BYTES * max_rows, table.device, max_graphs=max_graphs, log=log,
                         failure="block table: capturing the upload failed; syncing without a "
                                 "graph from now on")
        self.max_rows = max_rows
        self._flat = table.view(-1)
        self._scratch = torch.empty(_ROW_BYTES * max_rows, dtype=torch.uint8,
                                    device=table.device)

    def upload(self, cells: np.ndarray, table_cells: np.ndarray) -> bool:
        """Write ``table_cells[cells]`` into the device table's flat ``cells`` by replaying a
        graph (captured now if new); False if there is none for that many cells and the caller
        must upload eagerly."""
        if cells.size == 0:
            return True
        rows = rows_for(cells.size, self.max_rows)
        if rows is None:
            return False

        def fill(out: np.ndarray) -> None:
            pack(out, rows, cells, table_cells)

        return self.replay(rows, lambda: self._body(rows), fill, warmup_fill=fill)

    @property
    def buckets(self) -> list[int]:
        """The rows of every graph a sync may replay, ascending."""
        return bucket_sizes(MIN_ROWS, self.max_rows)

    def capture_all(self, table_cells: np.ndarray) -> bool:
        """Capture the graph of every bucket now, so that no sync captures one. The device table
        must hold ``table_cells`` (the flat host table) in its cell 0, as it does once synced:
        each warm-up writes that value there, and nothing else. False if a capture failed (now
        or before), and the caller uploads eagerly."""
        return all(self.capture(rows, partial(self._body, rows), warmup_fill=partial(
            pack, rows=rows, cells=_FIRST_CELL, table_cells=table_cells)) for rows in self.buckets)

    def _body(self, rows: int) -> None:
        packed = self._scratch[: _ROW_BYTES * rows]
        packed.copy_(self.pinned[: _ROW_BYTES * rows], non_blocking=True)
        self._flat.index_copy_(0, packed[: _CELL * rows].view(torch.int64),
                               packed[_CELL * rows:].view(torch.int32))
