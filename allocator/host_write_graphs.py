"""`HostWriteGraphs`: the commit of a window staged with host slots as one CUDA graph replay.

A service knows a window's slots and accepted counts on the host, so its commit is two device
steps: upload the slots (as staged, and with rejected tokens at -1) and run the fused write.
Launched one by one these cost far more host time than device time: a host-to-device copy and a
Triton launch are each tens of microseconds of Python and driver work on a slow host. Captured,
they are one replay.

A graph bakes in addresses and sizes, so there is one per staging buffer (its address, shape,
strides and dtype) and per row bucket: a power of two at least the window's tokens, the rows past
them padded with slot -1, which the write skips. The slots travel from the graphs' pinned buffer
(`PinnedGraphs`): ``[staged | kept]``, ``rows`` each.

The captured work is the caller's ``write(staged, kept, rows)`` on the device slot views: the
same function the eager path runs, so the two cannot drift apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from .pinned_graphs import PinnedGraphs, bucket

log = logging.getLogger(__name__)

MIN_ROWS = 64  # the smallest bucket: tiny windows share one graph
Write = Callable[[torch.Tensor, torch.Tensor, int], None]


class HostWriteGraphs:
    def __init__(self, max_tokens: int, device: torch.device, write: Write, *,
                 max_graphs: int = 16) -> None:
        self.max_tokens = max_tokens
        self.write = write
        self._graphs = PinnedGraphs(
            2 * max_tokens * torch.int64.itemsize, device, max_graphs=max_graphs, log=log,
            failure="NWOR: capturing the host-slot commit failed; committing without a graph "
                    "from now on")
        self._pinned = self._graphs.pinned.view(torch.int64)
        self._slots = torch.full((2 * max_tokens,), -1, dtype=torch.int64, device=device)

    @property
    def captured(self) -> int:
        return self._graphs.captured

    @property
    def failed(self) -> bool:
        """A capture failed: the caller writes eagerly from then on."""
        return self._graphs.failed

    def rows_for(self, tokens: int) -> int:
        """The bucket a window of ``tokens`` tokens replays."""
        return min(self.max_tokens, bucket(tokens, MIN_ROWS))

    def replay(self, source: torch.Tensor, staged: np.ndarray, kept: np.ndarray,
               variant: object = None) -> bool:
        """Commit ``staged``/``kept`` slots (same length) from ``source`` (``[L, 2, capacity,
        row]``, capacity >= that length) by replaying its graph
        (captured now if new); False if graphs failed here, and the caller must write eagerly.
        ``variant`` names whatever else the captured work depends on (the protection guard)."""
        rows = min(self.rows_for(staged.size), source.shape[2])  # never past its capacity
        key = (source.data_ptr(), tuple(source.shape), source.stride(), source.dtype, rows,
               variant)
        # Every slot -1 while warming up: the warm-up runs the write for real, and writes nothing.
        return self._graphs.replay(
            key, lambda: self._body(rows), lambda host: _fill(host, rows, staged, kept),
            warmup_fill=lambda host: host.view(np.int64)[: 2 * rows].fill(-1))

    def _body(self, rows: int) -> None:
        slots = self._slots[: 2 * rows]
        slots.copy_(self._pinned[: 2 * rows], non_blocking=True)
        self.write(slots[:rows], slots[rows:], rows)


def _fill(host: np.ndarray, rows: int, staged: np.ndarray, kept: np.ndarray) -> None:
    slots = host.view(np.int64)
    n = staged.size
    slots[:n] = staged
    slots[n:rows] = -1
    slots[rows: rows + n] = kept
    slots[rows + n: 2 * rows] = -1
