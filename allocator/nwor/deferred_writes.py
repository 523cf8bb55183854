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
runs without host synchronisation and can be captured in a CUDA graph, between windows, through
``graphs`` (`deferred.capture.GraphCapture`): ``graphs.capture_commit``, and
``graphs.capture_verify``, which also captures the acceptance mask. A commit staged with host
slots replays a graph per staging buffer and row bucket (`host_write_graphs`): captured by the
first commit that needs it, or for every bucket ahead of the first window by
``graphs.capture_host_writes(staging)``.

Accepted counts given as a list are validated on the host: more accepted than drafts raises
`AcceptedExceedsDrafts`, never a clamp. A tensor is never read back (that would synchronise): it
is checked on the device, and an out-of-range count makes the window fall back (reason
``accepted_out_of_range``), again never a clamp.

The manager coordinates; its parts (`allocator.nwor.deferred`) each own one job's data and state
the invariants of that data where it lives. ``check_invariants()`` checks them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from kvalloc.allocator.common.device_io import PinnedUploads
from kvalloc.allocator.errors import (
    InvariantViolation,
    NworInputError,
    StagingOverflow,
    WindowStateError,
)
from kvalloc.allocator.nwor.acceptance import accept, validate_inputs
from kvalloc.allocator.nwor.commit_kernel import Backend, resolve_backend
from kvalloc.allocator.nwor.deferred.capture import GraphCapture
from kvalloc.allocator.nwor.deferred.counters import WindowCounters
from kvalloc.allocator.nwor.deferred.device_keep import DeviceKeep
from kvalloc.allocator.nwor.deferred.fp8_scales import Fp8Scales
from kvalloc.allocator.nwor.deferred.graphs import CommitGraphs
from kvalloc.allocator.nwor.deferred.input_checks import StagingSpec
from kvalloc.allocator.nwor.deferred.pool_writes import PoolWrites
from kvalloc.allocator.nwor.deferred.protection import BlockProtection
from kvalloc.allocator.nwor.deferred.staging import StagingBuffers
from kvalloc.allocator.nwor.fence import WriterFence
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.window import NworMetrics, WindowLayout, WindowStats


