"""`Committer`: the service's NWOR commit of one worker's batch, on the pool's device.

One `DeferredWriteManager` serves every worker: the core calls ``write_batch`` under its lock,
and a whole window (begin, stage every layer straight from the worker's shared staging buffer,
commit) runs inside that one call, so windows of different workers never interleave. The number of
device launches does not depend on the number of layers: the commit reads the worker's buffer in
place. The graphs that commit from a worker's buffer are captured when the buffer is made, at
registration (``add_staging``), so its first commits replay like the rest, and are dropped with
it (``release_staging``).

Requests the settling call reverted or finished commit nothing: they enter the layout as all
drafts with 0 accepted, so NWOR counts their tokens as rejected (never written) and
``committed == written`` holds; their slots are -1 as well, which keeps even a fallback from
writing them.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from kvalloc.allocator import DeferredWriteManager, KVStorage, WindowLayout, WriterFence
from kvalloc.allocator.common.device_io import on_device, upload_int64
from kvalloc.server.contract import wire
from kvalloc.server.service.batch import ScheduledBatch

NOTHING = wire.CommitSummary(tokens=0, written=0)


class Committer:
    def __init__(self, storage: KVStorage, *, max_tokens: int, stage_dtype: torch.dtype,
                 nwor: bool = True, protected: torch.Tensor | None = None) -> None:
        """``nwor`` False writes every staged token of a settled request, rejected drafts too
        (what an engine without NWOR does: the reference to compare NWOR against).
        ``protected``: bool ``[total_blocks]`` on the pool's device (shared with workers that
        commit their own tokens): refuse writes into cached prefix blocks; ``protect`` keeps it
        current."""
        self.device = storage.device
        self.nwor = nwor
        self.writes = DeferredWriteManager(storage, max_tokens=max_tokens, stage_dtype=stage_dtype)
        self._protected = protected
        if protected is not None:
            self.writes.protect(protected)

    @property
    def protected(self) -> torch.Tensor | None:
        """The mask of protected blocks, shared with workers that commit their own tokens."""
        return self._protected

    def check_invariants(self) -> None:
        """The NWOR window manager's own state (`DeferredWriteManager.check_invariants`)."""
        self.writes.check_invariants()

    def add_staging(self, staging: torch.Tensor, fence: WriterFence) -> None:
        """Capture the graphs that commit from a worker's new ``staging`` buffer, fenced by its
        session's ``fence``, now, at registration, so that its first commits replay like the
        rest instead of capturing."""
        self.writes.graphs.capture_host_writes(staging, fence)

    def release_staging(self, staging: torch.Tensor) -> None:
        """Forget the graphs of ``staging``, a buffer about to be released."""
        self.writes.graphs.drop_host_writes(staging)

    def protect(self, blocks: np.ndarray, protected: np.ndarray) -> None:
        """Set the protection of ``blocks`` (only the flips since the last call travel)."""
        if self._protected is not None and blocks.size:
            self._protected[upload_int64(blocks, self.device)] = torch.from_numpy(
                protected).to(self.device)

    def write_batch(self, staging: torch.Tensor, fence: WriterFence, batch: ScheduledBatch,
                    accepted: np.ndarray, dropped: np.ndarray,
                    slots: np.ndarray) -> wire.CommitSummary:
        """Write ``batch``'s committed tokens from ``staging`` (``[L, P, T, H, D]``), fenced by
        its worker's session (`allocator.WriterFence`).

        ``accepted`` and ``dropped`` are per batch request; ``slots`` per token (-1: skip).
        """
        if batch.total_tokens == 0:
            return NOTHING
        scheduled = batch.scheduled
        drafts = np.where(dropped, scheduled.num_tokens, scheduled.num_drafts)
        writes = self.writes
        writes.begin_window(WindowLayout.of_arrays(scheduled.num_tokens, drafts), fence)
        writes.stage_from(staging, slots)  # host slots: the keep mask is applied on the host
        if not self.nwor:
            accepted = scheduled.num_drafts
        accepted = np.where(dropped, 0, accepted)
        writes.commit(accepted)
        stats = writes.last_window
        # Host slots: the window counts what reached the pool, the kept tokens (all of them
        # after a fallback) whose slot is not -1 (a reverted or finished request's, or one past
        # its request's blocks).
        assert stats is not None and stats.written is not None
        return wire.CommitSummary(tokens=stats.tokens, written=stats.written,
                                  fallback=stats.fallback_reason)


class ShardedCommitter:
    """The service's commit on every part of the pool: one `Committer` per shard of a
    tensor-parallel pool (`server.service.shards`), each writing the one table's slots from that
    shard's staging on that shard's device (made current for it: its graphs and kernels live
    there), or per group of a grouped pool (``grouped``), each writing its group's slots (its
    own table's) from the worker's staging of that group. A pool of one shard is the same with
    one committer.

    Invariant: every part commits the same tokens (the counts are the same call's; a windowed
    group's slots skip those behind its window); a fallback on one part (it wrote every staged
    token) is reported for the whole step."""

    def __init__(self, committers: list[Committer], *, grouped: bool = False) -> None:
        self.shards = committers
        self.grouped = grouped

    def _on(self, index: int) -> contextlib.AbstractContextManager[object]:
        """Shard ``index``'s device made current; the first shard's is already."""
        return contextlib.nullcontext() if index == 0 else on_device(self.shards[index].device)

    def check_invariants(self) -> None:
        for committer in self.shards:
            committer.check_invariants()

    def add_staging(self, stagings: list[torch.Tensor], fences: list[WriterFence]) -> None:
        for index, (committer, staging, fence) in enumerate(
                zip(self.shards, stagings, fences, strict=True)):
            with self._on(index):
                committer.add_staging(staging, fence)

    def release_staging(self, stagings: list[torch.Tensor]) -> None:
        for committer, staging in zip(self.shards, stagings, strict=True):
            committer.release_staging(staging)

    def protect(self, blocks: np.ndarray, protected: np.ndarray, table: int = 0) -> None:
        """`Committer.protect` on the parts of block table ``table``: every shard (of the one
        table), or the group whose table it is."""
        for index, committer in enumerate(self.shards):
            if self.grouped and index != table:
                continue
            with self._on(index):
                committer.protect(blocks, protected)

    def write_batch(self, stagings: list[torch.Tensor], fences: list[WriterFence],
                    batch: ScheduledBatch, accepted: np.ndarray, dropped: np.ndarray,
                    slots: list[np.ndarray]) -> wire.CommitSummary:
        """`Committer.write_batch` on every part, ``stagings`` and ``fences`` in part order;
        ``slots`` per table (one per group; one for every shard)."""
        summaries = []
        for index, (committer, staging, fence) in enumerate(
                zip(self.shards, stagings, fences, strict=True)):
            with self._on(index):
                summaries.append(committer.write_batch(
                    staging, fence, batch, accepted, dropped,
                    slots[index if self.grouped else 0]))
        first = summaries[0]
        fallback = next((s.fallback for s in summaries if s.fallback is not None), None)
        return first if fallback == first.fallback else wire.CommitSummary(
            tokens=first.tokens, written=first.written, fallback=fallback)
