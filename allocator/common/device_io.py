"""Host-to-device uploads and CUDA-graph capture shared by acceptance and deferred writes.

Both exist so that the step's hot path never synchronises with the device: uploads go from pinned
memory with ``non_blocking=True`` (PyTorch's caching host allocator keeps the pinned block alive
until the copy has run, so reusing it is safe), and capture warms up on a side stream first so lazy
initialisation (Triton compilation, allocator growth) never happens inside a capture.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch


def upload_int64(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, without a host synchronisation on CUDA."""
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


# Streams already built, by what identifies them (id, device index, device type).
_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}
_MAX_STREAMS = 256  # a program that makes streams without end does not grow this without end


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` for CUDA device ``index``, at the cost of one C call.

    torch's look-up checks its initialisation, resolves the device and builds a new `Stream`
    each time, several times a step: 3.8 us against 0.7 on an H200's host
    (`benchmarks/bench_host_calls.py`), more inside a step whose host caches are cold. Here
    what identifies the current stream (the same C call's answer) finds the object built
    before.
    """
    key = torch._C._cuda_getCurrentStream(index)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= _MAX_STREAMS:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


_ALIGN = 8  # bytes: every array of a packed upload starts where any int dtype may be viewed


class PinnedBuffer:
    """Pinned host memory that the device reads through asynchronous copies, refilled only once
    the last copy that read it has run: an event, recorded on the stream current at the copy.
    Nothing else waits for the device."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._host = self.tensor.numpy()
        self._read = torch.cuda.Event()
        # With its index, the current stream is found without asking which device is current.
        self._stream_index = device.index if device.index is not None else \
            torch.cuda.current_device()

    def writable(self) -> np.ndarray:
        """The buffer's bytes, once no copy still reads them."""
        self._read.synchronize()
        return self._host

    def read(self, stream: torch.cuda.Stream | None = None) -> None:
        """Record that the copies queued so far on ``stream`` (the current one by default)
        read the buffer."""
        self._read.record(stream if stream is not None else current_stream(self._stream_index))


class PinnedUploads:
    """Host-to-device copies of integer arrays through one `PinnedBuffer`, grown on demand.

    On the per-step path a fresh ``pin_memory()`` costs more than the copy, and each copy is a
    driver call: arrays packed into one buffer travel in one copy. On a CPU device the values
    are written straight into place.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self._buffer = PinnedBuffer(0, device) if device.type == "cuda" else None

    def into(self, dst: torch.Tensor, values: np.ndarray, *,
             stream: torch.cuda.Stream | None = None) -> None:
        """Copy ``values`` (as many as ``dst`` holds, cast to its dtype) into the contiguous
        tensor ``dst``; ``stream``: the current one, where the caller holds it."""
        if self._buffer is None:
            dst.numpy().reshape(-1)[:] = np.ravel(values)
            return
        (src,) = self._stage([np.ravel(values).astype(_NUMPY[dst.dtype], copy=False)])
        dst.copy_(self._buffer.tensor[src].view(dst.dtype).view(dst.shape), non_blocking=True)
        self._buffer.read(stream)

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Device copies of ``arrays`` (each keeps its dtype) in one copy; they stay valid until
        the next call (it reuses their memory, in stream order)."""
        if self._buffer is None:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        parts = self._stage(list(arrays))
        total = parts[-1].stop
        if self._scratch.numel() < total:
            self._scratch = torch.empty(self._buffer.tensor.numel(), dtype=torch.uint8,
                                        device=self.device)
        self._scratch[:total].copy_(self._buffer.tensor[:total], non_blocking=True)
        self._buffer.read()
        return [self._scratch[part].view(_TORCH[a.dtype]) for part, a in zip(parts, arrays,
                                                                            strict=True)]

    def _stage(self, arrays: list[np.ndarray]) -> list[slice]:
        """Write ``arrays`` into the pinned buffer, each at an aligned offset; their byte ranges."""
        assert self._buffer is not None
        parts, offset = [], 0
        for a in arrays:
            parts.append(slice(offset, offset + a.nbytes))
            offset += -(-a.nbytes // _ALIGN) * _ALIGN
        host = self._buffer.writable()
        if host.size < offset:  # nothing reads the old buffer any more: replace it
            self._buffer = PinnedBuffer(max(offset, 2 * host.size), self.device)
            host = self._buffer.writable()
        for part, a in zip(parts, arrays, strict=True):
            host[part].view(a.dtype)[:] = a
        return parts


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}
_TORCH = {np.dtype(v): k for k, v in _NUMPY.items()}


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
    with capturing(graph):
        body()
    return graph


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph,
              pool: tuple[int, int] | None = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` with Python's garbage collector held off: a
    collection inside the capture may free an unreachable earlier graph (an engine dropped in a
    cycle), and destroying a graph while a stream captures is an error that invalidates the
    capture."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if collecting:
            gc.enable()


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Makes ``device`` current for what runs inside (CUDA; nothing on CPU): the streams, graphs
    and kernels made there belong to it, as they must for a tensor on another GPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
