"""`GraphCapture`: what a manager's caller captures ahead of its windows (``mgr.graphs``), so
that their commits replay a CUDA graph instead of launching the commit's work one call at a time:

- ``capture_commit(max_window_tokens)``: the device commit (keep mask, fused write, device
  counters) that ``commit`` with a device tensor then replays;
- ``capture_verify(max_window_tokens, ...)``: acceptance and that commit, for
  ``verify_and_commit``;
- ``capture_host_writes(staging)``: every row bucket of a commit staged from ``staging`` with
  host slots, which the first such commit would otherwise capture; ``drop_host_writes`` forgets
  them before ``staging`` is released.

A capture is setup, not part of a window: it runs between windows only, synchronises the device
and takes milliseconds. What it makes lives in ``captured`` (`CommitGraphs`), where the window's
write (`PoolWrites`) finds the graph to replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from kvalloc.allocator.errors import WindowStateError
from kvalloc.allocator.nwor.acceptance import StaticAcceptance
from kvalloc.allocator.nwor.deferred.device_keep import DeviceKeep
from kvalloc.allocator.nwor.deferred.graphs import CommitGraphs
from kvalloc.allocator.nwor.deferred.input_checks import StagingSpec
from kvalloc.allocator.nwor.deferred.pool_writes import PoolWrites
from kvalloc.allocator.nwor.fence import WriterFence


class GraphCapture:
    def __init__(self, spec: StagingSpec, captured: CommitGraphs, writes: PoolWrites,
                 keep: DeviceKeep, window_open: Callable[[], bool]) -> None:
        self.captured = captured
        self._spec = spec
        self._writes = writes
        self._keep = keep
        self._window_open = window_open  # the manager's: whether a window is open now

    def capture_commit(self, max_window_tokens: int) -> None:
        """Capture the device commit (keep mask + fused write + metrics) for windows of up to
        ``max_window_tokens`` tokens; ``commit`` with a device tensor then replays it."""
        rows = self._spec.checked_capture(max_window_tokens, window_open=self._window_open())
        writes = self._writes
        self.captured.capture_commit(rows, lambda: writes.mask_and_write(rows, record=True),
                                     lambda: writes.warm_up_mask_and_write(rows))

    def capture_verify(self, max_window_tokens: int, *, max_requests: int, width: int,
                       flat_drafts: bool = False) -> None:
        """Capture acceptance + commit for windows of up to ``max_window_tokens`` tokens and
        ``max_requests`` requests, with ``sampled_ids`` up to ``width`` columns and drafts flat
        or padded; ``verify_and_commit`` then replays it."""
        rows = self._spec.checked_capture(max_window_tokens, window_open=self._window_open())
        self._spec.check_capture_requests(max_requests)
        static = StaticAcceptance(flat=flat_drafts, batch=max_requests, width=width,
                                  device=self._spec.device)
        writes = self._writes
        self.captured.capture_verify(rows, static, self._keep.accepted[:max_requests],
                                     lambda: writes.mask_and_write(rows, record=True),
                                     lambda: writes.warm_up_mask_and_write(rows))

    def capture_host_writes(self, staging: torch.Tensor, fence: WriterFence | None = None) -> bool:
        """Capture now the graph of every row bucket that a commit staged from ``staging`` with
        host slots replays (under the manager's current ``protect`` guard), kept until
        ``drop_host_writes``, so the first commits from ``staging`` do not pay for it.
        ``staging`` as ``stage_from`` takes it. False where those commits run no graph (a CPU
        pool, the torch write) or a capture failed (logged once; they write eagerly from then
        on). The graphs read ``fence``, the one the windows staged from ``staging`` will be
        opened with."""
        if self._window_open():
            raise WindowStateError("window: capture graphs between windows, not inside one")
        self._writes.fence = fence
        try:
            return self._writes.capture_host_writes(self._spec.checked_staging(staging, 1))
        finally:
            self._writes.fence = None

    def drop_host_writes(self, staging: torch.Tensor) -> int:
        """Forget the graphs that commit from ``staging``, before its memory is released (it
        may come back as another buffer); how many went."""
        return self.captured.drop_host_writes(self._spec.checked_staging(staging, 1))
