"""`PinnedGraphs`: CUDA graphs of device work that starts by copying one pinned buffer over.

Some per-step device work is a host-to-device copy of a few arrays and a kernel or two over them:
launched one by one, each copy, view and launch is tens of microseconds of Python and driver
work on a slow host, for next to no device time. Captured, they are one replay.

A graph bakes in addresses and sizes. So its input travels from one pinned buffer that never
moves (the graph's copy reads it), refilled only once the previous replay's copy has read it (an
event: nothing else waits for the device); and there is one graph per size of work, a bucket of
rows (`bucket`) the caller pads its rows to. The least recently used graphs beyond
``max_graphs`` are dropped. A capture that fails turns the graphs off for good, logged once: the
caller runs its eager path from then on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np
import torch

from .device_io import PinnedBuffer, capture_graph

Fill = Callable[[np.ndarray], None]  # writes a graph's input into the buffer's bytes


def bucket(rows: int, smallest: int) -> int:
    """The rows of the graph that ``rows`` rows replay: the power of two at least ``rows``, and
    at least ``smallest`` (small amounts of work share one graph)."""
    return max(smallest, 1 << max(0, rows - 1).bit_length())


class PinnedGraphs:
    def __init__(self, nbytes: int, device: torch.device, *, max_graphs: int,
                 log: logging.Logger, failure: str) -> None:
        """``nbytes`` of pinned input for graphs on ``device``; ``failure`` is the warning
        ``log`` gets when a capture fails."""
        self.max_graphs = max_graphs
        self._buffer = PinnedBuffer(nbytes, device)
        self.pinned = self._buffer.tensor  # what the graphs' copies read: its address is fixed
        self._graphs: OrderedDict[Hashable, torch.cuda.CUDAGraph] = OrderedDict()
        self._log = log
        self._failure = failure
        self.failed = False  # a capture failed: the caller runs its eager path from then on

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def replay(self, key: Hashable, body: Callable[[], None], fill: Fill, *,
               warmup_fill: Fill) -> bool:
        """Run ``body`` (a copy out of ``pinned``, then device work on static buffers) over the
        input ``fill`` writes, by replaying the graph of ``key``. A new key captures ``body``
        first; its warm-up runs for real, over the input ``warmup_fill`` writes, which must make
        it harmless. False if a capture failed, now or before: nothing was replayed (at most
        that harmless warm-up ran), and the caller runs its eager path."""
        if self.failed:
            return False
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(body, warmup_fill)
            if graph is None:
                return False
            self._graphs[key] = graph
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        fill(self._buffer.writable())
        graph.replay()
        self._buffer.read()
        return True

    def _capture(self, body: Callable[[], None],
                 warmup_fill: Fill) -> torch.cuda.CUDAGraph | None:
        warmup_fill(self._buffer.writable())
        try:
            graph = capture_graph(body)
        except RuntimeError as exc:
            self._log.warning(self._failure, exc_info=exc)
            self.failed = True
            return None
        self._buffer.read()
        return graph
