"""`BlockTable`: int32 ``[max_batch_size, max_blocks_per_seq]`` block ids, host + device copies.

Invariants (checked by ``check_invariants`` against the counts the caller owns):
- row r holds valid block ids in columns ``[released[r], num_blocks[r])`` and ``-1`` beyond: a
  kernel that reads a ``-1`` entry as a block ordinal addresses memory below the pool, so nothing
  past a request's blocks is ever anything but -1;
- columns ``[0, released[r])`` hold `RELEASED`: a windowed group (`capacity.windows`) gave their
  blocks back because no step reads them any more. Always none under full attention. It is not
  -1 (that is "not yet allocated", what an append past capacity hits) so that a dump tells the
  two apart; a kernel never reads either: a windowed layer's reads start at its window's first
  block, and the slot rule writes nothing into a negative entry;
- a row is either held (acquired, not released) or on the free-row stack, exactly once;
- after ``sync()`` every device copy equals the host mirror, except in the rows a worker keeps
  (``worker_kept``): rows whose changes a ``sync()`` inside ``left_to_worker()`` did not upload,
  because the worker they belong to keeps its own device copy of them from its steps'
  `TableChanges` (an overlap worker: then the service does no device work on its calls). Nothing
  reads such a row on the shared copies until a ``sync()`` outside uploads a change to it, and
  that sync sends the whole row.

Only the cells changed since the last ``sync()`` travel to the device: a step touches the tail
of a few rows (tens of cells), not whole 2049-wide rows. On CUDA they travel by replaying a
captured graph (`table_graphs`; every bucket captured when the table is made, so the first
steps replay like the rest), or, past its largest bucket or where capture fails, by the eager
path it replays. The device copy comes from a `placement.TensorAllocator`, so a service can hand
out a table other processes map.

A tensor-parallel service keeps one copy per shard's device (``mirror``): each sync sends the
same changed cells to every copy, one upload per device and nothing per layer, so every shard
reads the same block ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from kvalloc.allocator.capacity.slots import slot_mapping
from kvalloc.allocator.capacity.table_graphs import TableUploadGraphs
from kvalloc.allocator.common.device_io import PinnedUploads, on_device
from kvalloc.allocator.common.placement import TensorAllocator, plain_tensor
from kvalloc.allocator.errors import BatchFull, InvalidValue, InvariantViolation

# A column whose block a windowed group gave back (behind every window still read).
RELEASED = -2


class BlockTable:
    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device, *,
                 allocate: TensorAllocator = plain_tensor, upload_graphs: bool = True) -> None:
        """``upload_graphs=False`` makes every CUDA sync take the eager path."""
        self.max_batch_size = max_batch_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        shape = (max_batch_size, max_blocks_per_seq)
        self.host = np.full(shape, -1, dtype=np.int32)
        self.device_table = allocate("block_table", shape, torch.int32, device)
        self.device_table.fill_(-1)
        self._host_cells = self.host.reshape(-1)  # views: cell = row * max_blocks_per_seq + col
        # Free rows as a stack (``free_rows[:num_free_rows]``, top at the end), row 0 on top;
        # the compiled step pushes and pops on it directly.
        self.free_rows = np.arange(max_batch_size - 1, -1, -1, dtype=np.int64)
        self.num_free_rows = max_batch_size
        # Flat indices of the cells changed since the last sync, one array per change.
        self._changed: list[np.ndarray] = []
        self.worker_kept = np.zeros(max_batch_size, dtype=bool)  # see the module's invariants
        self._left_to_worker = False
        self._upload_graphs = upload_graphs
        self._copies = [DeviceCopy(self.device_table, self._host_cells, upload_graphs)]
        self.upload_graphs = self._copies[0].graphs

    def mirror(self, device: torch.device, allocate: TensorAllocator, name: str) -> torch.Tensor:
        """Another device copy of the table, on ``device``, that every sync from now on keeps
        equal to the host mirror (a tensor-parallel shard's); it starts as the host is now."""
        with on_device(device):  # its graphs are captured on its own device
            tensor = allocate(name, (self.max_batch_size, self.max_blocks_per_seq),
                              torch.int32, device)
            tensor.copy_(torch.from_numpy(self.host))
            self._copies.append(DeviceCopy(tensor, self._host_cells, self._upload_graphs,
                                           own_device=device != self.device))
        return tensor

    @property
    def device_tables(self) -> list[torch.Tensor]:
        """Every device copy: the table's own first, then its mirrors in the order made."""
        return [copy.tensor for copy in self._copies]

    def acquire_row(self) -> int:
        if self.num_free_rows == 0:
            raise BatchFull(f"req_id: all {self.max_batch_size} block-table rows are in use")
        self.num_free_rows -= 1
        return int(self.free_rows[self.num_free_rows])

    def release_row(self, row: int) -> None:
        if (self.free_rows[: self.num_free_rows] == row).any():
            raise InvalidValue(f"row: {row} is not held", field="row")
        held = np.flatnonzero(self.host[row] != -1)
        if held.size:
            self.host[row] = -1
            self.mark_changed(np.array([row]), np.array([0]), np.array([held[-1] + 1]))
        self.free_rows[self.num_free_rows] = row
        self.num_free_rows += 1

    def append(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
               block_ids: np.ndarray) -> None:
        """Write ``block_ids`` (concatenated per row) into columns ``starts[i]`` onwards."""
        if block_ids.size == 0:
            return
        r, c = _ragged_cells(rows, starts, counts)
        self.host[r, c] = block_ids
        self.mark_changed(rows, starts, starts + counts)

    def truncate(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Clear ``counts[i]`` columns from ``starts[i]`` to -1; return the block ids removed."""
        r, c = _ragged_cells(rows, starts, counts)
        removed = self.host[r, c].copy()
        self.host[r, c] = -1
        self.mark_changed(rows, starts, starts + counts)
        return removed

    def release_leading(self, rows: np.ndarray, starts: np.ndarray,
                        ends: np.ndarray) -> np.ndarray:
        """Mark columns ``[starts[i], ends[i])`` of ``rows[i]`` `RELEASED`; return the block ids
        they held."""
        r, c = _ragged_cells(rows, starts, ends - starts)
        removed = self.host[r, c].copy()
        self.host[r, c] = RELEASED
        self.mark_changed(rows, starts, ends)
        return removed

    def mark_changed(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Record that host cells ``[starts[i], ends[i])`` of ``rows[i]`` changed."""
        if rows.size:
            r, c = _ragged_cells(rows, starts, ends - starts)
            self.mark_cells(r * self.max_blocks_per_seq + c)

    def mark_cells(self, cells: np.ndarray) -> None:
        """Record changed cells by flat index ``row * max_blocks_per_seq + column`` (for a writer
        that changes ``host`` directly, like the compiled step)."""
        if cells.size:
            self._changed.append(cells)

    @contextlib.contextmanager
    def left_to_worker(self) -> Iterator[None]:
        """Syncs inside upload nothing: the rows they changed become ``worker_kept``, their
        worker's to bring up to date on its own copy (one worker's step: all its changes are
        that worker's rows). Changes made before are uploaded first: they may be anyone's."""
        self.sync()
        self._left_to_worker = True
        try:
            yield
        finally:
            self._left_to_worker = False

    def sync(self) -> None:
        """Upload the cells changed since the last sync (non-blocking from pinned memory on
        CUDA), and the whole of every ``worker_kept`` row among them (no longer kept)."""
        if not self._changed:
            return
        cells = self._changed[0] if len(self._changed) == 1 else np.concatenate(self._changed)
        self._changed.clear()
        if self._left_to_worker:
            self.worker_kept[cells // self.max_blocks_per_seq] = True
            return
        if self.worker_kept.any():  # only a service with such workers pays for the look-up
            cells = self._with_kept_rows(cells)
        for copy in self._copies:
            copy.write(cells, self._host_cells)

    def _with_kept_rows(self, cells: np.ndarray) -> np.ndarray:
        """``cells`` and every cell of the kept rows among theirs, which are kept no longer (a
        cell twice is harmless: both carry the host's value)."""
        rows = cells // self.max_blocks_per_seq
        kept = np.unique(rows[self.worker_kept[rows]])
        if kept.size == 0:
            return cells
        self.worker_kept[kept] = False
        width = self.max_blocks_per_seq
        return np.concatenate([cells, (kept[:, None] * width + np.arange(width)).reshape(-1)])

    def slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor,
                     tokens_per_block: int) -> torch.Tensor:
        """int64 slots for a whole batch on the device (`allocator.capacity.slots.slot_mapping` on
        the device copy); ``rows`` and ``positions`` are same-length integer tensors on its device.
        """
        return slot_mapping(self.device_table, rows, positions, tokens_per_block)

    def check_invariants(self, rows: np.ndarray, num_blocks: np.ndarray, num_pool_blocks: int,
                         *, synced: bool, released: np.ndarray | None = None) -> None:
        """``released``: the leading `RELEASED` columns of each of ``rows`` (none if None)."""
        live = np.zeros(self.max_batch_size, dtype=bool)
        live[rows] = True
        if (self.host[~live] != -1).any():
            raise InvariantViolation("a free block-table row holds a block id")
        cols = np.arange(self.max_blocks_per_seq)
        first = np.zeros_like(num_blocks) if released is None else released
        behind = cols[None, :] < first[:, None]
        owned = ~behind & (cols[None, :] < num_blocks[:, None])
        table = self.host[rows]
        if (table[owned] < 0).any() or (table[owned] >= num_pool_blocks).any():
            raise InvariantViolation("a row holds an invalid block id inside its block count")
        if (table[behind] != RELEASED).any():
            raise InvariantViolation("a released column holds something other than RELEASED")
        if (table[~owned & ~behind] != -1).any():
            raise InvariantViolation("a row holds something other than -1 past its block count")
        shared = ~self.worker_kept
        if synced and any(not np.array_equal(copy.tensor.cpu().numpy()[shared], self.host[shared])
                          for copy in self._copies):
            raise InvariantViolation("a device block table differs from the host mirror")


    def check_held_rows(self, live: np.ndarray) -> None:
        """The rows off the free-row stack are exactly the ``live`` ones (a bool per row)."""
        held = np.ones(self.max_batch_size, dtype=bool)
        free = self.free_rows[: self.num_free_rows]
        held[free] = False
        if np.unique(free).size != free.size:
            raise InvariantViolation("a row is on the free-row stack twice")
        if not np.array_equal(held, live):
            raise InvariantViolation("held block-table rows differ from the live requests")


class DeviceCopy:
    """One device copy of the table and how changed cells reach it: through a numpy view on
    CPU, by a graph replay (else one eager upload) on CUDA."""

    def __init__(self, tensor: torch.Tensor, host_cells: np.ndarray, upload_graphs: bool, *,
                 own_device: bool = False) -> None:
        """``own_device``: the copy lives on another device than the current one when it syncs
        (a mirror on another GPU), which its writes then make current."""
        if not tensor.is_contiguous():
            raise InvalidValue("block_table: the allocator returned a non-contiguous tensor",
                               field="block_table")
        self.tensor = tensor
        self._own_device = own_device and tensor.device.type == "cuda"
        self.graphs: TableUploadGraphs | None = None
        self._cells: np.ndarray | None = None
        if tensor.device.type == "cpu":
            # A CPU "device" copy is still a separate buffer (shared with workers through shared
            # memory); writing it through a numpy view skips torch's dispatch overhead.
            self._cells = tensor.numpy().reshape(-1)
            return
        # Changed cells and their values travel together, in one copy (`PinnedUploads`).
        self._uploads = PinnedUploads(tensor.device)
        if upload_graphs:
            # Every bucket captured now, not by the first syncs (a capture synchronises the
            # device and takes milliseconds): the copy holds the host's cells and no step runs
            # yet, so the warm-ups' writes of cell 0's value over itself change nothing.
            self.graphs = TableUploadGraphs(tensor)
            self.graphs.capture_all(host_cells)

    def write(self, cells: np.ndarray, host_cells: np.ndarray) -> None:
        """Copy the host's ``cells`` (flat indices into ``host_cells``) into this copy."""
        if self._own_device:
            with on_device(self.tensor.device):
                self._write(cells, host_cells)
        else:
            self._write(cells, host_cells)

    def _write(self, cells: np.ndarray, host_cells: np.ndarray) -> None:
        if self._cells is not None:
            self._cells[cells] = host_cells[cells]
        elif self.graphs is None or not self.graphs.upload(cells, host_cells):
            index, src = self._uploads.upload(cells, host_cells[cells])
            self.tensor.view(-1).index_copy_(0, index, src)


def _ragged_cells(rows: np.ndarray, starts: np.ndarray,
                  counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) index arrays for the ragged ranges ``starts[i] : starts[i] + counts[i]``."""
    total = int(counts.sum())
    r = np.repeat(rows, counts)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    c = np.repeat(starts, counts) + offsets
    return r, c
