"""Host-to-device uploads and CUDA-graph capture shared by acceptance and deferred writes.

Both exist so that the step's hot path never synchronises with the device: uploads go from pinned
memory with ``non_blocking=True`` (PyTorch's caching host allocator keeps the pinned block alive
until the copy has run, so reusing it is safe), and capture warms up on a side stream first so lazy
initialisation (Triton compilation, allocator growth) never happens inside a capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


def upload_int64(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, without a host synchronisation on CUDA."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, values: Sequence[int] | np.ndarray) -> None:
    """Copy host integers into the device tensor ``dst`` (same length) without synchronising."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(dst.dtype)
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.device.type == "cuda")


def capture_graph(body: Callable[[], None], *, warmup: Callable[[], None] | None = None,
                  warmup_iters: int = 2) -> torch.cuda.CUDAGraph:
    """Capture ``body`` (device work on static buffers only) into a CUDA graph.

    ``warmup`` (default: ``body``) runs ``warmup_iters`` times on a side stream first; pass a
    side-effect-free variant when running ``body`` for real would change state.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_iters):
            (warmup or body)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph
