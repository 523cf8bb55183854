"""What GPU tests check beyond values: `no_host_sync`, that a block of CUDA work never makes
the host wait for the device, and `counted_captures`, which CUDA graphs were captured when."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import allocator.common.pinned_graphs as pinned_graphs


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Any synchronising CUDA call inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


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
