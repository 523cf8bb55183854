"""`PinnedGraphs`: CUDA graphs of device work that starts by copying one pinned buffer over.

Some per-step device work is a host-to-device copy of a few arrays and a kernel or two over them:
launched one by one, each copy, view and launch is tens of microseconds of Python and driver
work on a slow host, for next to no device time. Captured, they are one replay.

A graph bakes in addresses and sizes. So its input travels from one pinned buffer that never
moves (the graph's copy reads it), refilled only once the previous replay's copy has read it (an
event: nothing else waits for the device); and there is one graph per size of work, a bucket of
rows (`bucket`) the caller pads its rows to.

A capture synchronises the device and takes milliseconds, so the graphs a caller knows it will
replay are captured ahead (``capture``), before the first step, and kept until dropped: the
first steps replay like any other. A graph first needed by a step is captured then, and kept
among the ``max_graphs`` most recently used (`GraphStore`). A capture that fails, ahead or
during a step, turns the graphs off for good, logged once: the caller runs its eager path from
then on.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import numpy as np
import torch
from kvalloc.allocator.common.device_io import PinnedBuffer, capture_graph

Fill = Callable[[np.ndarray], None]  # writes a graph's input into the buffer's bytes
G = TypeVar("G")


def bucket(rows: int, smallest: int) -> int:
    """The rows of the graph that ``rows`` rows replay: the power of two at least ``rows``, and
    at least ``smallest`` (small amounts of work share one graph)."""
    return max(smallest, 1 << max(0, rows - 1).bit_length())


def bucket_sizes(smallest: int, largest: int) -> list[int]:
    """Every bucket of ``largest`` rows or fewer, ascending: ``bucket(rows, smallest)`` for
    ``rows`` from 1 on, while it is at most ``largest``."""
    sizes: list[int] = []
    rows = 1
    while (size := bucket(rows, smallest)) <= largest:
        sizes.append(size)
        rows = size + 1
    return sizes


class GraphStore(Generic[G]):
    """Graphs by key. Those captured ahead are kept until dropped; those captured on first use
    are kept among the ``max_graphs`` most recently used. The two never compete for room, so
    graphs captured on first use cannot evict, one after the other, the graphs captured ahead
    (a worker's, say, that every step of that worker replays)."""

    def __init__(self, max_graphs: int) -> None:
        self.max_graphs = max_graphs
        self._ahead: dict[Hashable, G] = {}
        self._recent: OrderedDict[Hashable, G] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ahead) + len(self._recent)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._ahead or key in self._recent

    def get(self, key: Hashable) -> G | None:
        """The graph of ``key`` (now the most recently used), or None."""
        graph = self._ahead.get(key)
        if graph is None:
            graph = self._recent.get(key)
            if graph is not None:
                self._recent.move_to_end(key)
        return graph

    def add(self, key: Hashable, graph: G, *, ahead: bool) -> None:
        """Keep ``graph`` for ``key``: until dropped if captured ``ahead``, else among the most
        recently used (the least recently used beyond ``max_graphs`` goes)."""
        self._recent.pop(key, None)
        if ahead:
            self._ahead[key] = graph
            return
        self._ahead.pop(key, None)
        self._recent[key] = graph
        if len(self._recent) > self.max_graphs:
            self._recent.popitem(last=False)

    def drop(self, which: Callable[[Hashable], bool]) -> int:
        """Forget every graph whose key ``which`` accepts; how many went."""
        gone = 0
        for graphs in (self._ahead, self._recent):
            for key in [key for key in graphs if which(key)]:
                del graphs[key]
                gone += 1
        return gone


class PinnedGraphs:
    def __init__(self, nbytes: int, device: torch.device, *, max_graphs: int,
                 log: logging.Logger, failure: str) -> None:
        """``nbytes`` of pinned input for graphs on ``device``; ``max_graphs`` graphs captured
        on first use at most (besides those captured ahead); ``failure`` is the warning ``log``
        gets when a capture fails."""
        self._buffer = PinnedBuffer(nbytes, device)
        self.pinned = self._buffer.tensor  # what the graphs' copies read: its address is fixed
        self._graphs: GraphStore[torch.cuda.CUDAGraph] = GraphStore(max_graphs)
        self._log = log
        self._failure = failure
        self.failed = False  # a capture failed: the caller runs its eager path from then on

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def holds(self, key: Hashable) -> bool:
        """Whether the graph of ``key`` is captured (a replay of it captures nothing)."""
        return key in self._graphs

    def capture(self, key: Hashable, body: Callable[[], None], *, warmup_fill: Fill) -> bool:
        """Capture the graph of ``key`` now, ahead of its first replay, and keep it until
        ``drop``; ``body`` and ``warmup_fill`` as for ``replay`` (the warm-up runs for real over
        the input ``warmup_fill`` writes). False if a capture failed, now or before."""
        return self._graph(key, body, warmup_fill, ahead=True) is not None

    def drop(self, which: Callable[[Hashable], bool]) -> int:
        """Forget the graphs whose key ``which`` accepts (their addresses may be reused for
        something else); how many went."""
        return self._graphs.drop(which)

    def replay(self, key: Hashable, body: Callable[[], None], fill: Fill, *,
               warmup_fill: Fill) -> bool:
        """Run ``body`` (a copy out of ``pinned``, then device work on static buffers) over the
        input ``fill`` writes, by replaying the graph of ``key``. A new key captures ``body``
        first; its warm-up runs for real, over the input ``warmup_fill`` writes, which must make
        it harmless. False if a capture failed, now or before: nothing was replayed (at most
        that harmless warm-up ran), and the caller runs its eager path."""
        graph = self._graph(key, body, warmup_fill, ahead=False)
        if graph is None:
            return False
        fill(self._buffer.writable())
        graph.replay()
        self._buffer.read()
        return True

    def _graph(self, key: Hashable, body: Callable[[], None], warmup_fill: Fill, *,
               ahead: bool) -> torch.cuda.CUDAGraph | None:
        """The graph of ``key``, captured now if new (kept as ``ahead`` says; one captured on
        first use and now wanted ``ahead`` is kept until dropped from then on); None if a
        capture failed, now or before."""
        if self.failed:
            return None
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(body, warmup_fill)
            if graph is None:
                return None
            self._graphs.add(key, graph, ahead=ahead)
        elif ahead:
            self._graphs.add(key, graph, ahead=True)
        return graph

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
