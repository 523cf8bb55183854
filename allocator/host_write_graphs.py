"""`HostWriteGraphs`: the commit of a window staged with host slots as one CUDA graph replay.

A service knows a window's slots and accepted counts on the host, so its commit is two device
steps: upload the slots (as staged, and with rejected tokens at -1) and run the fused write.
Launched one by one these cost far more host time than device time: a host-to-device copy and a
Triton launch are each tens of microseconds of Python and driver work on a slow host. Captured,
they are one replay.

A graph bakes in addresses and sizes, so there is one per staging buffer (its address, shape,
strides and dtype) and per row bucket: a power of two at least the window's tokens, the rows past
them padded with slot -1, which the write skips. The slots travel from one pinned buffer that
never moves (the graph's copy reads it): ``[staged | kept]``, ``rows`` each. It is refilled
only once the previous replay's copy has read it (an event), so nothing else waits for the
device. The least recently used graphs beyond ``max_graphs`` are dropped.

The captured work is the caller's ``write(staged, kept, rows)`` on the device slot views: the
same function the eager path runs, so the two cannot drift apart.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from .device_io import PinnedBuffer, capture_graph

log = logging.getLogger(__name__)

MIN_ROWS = 64  # the smallest bucket: tiny windows share one graph
Write = Callable[[torch.Tensor, torch.Tensor, int], None]


class HostWriteGraphs:
    def __init__(self, max_tokens: int, device: torch.device, write: Write, *,
                 max_graphs: int = 16) -> None:
        self.max_tokens = max_tokens
        self.write = write
        self.max_graphs = max_graphs
        # Its address never changes: the graphs' copies read it.
        self._buffer = PinnedBuffer(2 * max_tokens * torch.int64.itemsize, device)
        self._pinned = self._buffer.tensor.view(torch.int64)
        self._slots = torch.full((2 * max_tokens,), -1, dtype=torch.int64, device=device)
        self._graphs: OrderedDict[tuple[object, ...], torch.cuda.CUDAGraph] = OrderedDict()
        self.failed = False  # a capture failed: the caller writes eagerly from then on

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def rows_for(self, tokens: int) -> int:
        """The bucket a window of ``tokens`` tokens replays."""
        return min(self.max_tokens, max(MIN_ROWS, 1 << max(0, tokens - 1).bit_length()))

    def replay(self, source: torch.Tensor, staged: np.ndarray, kept: np.ndarray,
               variant: object = None) -> bool:
        """Commit ``staged``/``kept`` slots (same length) from ``source`` (``[L, 2, capacity,
        row]``, capacity >= that length) by replaying its graph
        (captured now if new); False if graphs failed here, and the caller must write eagerly.
        ``variant`` names whatever else the captured work depends on (the protection guard)."""
        if self.failed:
            return False
        rows = min(self.rows_for(staged.size), source.shape[2])  # never past its capacity
        key = (source.data_ptr(), tuple(source.shape), source.stride(), source.dtype, rows,
               variant)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(rows)
            if graph is None:
                return False
            self._graphs[key] = graph
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        self._fill(rows, staged, kept)
        graph.replay()
        self._buffer.read()
        return True

    def _body(self, rows: int) -> None:
        slots = self._slots[: 2 * rows]
        slots.copy_(self._pinned[: 2 * rows], non_blocking=True)
        self.write(slots[:rows], slots[rows:], rows)

    def _capture(self, rows: int) -> torch.cuda.CUDAGraph | None:
        # Every slot -1 while warming up: the warm-up runs the write for real, and writes nothing.
        self._slots_on_host()[: 2 * rows] = -1
        try:
            graph = capture_graph(lambda: self._body(rows))
        except RuntimeError as exc:
            log.warning("NWOR: capturing the host-slot commit failed; committing without a "
                        "graph from now on", exc_info=exc)
            self.failed = True
            return None
        self._buffer.read()
        return graph

    def _slots_on_host(self) -> np.ndarray:
        return self._buffer.writable().view(np.int64)

    def _fill(self, rows: int, staged: np.ndarray, kept: np.ndarray) -> None:
        n = staged.size
        host = self._slots_on_host()
        host[:n] = staged
        host[n:rows] = -1
        host[rows: rows + n] = kept
        host[rows + n: 2 * rows] = -1
