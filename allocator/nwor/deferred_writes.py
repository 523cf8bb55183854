"""`DeferredWriteManager`: No-Write-On-Reject. A verify step's K/V is staged, and only the tokens
that survive verification are written into the pool.

Lifecycle of one window (one scheduler step):

1. ``begin_window(layout)``: the step's requests, in slot-mapping order, with the number of tokens
   each schedules (a prefill chunk, or a decode's last verified token plus its D drafts) and how
   many of those are drafts (always the request's last tokens). The window counts every scheduled
   token, because the slot mapping does.
2. ``stage_layer(layer, key, value, slot_mapping)`` once or more per layer: each layer has its own
   running offset, so layers stage independently and a layer may stage in several chunks. During
   the forward, attention reads this step's K/V from ``staged_kv(layer)`` and history from the
   pool (see `attention`). Or, when the forward already wrote every layer's K/V into a buffer of
   its own (a worker's shared staging buffer), ``stage_from(staging, slot_mapping)`` once: the
   commit then reads that buffer directly, so a window costs the same few launches whatever the
   number of layers.
3. ``commit(accepted_counts)`` (or ``verify_and_commit(draft_ids, sampled_ids)``): non-draft tokens
   are always written, a request's drafts only up to its accepted count. ``cancel(reason)`` ends a
   window the engine abandons.

Invariants:
- the pool never receives a rejected draft, except through a fallback;
- fallback: any failure inside a window (a layer staged only partly, an error during the write,
  out-of-range counts in a device tensor, ``cancel``) writes every staged token, which is what an
  engine without NWOR does, and is counted with its reason. No committed token is ever lost;
- bad input raises a typed error before anything changes; the window stays as it was;
- per window, staged == committed + rejected + fallback tokens, so no metric can go negative;
- a slot in a protected block (``protect``: cached prefix blocks other requests read) is set to
  -1 before anything is written, so neither the commit nor its fallback can write it, whatever
  the caller's slot mapping says; each such staged token is counted once
  (``NworMetrics.protected_refusals``).

The device commit (counts -> per-token keep mask -> rejected slots set to -1 -> one fused write
over every layer -> device-side metrics) uses only static buffers and device operations, so it
runs without host synchronisation and can be captured in a CUDA graph (``capture_commit_graph``,
``capture_verify_graph``, which also captures the acceptance mask). A commit staged with host
slots replays a graph per staging buffer and row bucket (`host_write_graphs`): captured by the
first commit that needs it, or for every bucket ahead of the first window by
``capture_host_write_graphs(staging)``.

Accepted counts given as a list are validated on the host: more accepted than drafts raises
`AcceptedExceedsDrafts`, never a clamp. A tensor is never read back (that would synchronise): it
is checked on the device, and an out-of-range count makes the window fall back (reason
``accepted_out_of_range``), again never a clamp.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from allocator.common.device_io import PinnedUploads
from allocator.errors import NworInputError, StagingOverflow, WindowStateError
from allocator.nwor.acceptance import StaticAcceptance, accept, validate_inputs
from allocator.nwor.commit_kernel import Backend, resolve_backend, write_staged
from allocator.nwor.deferred.counters import WindowCounters
from allocator.nwor.deferred.device_keep import DeviceKeep
from allocator.nwor.deferred.fp8_scales import Fp8Scales
from allocator.nwor.deferred.graphs import CommitGraphs
from allocator.nwor.deferred.input_checks import StagingSpec
from allocator.nwor.deferred.protection import BlockProtection
from allocator.nwor.deferred.staging import StagingBuffers
from allocator.nwor.host_write_graphs import HostWriteGraphs
from allocator.nwor.storage import KVStorage
from allocator.nwor.window import NworMetrics, WindowLayout, WindowStats
from allocator.nwor.window_maths import Kept

log = logging.getLogger(__name__)

INCOMPLETE_STAGING = "incomplete_staging"


class DeferredWriteManager:
    """Stages each window's K/V and commits accepted tokens into ``storage``'s pool.

    ``max_tokens`` bounds a window's scheduled tokens, ``max_requests`` its requests (default: the
    pool's ``max_batch_size``). Staging holds ``[num_layers, 2, max_tokens, H * D]`` in
    ``stage_dtype`` (the pool dtype; for fp8 pools the model's dtype, bf16 by default, quantised
    with each layer's scales on commit).
    """

    def __init__(self, storage: KVStorage, *, max_tokens: int, max_requests: int | None = None,
                 stage_dtype: torch.dtype | None = None, backend: Backend = "auto") -> None:
        cfg = storage.config
        self.storage = storage
        self.spec = StagingSpec.of(storage, max_tokens=max_tokens, max_requests=max_requests,
                                   stage_dtype=stage_dtype)
        self.backend = resolve_backend(backend, self.device)

        dev = self.device
        self._uploads = PinnedUploads(dev)
        self._positions = self.spec.positions
        self._protection = BlockProtection(cfg.total_blocks, cfg.tokens_per_block, dev)
        self._staging = StagingBuffers(self.spec, self._protection, self._uploads)
        self._keep = DeviceKeep(self.spec, self._uploads)
        self._counters = WindowCounters(self._positions, dev)
        self._scales = Fp8Scales(storage, dev)

        self._layout: WindowLayout | None = None
        self._graphs = CommitGraphs(self.max_tokens, dev, self.backend)

    # ---- window lifecycle -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.spec.device

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def head_shape(self) -> tuple[int, int]:
        return self.spec.head_shape

    @property
    def max_tokens(self) -> int:
        return self.spec.max_tokens

    @property
    def max_requests(self) -> int:
        return self.spec.max_requests

    @property
    def stage_dtype(self) -> torch.dtype:
        return self.spec.stage_dtype

    @property
    def _inv(self) -> torch.Tensor | None:
        """The reciprocal fp8 scales the commit quantises with (None: it copies)."""
        return self._scales.inv

    @property
    def _protected(self) -> torch.Tensor | None:
        """The mask of protected blocks (None: no guard)."""
        return self._protection.blocks

    @property
    def _host_graphs(self) -> HostWriteGraphs | None:
        """The graphs of host-slot commits, once made."""
        return self._graphs.host

    @property
    def window_open(self) -> bool:
        return self._layout is not None

    @property
    def layout(self) -> WindowLayout | None:
        return self._layout

    def protect(self, blocks: torch.Tensor | None) -> None:
        """Refuse writes into blocks where ``blocks`` (bool, one per pool block, on the pool's
        device; the caller keeps it current) is True; None turns the guard off."""
        self._protection.set(blocks)

    def staged_rows(self, layer: int) -> int:
        """Tokens staged so far in ``layer`` during the open window."""
        return self._staging.rows[layer]

    def begin_window(self, layout: WindowLayout) -> None:
        if self._layout is not None:
            raise WindowStateError("window: begin_window while a window is open; commit or "
                                   "cancel it first")
        self.spec.check_layout(layout)
        self._layout = layout

    def stage_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None,
                    v_scale: float | torch.Tensor | None = None) -> None:
        """Stage the next ``len(slot_mapping)`` tokens of ``layer`` (``key``/``value``:
        ``[n, H, D]`` or ``[n, H * D]`` in ``stage_dtype``; ``slot_mapping``: int64 ``[n]``).

        ``k_scale``/``v_scale`` (fp8 pools only; ignored otherwise): dequantisation scales to
        quantise this layer's K/V with on commit instead of the pool's own. They hold for the
        layer's whole write in this window: the layer's last ``stage_layer`` call decides, and
        None means the pool's scale. Readers must dequantise with the same scale.
        """
        layout = self._require_window("stage_layer")
        if not self._staging.own_buffer:
            raise WindowStateError("window: stage_layer after stage_from; a window stages from "
                                   "one place")
        self.spec.check_layer(layer)
        n = self.spec.checked_stage_tensors(key, value, slot_mapping)
        offset = self._staging.start_chunk(layer)
        if offset + n > layout.total_tokens:
            raise StagingOverflow(
                f"slot_mapping: layer {layer} stages {n} tokens at offset {offset}, past the "
                f"window's {layout.total_tokens} scheduled tokens")
        scales = [self._scales.checked(name, s) for name, s in (("k_scale", k_scale),
                                                                ("v_scale", v_scale))]
        self._staging.write_chunk(layer, offset, key, value, slot_mapping)
        self._scales.set_layer(layer, scales)

    def stage_from(self, staging: torch.Tensor, slot_mapping: torch.Tensor | np.ndarray) -> None:
        """Stage the whole window, every layer at once, from the caller's buffer: token ``i`` of
        layer ``l`` is ``staging[l, 0 (K) / 1 (V), i]`` and goes to ``slot_mapping[i]``.

        ``slot_mapping`` is an int64 tensor on the pool's device, or an int64 numpy array: a
        caller that knows the slots and the accepted counts on the host (a service) then gets
        the keep mask computed on the host too, and a commit of one upload and one write.

        ``staging`` is a contiguous ``[num_layers, 2, capacity, H, D]`` (or ``[..., H * D]``)
        tensor in ``stage_dtype`` on the pool's device with capacity >= the window's tokens. It is
        read, never copied, by the commit: it must hold this window's K/V until ``commit``
        returns (on CUDA: until the commit's work on the current stream has run). Instead of, not
        as well as, ``stage_layer``.
        """
        layout = self._require_window("stage_from")
        if self._staging.any_staged():
            raise WindowStateError("window: stage_from after stage_layer; a window stages from "
                                   "one place")
        total = layout.total_tokens
        source = self.spec.checked_staging(staging, total)
        self._staging.stage_from(source, self.spec.checked_slot_mapping(slot_mapping, total))

    def staged_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[staged_rows, H, D]`` of this window's staged K and V for ``layer``."""
        self._require_window("staged_kv")
        return self._staging.staged_kv(layer)

    def commit(self, accepted_counts: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Write every staged layer's committed tokens and close the window."""
        layout = self._require_window("commit")
        if isinstance(accepted_counts, torch.Tensor):
            counts = self.spec.checked_device_counts(accepted_counts, layout)
            self._prepare_device_window()
            self._run_window(lambda: self._commit_device(layout, counts))
        else:
            host, kept = self.spec.checked_host_counts(accepted_counts, layout,
                                                       self._staging.host_slots)
            self._run_window(lambda: self._commit_host(layout, host, kept))

    def verify_and_commit(self, draft_ids: torch.Tensor,
                          sampled_ids: torch.Tensor) -> torch.Tensor:
        """Acceptance (`acceptance_mask` over the window's requests and draft counts) and commit
        in one call, replaying a captured verify graph when one fits. Returns the accepted counts
        (int64 device tensor)."""
        layout = self._require_window("verify_and_commit")
        validate_inputs(draft_ids, sampled_ids, list(layout.num_draft))
        self.spec.check_on_pool("draft_ids", draft_ids)
        self._prepare_device_window()
        num_draft = self._keep.num_draft(layout.num_requests)
        counts: torch.Tensor | None = None

        def body() -> WindowStats:
            nonlocal counts
            graph = (self._graphs.verify_graph(layout.total_tokens, draft_ids, sampled_ids)
                     if self._staging.own_buffer else None)
            if graph is None:
                counts = accept(draft_ids, sampled_ids, num_draft)[1]
                return self._commit_device(layout, counts)
            assert graph.acceptance is not None
            graph.acceptance.load(draft_ids, sampled_ids, num_draft)
            graph.graph.replay()
            self._counters.counted_on_device = True
            counts = self._keep.accepted[: layout.num_requests].clone()
            return self._counters.device_window(layout.total_tokens, "graph")

        self._run_window(body)
        if counts is None:  # the window fell back before acceptance ran
            counts = accept(draft_ids, sampled_ids, num_draft)[1]
        return counts

    def cancel(self, reason: str) -> None:
        """Abandon the open window: write every staged token (fallback) and record ``reason``."""
        self._require_window("cancel")
        if not isinstance(reason, str) or not reason:
            raise NworInputError("reason: a non-empty string", field="reason")
        self._close(self._fallback(reason))

    # ---- CUDA graphs --------------------------------------------------------------------------

    def capture_commit_graph(self, max_window_tokens: int) -> None:
        """Capture the device commit (keep mask + fused write + metrics) for windows of up to
        ``max_window_tokens`` tokens; ``commit`` with a device tensor then replays it."""
        rows = self.spec.checked_capture(max_window_tokens, window_open=self.window_open)
        self._graphs.capture_commit(rows, lambda: self._device_commit(rows, record=True),
                                    lambda: self._quiet_commit(rows))

    def capture_verify_graph(self, max_window_tokens: int, *, max_requests: int, width: int,
                             flat_drafts: bool = False) -> None:
        """Capture acceptance + commit for windows of up to ``max_window_tokens`` tokens and
        ``max_requests`` requests, with ``sampled_ids`` up to ``width`` columns and drafts flat
        or padded; ``verify_and_commit`` then replays it."""
        rows = self.spec.checked_capture(max_window_tokens, window_open=self.window_open)
        self.spec.check_capture_requests(max_requests)
        static = StaticAcceptance(flat=flat_drafts, batch=max_requests, width=width,
                                  device=self.device)
        self._graphs.capture_verify(rows, static, self._keep.accepted[:max_requests],
                                    lambda: self._device_commit(rows, record=True),
                                    lambda: self._quiet_commit(rows))

    def capture_host_write_graphs(self, staging: torch.Tensor) -> bool:
        """Capture now the graph of every row bucket that a commit staged from ``staging`` with
        host slots replays (under the current ``protect`` guard), kept until
        ``drop_host_write_graphs``: a capture synchronises the device and takes milliseconds,
        which the first commits from ``staging`` then do not pay. ``staging`` as ``stage_from``
        takes it; between windows only. False where those commits run no graph (a CPU pool, the
        torch write) or a capture failed (logged once; they write eagerly from then on)."""
        if self._layout is not None:
            raise WindowStateError("window: capture graphs between windows, not inside one")
        source = self.spec.checked_staging(staging, 1)
        graphs = self._graphs.host_writes(self._write_captured)
        if graphs is None:
            return False
        with self._staging.reading(source):  # what the captured write reads
            return graphs.capture(source, self._protection.variant)

    def drop_host_write_graphs(self, staging: torch.Tensor) -> int:
        """Forget the graphs that commit from ``staging``, before its memory is released (it
        may come back as another buffer); how many went."""
        source = self.spec.checked_staging(staging, 1)
        return self._graphs.drop_host_writes(source)

    # ---- metrics ------------------------------------------------------------------------------

    def metrics(self) -> NworMetrics:
        """Cumulative metrics. Reads the device-side counters back if any window committed from a
        device tensor (a synchronisation, so call it off the hot path)."""
        return self._counters.metrics(self._protection.refusals())

    @property
    def last_window(self) -> WindowStats | None:
        """The last closed window (reads device counters back if it committed on the device)."""
        return self._counters.last_window()

    # ---- internals ----------------------------------------------------------------------------

    def _require_window(self, call: str) -> WindowLayout:
        if self._layout is None:
            raise WindowStateError(f"window: {call} with no open window (begin_window first)")
        return self._layout

    def _run_window(self, body: Callable[[], WindowStats]) -> None:
        """Run the window's write; on any failure write every staged token instead; close."""
        assert self._layout is not None
        total = self._layout.total_tokens
        self._counters.counted_on_device = False
        if self._staging.partly_staged(total):
            stats = self._fallback(INCOMPLETE_STAGING)
        else:
            try:
                stats = body()
            except Exception as exc:  # any failure must still land every staged token
                self._counters.uncount_device_window()
                stats = self._fallback(f"error:{type(exc).__name__}", exc)
        self._close(stats)

    def _commit_host(self, layout: WindowLayout, accepted: np.ndarray,
                     kept: Kept) -> WindowStats:
        total = layout.total_tokens
        if total == 0 or not self._staging.any_staged():
            return WindowStats(0, 0, 0, 0, "empty")
        _, kept_slots, per_position, committed, written = kept
        if self._staging.host_slots is not None:
            self._write_host_slots(None if committed == total else kept_slots)
        elif committed == total:
            write_staged(self.storage.rows(), self._staging.source, self._staging.slots,
                         self._staging.layer_rows, total, self._inv, backend=self.backend)
        else:
            self._keep.upload(layout)
            self._keep.load_counts(accepted)
            self._device_commit(total, record=False)
        self._counters.count_kept_drafts(per_position)  # once written: a fallback commits no draft
        return WindowStats(total, committed, total - committed, 0,
                           "fast" if committed == total else "masked",
                           written=None if self._staging.host_slots is None else written)

    def _commit_device(self, layout: WindowLayout, accepted: torch.Tensor) -> WindowStats:
        total = layout.total_tokens
        if total == 0 or not self._staging.any_staged():
            return WindowStats(0, 0, 0, 0, "empty")
        self._keep.load_counts(accepted)
        graph = self._graphs.commit_graph(total) if self._staging.own_buffer else None
        if graph is None:
            self._device_commit(total, record=True)
            return self._counters.device_window(layout.total_tokens, "device")
        graph.graph.replay()
        self._counters.counted_on_device = True
        return self._counters.device_window(layout.total_tokens, "graph")

    def _write_host_slots(self, kept_slots: np.ndarray | None) -> None:
        """The commit of a window staged with host slots, whose rejected tokens' slots are -1 in
        ``kept_slots`` (None: every token is kept): one upload, one write over every layer (one
        graph replay on CUDA)."""
        assert self._staging.host_slots is not None
        graphs = self._graphs.host_writes(self._write_captured)
        if graphs is None or not graphs.replay(
                self._staging.source, self._staging.host_slots,
                self._staging.host_slots if kept_slots is None else kept_slots,
                variant=self._protection.variant):
            self._staging.upload_host_slots(kept_slots)
            write_staged(self.storage.rows(), self._staging.source,
                         self._staging.shared_row(int(kept_slots is not None)),
                         self._staging.all_rows, self._staging.host_slots.size, self._inv,
                         backend=self.backend)

    def _write_captured(self, staged: torch.Tensor, kept: torch.Tensor, rows: int) -> None:
        """What a host-slot commit's graph runs once the slot rows are on the device: the
        eager path's guard (`guard_host_rows`) and fused write, over ``rows`` rows."""
        self._protection.guard_host_rows(staged, kept)
        write_staged(self.storage.rows(), self._staging.source, self._staging.every_layer(kept),
                     self._staging.all_rows, rows, self._inv, backend=self.backend)

    def _prepare_device_window(self) -> None:
        """What a device-side commit reads: the window's tables and per-layer slot rows."""
        self._keep.upload(self._require_window("commit"))
        self._staging.host_slots_to_slot_rows()

    def _device_commit(self, rows: int, *, record: bool) -> None:
        """Keep mask -> rejected slots set to -1 -> fused write (-> device metrics) over the
        first ``rows`` staged rows. Device operations on static buffers only."""
        self._keep.mask(self._staging.slots, rows,
                        self._counters.on_device if record else None, backend=self.backend)
        self._counters.counted_on_device = record
        write_staged(self.storage.rows(), self._staging.source, self._keep.masked_slots,
                     self._staging.layer_rows, rows, self._inv, backend=self.backend)

    def _quiet_commit(self, rows: int) -> None:
        """Graph warm-up: the captured kernels (compiled here, never inside a capture) with no
        layer staged, so nothing is written, and the counters restored afterwards."""
        saved = self._counters.saved_on_device()
        self._staging.layer_rows.zero_()
        self._device_commit(rows, record=True)
        self._counters.restore_on_device(saved)

    def _fallback(self, reason: str, exc: BaseException | None = None) -> WindowStats:
        """Write every staged token with the reference torch path (what a non-NWOR engine does)."""
        if reason not in self._counters.fallbacks:
            log.warning("NWOR fallback (%s): writing every staged token", reason, exc_info=exc)
        rows = max(self._staging.rows, default=0)
        slots, layer_rows, written = self._staging.slots, self._staging.layer_rows, None
        if self._staging.host_slots is not None:
            if not self._staging.host_slots_uploaded:
                self._staging.upload_host_slots()
            slots, layer_rows = self._staging.shared_row(0), self._staging.all_rows
            written = int(np.count_nonzero(self._staging.host_slots >= 0))
        write_staged(self.storage.rows(), self._staging.source, slots, layer_rows, rows, self._inv,
                     backend="torch")
        self._counters.count_fallback(reason)
        return WindowStats(rows, 0, 0, rows, "fallback", reason, written)

    def _close(self, stats: WindowStats) -> None:
        """Count the window and let go of it: what a capture between windows reads (the
        manager's own staging) and no longer the caller's buffer, which may be released."""
        self._counters.close(stats)
        self._keep.uploaded = False
        self._staging.reset()
        self._layout = None
