"""`HostWriteGraphs`: the commit of a window staged with host slots as one CUDA graph replay.

A service knows a window's slots and accepted counts on the host, so its commit is two device
steps: upload the slots (as staged, and with rejected tokens at -1) and run the fused write.
Launched one by one these cost far more host time than device time: a host-to-device copy and a
Triton launch are each tens of microseconds of Python and driver work on a slow host. Captured,
they are one replay.

A graph bakes in addresses and sizes, so there is one per staging buffer (its address, shape,
strides and dtype: `source_key`) and per row bucket (`rows_for`): a power of two at least the
window's tokens, the rows past them padded with slot -1, which the write skips. The slots travel
from the graphs' pinned buffer (`PinnedGraphs`): ``[staged | kept]``, ``rows`` each.

``capture`` captures every row bucket of one staging buffer ahead of its first commit (a service
does so when it hands a worker its buffer), kept until ``drop`` (when the buffer is released);
a graph not captured ahead is captured by the first commit that needs it. Either way the warm-up
runs over slots that are all -1, so it writes nothing.

The captured work is the caller's ``write(staged, kept, rows)`` on the device slot views: the
same function the eager path runs, so the two cannot drift apart. It is passed to each call and
never kept: the caller's bound method kept here would close a reference cycle through the caller
that holds these graphs, leaving them to the cyclic collector, which may then free graphs in the
middle of another stream's capture (fatal to the process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from functools import partial

import numpy as np
import torch
from kvalloc.allocator.common.pinned_graphs import PinnedGraphs, bucket, bucket_sizes

log = logging.getLogger(__name__)

MIN_ROWS = 64  # the smallest bucket: tiny windows share one graph
Write = Callable[[torch.Tensor, torch.Tensor, int], None]
SourceKey = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]


def rows_for(tokens: int, max_tokens: int, capacity: int) -> int:
    """The bucket a window of ``tokens`` tokens replays, from a staging buffer of ``capacity``
    tokens: never past ``max_tokens`` nor the buffer."""
    return min(max_tokens, capacity, bucket(tokens, MIN_ROWS))


def row_buckets(max_tokens: int, capacity: int) -> list[int]:
    """Every bucket a window of 1 to ``min(max_tokens, capacity)`` tokens replays, ascending."""
    largest = min(max_tokens, capacity)
    sizes = bucket_sizes(MIN_ROWS, largest)
    return sizes if sizes and sizes[-1] == largest else [*sizes, largest]


def source_key(source: torch.Tensor) -> SourceKey:
    """What a graph bakes in of the staging buffer it reads."""
    return source.data_ptr(), tuple(source.shape), source.stride(), source.dtype


class HostWriteGraphs:
    def __init__(self, max_tokens: int, device: torch.device, *, max_graphs: int = 16) -> None:
        """Graphs of a write over windows of up to ``max_tokens`` tokens; ``max_graphs`` graphs
        captured on first use at most, besides those captured ahead (``capture``)."""
        self.max_tokens = max_tokens
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

    def holds(self, source: torch.Tensor, tokens: int, variant: Hashable = None) -> bool:
        """Whether a commit of ``tokens`` tokens from ``source`` replays a captured graph."""
        return self._graphs.holds(self._key(source, self._rows(source, tokens), variant))

    def capture(self, source: torch.Tensor, write: Write, variant: Hashable = None) -> bool:
        """Capture now the graph of every row bucket a commit from ``source`` may replay (see
        ``replay``), kept until ``drop``. False if a capture failed (now or before), and the
        caller writes eagerly."""
        return all(self._graphs.capture(self._key(source, rows, variant),
                                        partial(self._body, rows, write),
                                        warmup_fill=partial(_fill_none, rows=rows))
                   for rows in row_buckets(self.max_tokens, source.shape[2]))

    def drop(self, source: torch.Tensor) -> int:
        """Forget the graphs that read ``source`` (its memory is about to be released, and may
        come back as another buffer); how many went."""
        key = source_key(source)
        return self._graphs.drop(lambda graph: graph[0] == key)

    def replay(self, source: torch.Tensor, staged: np.ndarray, kept: np.ndarray, write: Write,
               variant: Hashable = None) -> bool:
        """Commit ``staged``/``kept`` slots (same length) from ``source`` (``[L, P, capacity,
        row]``, capacity >= that length) by replaying its graph
        (captured now if new); False if graphs failed here, and the caller must write eagerly.
        ``variant`` names whatever else the captured work depends on (the protection guard)."""
        rows = self._rows(source, staged.size)
        return self._graphs.replay(
            self._key(source, rows, variant), lambda: self._body(rows, write),
            lambda host: _fill(host, rows, staged, kept),
            warmup_fill=lambda host: _fill_none(host, rows))

    def _rows(self, source: torch.Tensor, tokens: int) -> int:
        return rows_for(tokens, self.max_tokens, source.shape[2])

    @staticmethod
    def _key(source: torch.Tensor, rows: int, variant: Hashable) -> Hashable:
        return source_key(source), rows, variant

    def _body(self, rows: int, write: Write) -> None:
        slots = self._slots[: 2 * rows]
        slots.copy_(self._pinned[: 2 * rows], non_blocking=True)
        write(slots[:rows], slots[rows:], rows)


def _fill(host: np.ndarray, rows: int, staged: np.ndarray, kept: np.ndarray) -> None:
    slots = host.view(np.int64)
    n = staged.size
    slots[:n] = staged
    slots[n:rows] = -1
    slots[rows: rows + n] = kept
    slots[rows + n: 2 * rows] = -1


def _fill_none(host: np.ndarray, rows: int) -> None:
    """Every slot -1, for a warm-up: it runs the write for real, and writes nothing."""
    host.view(np.int64)[: 2 * rows].fill(-1)
