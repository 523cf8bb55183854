"""`PoolWrites`: every way a window's staged tokens reach the pool. All of them end in
`commit_kernel.write_staged` (one fused write over every layer); they differ in where the
accepted counts are and which slots the write gets:

- counts on the host (``commit`` with a list or array): the keep rule ran on the host
  (`StagingSpec.checked_host_counts`). All kept: the staged slots as they are ("fast"); a window
  with host slots: its slots, rejected tokens at -1, in one upload (`write_host_slots`, one graph
  replay on CUDA); otherwise the device keep mask on the uploaded counts ("masked");
- counts on the device (``commit`` with a tensor, ``verify_and_commit``): the device keep mask
  (`mask_and_write`), which also counts the window on the device, or the captured graph of it;
- the fallback (`write_all_staged`): every staged token, with the reference torch write.

Invariants: the pool never receives a rejected draft except through the fallback, and any
failure inside a window's write falls back (`write_or_fall_back`), so no committed token is
lost; the fallback counts its window, so what the device counted of it is taken back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from kvalloc.allocator.nwor.acceptance import accept
from kvalloc.allocator.nwor.commit_kernel import Backend, write_staged
from kvalloc.allocator.nwor.deferred.counters import WindowCounters
from kvalloc.allocator.nwor.deferred.device_keep import DeviceKeep
from kvalloc.allocator.nwor.deferred.fp8_scales import Fp8Scales
from kvalloc.allocator.nwor.deferred.graphs import CommitGraphs
from kvalloc.allocator.nwor.deferred.protection import BlockProtection
from kvalloc.allocator.nwor.deferred.staging import StagingBuffers
from kvalloc.allocator.nwor.fence import WriterFence
from kvalloc.allocator.nwor.host_write_graphs import HostWriteGraphs
from kvalloc.allocator.nwor.packed_commit import commit_packed
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.window import INCOMPLETE_STAGING, WindowLayout, WindowStats
from kvalloc.allocator.nwor.window_maths import Kept

log = logging.getLogger(__name__)

_EMPTY = WindowStats(0, 0, 0, 0, "empty")  # a window of no tokens, or with none staged


class PoolWrites:
    def __init__(self, storage: KVStorage, backend: Backend, staging: StagingBuffers,
                 keep: DeviceKeep, scales: Fp8Scales, protection: BlockProtection,
                 counters: WindowCounters, graphs: CommitGraphs) -> None:
        self.storage = storage
        self.backend = backend
        self.staging = staging
        self.keep = keep
        self.scales = scales
        self.protection = protection
        self.counters = counters
        self.graphs = graphs
        self.fence: WriterFence | None = None  # the open window's writer's (`fence.py`)

    def write_or_fall_back(self, layout: WindowLayout,
                           write: Callable[[], WindowStats]) -> WindowStats:
        """The window's ``write``; on any failure, or with a layer staged only partly, every
        staged token instead."""
        self.counters.counted_on_device = False
        if self.staging.partly_staged(layout.total_tokens):
            return self.write_all_staged(INCOMPLETE_STAGING)
        try:
            return write()
        except Exception as exc:  # any failure must still land every staged token
            self.counters.uncount_device_window()
            return self.write_all_staged(f"error:{type(exc).__name__}", exc)

    def write_host_counted(self, layout: WindowLayout, accepted: np.ndarray,
                           kept: Kept) -> WindowStats:
        """The window's kept tokens, ``kept`` as `StagingSpec.checked_host_counts` made it."""
        total = layout.total_tokens
        if total == 0 or not self.staging.any_staged():
            return _EMPTY
        _, kept_slots, per_position, committed, written = kept
        staging = self.staging
        if staging.host_slots is not None:
            self.write_host_slots(None if committed == total else kept_slots)
        elif committed == total:
            write_staged(self.storage.rows(), staging.source, staging.slots, staging.layer_rows,
                         total, self.scales.inv, backend=self.backend,
                         fence=self.fence)
        else:
            self.keep.upload(layout)
            self.keep.load_counts(accepted)
            self.mask_and_write(total, record=False)
        self.counters.count_kept_drafts(per_position)  # once written: a fallback commits no draft
        return WindowStats(total, committed, total - committed, 0,
                           "fast" if committed == total else "masked",
                           written=None if staging.host_slots is None else written)

    def write_device_counted(self, layout: WindowLayout, accepted: torch.Tensor) -> WindowStats:
        """The window's kept tokens by ``accepted``, a device tensor never read back: the keep
        mask, or the smallest commit graph that covers the window."""
        total = layout.total_tokens
        if total == 0 or not self.staging.any_staged():
            return _EMPTY
        self.keep.load_counts(accepted)
        # The commit graphs are captured unfenced: a fenced window runs eagerly.
        graph = (self.graphs.commit_graph(total)
                 if self.staging.own_buffer and self.fence is None else None)
        if graph is None:
            self.mask_and_write(total, record=True)
            return self.counters.device_window(total, "device")
        graph.graph.replay()
        self.counters.counted_on_device = True
        return self.counters.device_window(total, "graph")

    def write_verified(self, layout: WindowLayout, draft_ids: torch.Tensor,
                       sampled_ids: torch.Tensor,
                       num_draft: torch.Tensor) -> tuple[WindowStats, torch.Tensor | None]:
        """Acceptance of ``draft_ids`` against ``sampled_ids``, then `write_device_counted` of
        what it accepts, or one verify graph replay of both; falls back like
        `write_or_fall_back`. The window's stats, and the accepted counts unless it fell back
        before they were computed."""
        counts: torch.Tensor | None = None

        def write() -> WindowStats:
            nonlocal counts
            graph = (self.graphs.verify_graph(layout.total_tokens, draft_ids, sampled_ids)
                     if self.staging.own_buffer and self.fence is None else None)
            if graph is None:
                counts = accept(draft_ids, sampled_ids, num_draft)[1]
                return self.write_device_counted(layout, counts)
            assert graph.acceptance is not None
            graph.acceptance.load(draft_ids, sampled_ids, num_draft)
            graph.graph.replay()
            self.counters.counted_on_device = True
            counts = self.keep.accepted[: layout.num_requests].clone()
            return self.counters.device_window(layout.total_tokens, "graph")

        return self.write_or_fall_back(layout, write), counts

    def mask_and_write(self, rows: int, *, record: bool) -> None:
        """Keep mask -> rejected slots set to -1 -> fused write (-> device counters, if
        ``record``) over the first ``rows`` staged rows. Device operations on static buffers
        only: what the commit and verify graphs capture."""
        keep = self.keep
        if record:  # what a failure past this point takes back (`uncount_device_window`)
            self.counters.on_device[0].zero_()
        self.counters.counted_on_device = record
        commit_packed(self.storage.rows(), self.staging.source, self.staging.slots,
                      self.staging.layer_rows, rows, keep.tokens, keep.accepted, keep.requests,
                      keep.masked_slots, counters=self.counters.on_device if record else None,
                      inv_scales=self.scales.inv, fence=self.fence, backend=self.backend)

    def warm_up_mask_and_write(self, rows: int) -> None:
        """A graph's warm-up: `mask_and_write`'s kernels (compiled here, never inside a
        capture) with no layer staged, so nothing is written, and the counters restored
        afterwards."""
        saved = self.counters.saved_on_device()
        self.staging.layer_rows.zero_()
        self.mask_and_write(rows, record=True)
        self.counters.restore_on_device(saved)

    def write_host_slots(self, kept_slots: np.ndarray | None) -> None:
        """The write of a window staged with host slots, whose rejected tokens' slots are -1 in
        ``kept_slots`` (None: every token is kept): one upload, one write over every layer (one
        graph replay on CUDA)."""
        staging = self.staging
        assert staging.host_slots is not None
        graphs = self._host_write_graphs()
        if graphs is None or not graphs.replay(
                staging.source, staging.host_slots,
                staging.host_slots if kept_slots is None else kept_slots,
                self.write_uploaded_slots, variant=self._variant()):
            staging.upload_host_slots(kept_slots)
            write_staged(self.storage.rows(), staging.source,
                         staging.shared_row(int(kept_slots is not None)), staging.all_rows,
                         staging.host_slots.size, self.scales.inv, backend=self.backend,
                         fence=self.fence)

    def write_uploaded_slots(self, staged: torch.Tensor, kept: torch.Tensor, rows: int) -> None:
        """What a host-slot write's graph runs once the slot rows are on the device: the eager
        path's guard (`BlockProtection.guard_host_rows`) and fused write, over ``rows`` rows."""
        self.protection.guard_host_rows(staged, kept)
        write_staged(self.storage.rows(), self.staging.source, self.staging.every_layer(kept),
                     self.staging.all_rows, rows, self.scales.inv, backend=self.backend,
                         fence=self.fence)

    def _variant(self) -> int | tuple[int | None, int] | None:
        """What a host-slot write's graph bakes in besides its buffer: the protection mask's
        address, and the writer's fence word's where the write is fenced."""
        if self.fence is None:
            return self.protection.variant
        return self.protection.variant, self.fence.word.data_ptr()

    def _host_write_graphs(self) -> HostWriteGraphs | None:
        return self.graphs.host_writes()

    def capture_host_writes(self, source: torch.Tensor) -> bool:
        """Capture every row bucket of host-slot writes from ``source``, between windows;
        False where those writes replay no graph, or a capture failed."""
        graphs = self._host_write_graphs()
        if graphs is None:
            return False
        with self.staging.reading(source):  # what the captured write reads
            return graphs.capture(source, self.write_uploaded_slots, self._variant())

    def write_all_staged(self, reason: str, exc: BaseException | None = None) -> WindowStats:
        """The fallback: every staged token, with the reference torch write (what an engine
        without NWOR does), counted with ``reason``."""
        if reason not in self.counters.fallbacks:
            log.warning("NWOR fallback (%s): writing every staged token", reason, exc_info=exc)
        staging = self.staging
        rows = max(staging.rows, default=0)
        slots, layer_rows, written = staging.slots, staging.layer_rows, None
        if staging.host_slots is not None:
            if not staging.host_slots_uploaded:
                staging.upload_host_slots()
            slots, layer_rows = staging.shared_row(0), staging.all_rows
            written = int(np.count_nonzero(staging.host_slots >= 0))
        write_staged(self.storage.rows(), staging.source, slots, layer_rows, rows,
                     self.scales.inv, backend="torch", fence=self.fence)
        self.counters.count_fallback(reason)
        return WindowStats(rows, 0, 0, rows, "fallback", reason, written)
