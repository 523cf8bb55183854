"""What GPU tests check beyond values: `no_host_sync`, that a block of CUDA work never makes
the host wait for the device, `counted_captures`, which CUDA graphs were captured when, and
`replayed`, what a module computes replayed from a captured graph."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import kvalloc.allocator.common.pinned_graphs as pinned_graphs
import pytest
import torch


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Any synchronising CUDA call inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def replayed(fn: Callable[[torch.Tensor], torch.Tensor], static: torch.Tensor,
             fresh: torch.Tensor) -> torch.Tensor:
    """``fn(static)`` captured in a CUDA graph (after one eager call, which compiles what it
    launches), then replayed with ``fresh`` copied into ``static``: the replay's output."""
    fn(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    return out


def counted_captures(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The bodies of the graphs `PinnedGraphs` captures from now on (each still captured), in
    capture order."""
    made: list[object] = []
    capture = pinned_graphs.capture_graph

    def counted(body, **kwargs):
        made.append(body)
        return capture(body, **kwargs)

    monkeypatch.setattr(pinned_graphs, "capture_graph", counted)
    return made


def failing_captures(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Make every capture from now on fail, as an unsupported one does once its warm-up has run
    for real; the bodies it was tried on, in order."""
    tried: list[object] = []

    def broken(body, **kwargs):
        tried.append(body)
        body()
        raise RuntimeError("capture not supported")

    monkeypatch.setattr(pinned_graphs, "capture_graph", broken)
    return tried