class DeferredWriteManager:
    """Stages each window's K/V and commits accepted tokens into ``storage``'s pool.

    ``max_tokens`` bounds a window's scheduled tokens, ``max_requests`` its requests (default: the
    pool's ``max_batch_size``). Staging holds ``[num_layers, P, max_tokens, H * D]`` in
    ``stage_dtype`` (the pool dtype; for fp8 pools the model's dtype, bf16 by default, quantised
    with each layer's scales on commit). What it was built for, resolved, is ``spec``
    (`StagingSpec`: ``spec.device``, ``spec.num_layers``, ``spec.stage_dtype``, ...).
    """

    # All of the manager's state: what it was built for, the open window, and the parts that
    # each own one job's data.
    storage: KVStorage
    spec: StagingSpec
    backend: Literal["torch", "triton"]
    _layout: WindowLayout | None  # the open window; None between windows
    _scales: Fp8Scales
    _protection: BlockProtection
    _staging: StagingBuffers
    _keep: DeviceKeep
    _counters: WindowCounters
    _writes: PoolWrites
    _captured: CommitGraphs

    def __init__(self, storage: KVStorage, *, max_tokens: int, max_requests: int | None = None,
                 stage_dtype: torch.dtype | None = None, backend: Backend = "auto") -> None:
        self.storage = storage
        self.spec = spec = StagingSpec.of(storage, max_tokens=max_tokens,
                                          max_requests=max_requests, stage_dtype=stage_dtype)
        self.backend = resolve_backend(backend, spec.device)
        cfg, dev = storage.config, spec.device
        uploads = PinnedUploads(dev)  # one pinned buffer serves every upload of a window
        self._layout = None
        self._scales = Fp8Scales(storage, dev)
        self._protection = BlockProtection(cfg.total_blocks, cfg.tokens_per_block, dev)
        self._staging = StagingBuffers(spec, self._protection, uploads)
        self._keep = DeviceKeep(spec, uploads)
        self._counters = WindowCounters(spec.positions, dev)
        self._captured = CommitGraphs(spec.max_tokens, dev, self.backend)
        self._writes = PoolWrites(storage, self.backend, self._staging, self._keep, self._scales,
                                  self._protection, self._counters, self._captured)

    @property
    def graphs(self) -> GraphCapture:
        """The CUDA graphs its commits replay, captured ahead of the windows. Made on each use,
        never kept: a kept one would hold the manager (its window check) in a reference cycle,
        which only the cyclic collector frees, and a collection during another stream's capture
        destroying this manager's graphs aborts the process."""
        return GraphCapture(self.spec, self._captured, self._writes, self._keep,
                            window_open=lambda: self._layout is not None)

    # ---- window lifecycle ---------------------------------------------------------------------

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
        """Tokens staged so far in ``layer`` during the open window (0 between windows)."""
        return self._staging.rows[layer]

    def begin_window(self, layout: WindowLayout, fence: WriterFence | None = None) -> None:
        """Open the window of one step's ``layout`` (lifecycle: the module's docstring); every
        write of the window, its fallback too, is fenced by ``fence`` (`fence.WriterFence`:
        nothing is written once the writer's session has ended)."""
        if self._layout is not None:
            raise WindowStateError("window: begin_window while a window is open; commit or "
                                   "cancel it first")
        self.spec.check_layout(layout)
        if fence is not None:
            fence.check(self.spec.device)
        self._layout = layout
        self._writes.fence = fence

    def stage_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor | None,
                    slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None,
                    v_scale: float | torch.Tensor | None = None) -> None:
        """Stage the next ``len(slot_mapping)`` tokens of ``layer`` (``key``/``value``:
        ``[n, H, D]`` or ``[n, H * D]`` in ``stage_dtype``; ``slot_mapping``: int64 ``[n]``). A
        latent pool (``kv_layout="latent"``) stages its latent as ``key`` with ``value`` None.

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
        if v_scale is not None and self.spec.planes == 1:
            raise NworInputError("v_scale: a latent pool has no V; its one scale is k_scale",
                                 field="v_scale")
        n = self.spec.checked_stage_tensors(key, value, slot_mapping)
        offset = self._staging.start_chunk(layer)
        if offset + n > layout.total_tokens:
            raise StagingOverflow(
                f"slot_mapping: layer {layer} stages {n} tokens at offset {offset}, past the "
                f"window's {layout.total_tokens} scheduled tokens")
        scales = [self._scales.checked("k_scale", k_scale),
                  self._scales.checked("v_scale", v_scale)]
        self._staging.write_chunk(layer, offset, key, value, slot_mapping)
        self._scales.set_layer(layer, scales)

    def stage_from(self, staging: torch.Tensor, slot_mapping: torch.Tensor | np.ndarray) -> None:
        """Stage the whole window, every layer at once, from the caller's buffer: token ``i`` of
        layer ``l`` is ``staging[l, 0 (K) / 1 (V), i]`` and goes to ``slot_mapping[i]``.

        ``slot_mapping`` is an int64 tensor on the pool's device, or an int64 numpy array: a
        caller that knows the slots and the accepted counts on the host (a service) then gets
        the keep mask computed on the host too, and a commit of one upload and one write.

        ``staging`` is a contiguous ``[num_layers, P, capacity, H, D]`` (or ``[..., H * D]``; P
        the pool's ``kv_planes``)
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
        writes = self._writes
        if isinstance(accepted_counts, torch.Tensor):
            counts = self.spec.checked_device_counts(accepted_counts, layout)
            self._prepare_device_counts(layout)
            self._close(writes.write_or_fall_back(
                layout, lambda: writes.write_device_counted(layout, counts)))
        else:
            host, kept = self.spec.checked_host_counts(accepted_counts, layout,
                                                       self._staging.host_slots)
            self._close(writes.write_or_fall_back(
                layout, lambda: writes.write_host_counted(layout, host, kept)))

    def verify_and_commit(self, draft_ids: torch.Tensor,
                          sampled_ids: torch.Tensor) -> torch.Tensor:
        """Acceptance (`acceptance_mask` over the window's requests and draft counts) and commit
        in one call, replaying a captured verify graph when one fits. Returns the accepted counts
        (int64 device tensor)."""
        layout = self._require_window("verify_and_commit")
        validate_inputs(draft_ids, sampled_ids, list(layout.num_draft))
        self.spec.check_on_pool("draft_ids", draft_ids)
        self._prepare_device_counts(layout)
        num_draft = self._keep.num_draft(layout.num_requests)
        stats, counts = self._writes.write_verified(layout, draft_ids, sampled_ids, num_draft)
        self._close(stats)
        if counts is None:  # the window fell back before acceptance ran
            counts = accept(draft_ids, sampled_ids, num_draft)[1]
        return counts

    def cancel(self, reason: str) -> None:
        """Abandon the open window: write every staged token (fallback) and record ``reason``."""
        self._require_window("cancel")
        if not isinstance(reason, str) or not reason:
            raise NworInputError("reason: a non-empty string", field="reason")
        self._close(self._writes.write_all_staged(reason))

    # ---- metrics and invariants ---------------------------------------------------------------

    def metrics(self) -> NworMetrics:
        """Cumulative metrics. Reads the device-side counters back if any window committed from a
        device tensor (a synchronisation, so call it off the hot path)."""
        return self._counters.metrics(self._protection.refusals())

    @property
    def last_window(self) -> WindowStats | None:
        """The last closed window (reads device counters back if it committed on the device)."""
        return self._counters.last_window()

    def check_invariants(self) -> None:
        """Raise InvariantViolation if the manager's own state contradicts itself: each part's
        invariants, as its module states them, with the window open or closed. Reads device
        state back (a synchronisation on CUDA), so it is for tests, not the hot path."""
        layout = self._layout
        if layout is not None and (layout.total_tokens > self.spec.max_tokens
                                   or layout.num_requests > self.spec.max_requests):
            raise InvariantViolation("window: the open layout exceeds max_tokens or max_requests")
        self._staging.check_invariants(None if layout is None else layout.total_tokens)
        self._keep.check_invariants(window_open=layout is not None)
        self._counters.check_invariants()
        self._protection.check_invariants()
        self._captured.check_invariants(self.spec.max_requests)
        self._scales.check_invariants(self.spec.num_layers)

    # ---- internals ----------------------------------------------------------------------------

    def _require_window(self, call: str) -> WindowLayout:
        if self._layout is None:
            raise WindowStateError(f"window: {call} with no open window (begin_window first)")
        return self._layout

    def _prepare_device_counts(self, layout: WindowLayout) -> None:
        """What a commit with device counts reads: the window's tables and per-layer slot
        rows."""
        self._keep.upload(layout)
        self._staging.host_slots_to_slot_rows()

    def _close(self, stats: WindowStats) -> None:
        """Count the window and let go of it: what a capture between windows reads (the
        manager's own staging) and no longer the caller's buffer, which may be released."""
        self._counters.close(stats)
        self._keep.mark_stale()
        self._staging.reset()
        self._layout = None
        self._writes.fence = None
