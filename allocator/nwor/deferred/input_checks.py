"""`StagingSpec`: what a `DeferredWriteManager` was built for, and the checks of what its callers
hand it against that. Each check raises a typed error (`NworInputError` or one of its kinds)
before anything changes, so a refused call leaves the window as it was."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from kvalloc.allocator.errors import (
    AcceptedExceedsDrafts,
    InvalidValue,
    NworInputError,
    SlotDtypeError,
    WindowStateError,
)
from kvalloc.allocator.nwor.acceptance import is_integer_tensor
from kvalloc.allocator.nwor.deferred.fp8_scales import stage_dtype_for
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.window import WindowLayout
from kvalloc.allocator.nwor.window_maths import Kept, keep

_NO_SLOTS = np.zeros(0, dtype=np.int64)  # `keep`'s slots for a window whose slots are on device


@dataclass(frozen=True)
class StagingSpec:
    num_layers: int
    head_shape: tuple[int, int]  # (num_kv_heads, head_dim)
    planes: int  # PoolConfig.kv_planes: 2 (K, V) or 1 (a latent, staged as the key)
    max_tokens: int  # a window's scheduled tokens, at most
    max_requests: int
    stage_dtype: torch.dtype
    device: torch.device  # the pool tensor's ("cuda:0", not the config's "cuda"): tensors' match
    positions: int  # accepted_per_position's length; bucket `positions` collects non-drafts

    @classmethod
    def of(cls, storage: KVStorage, *, max_tokens: int, max_requests: int | None,
           stage_dtype: torch.dtype | None) -> StagingSpec:
        """The spec of a manager over ``storage``; ``max_requests`` defaults to the pool's
        ``max_batch_size``, ``stage_dtype`` as `stage_dtype_for` decides."""
        cfg = storage.config
        if max_tokens < 1:
            raise NworInputError("max_tokens: must be >= 1", field="max_tokens")
        max_requests = cfg.max_batch_size if max_requests is None else max_requests
        if max_requests < 1:
            raise NworInputError("max_requests: must be >= 1", field="max_requests")
        return cls(cfg.num_layers, (cfg.num_kv_heads, cfg.head_dim), cfg.kv_planes, max_tokens,
                   max_requests,
                   stage_dtype_for(storage, stage_dtype), storage.kv.device,
                   max(1, cfg.max_draft_len))

    @property
    def row(self) -> int:
        """One token's K (or V) in one layer, flattened: ``H * D`` values."""
        return self.head_shape[0] * self.head_shape[1]

    def check_layout(self, layout: WindowLayout) -> None:
        if not isinstance(layout, WindowLayout):
            raise NworInputError("layout: expected a WindowLayout", field="layout")
        total, reqs = layout.total_tokens, layout.num_requests
        if total > self.max_tokens:
            raise NworInputError(
                f"layout: {total} scheduled tokens exceed max_tokens={self.max_tokens}",
                field="layout")
        if reqs > self.max_requests:
            raise NworInputError(
                f"layout: {reqs} requests exceed max_requests={self.max_requests}",
                field="layout")

    def check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not (
                0 <= layer < self.num_layers):
            raise NworInputError(f"layer: {layer!r} outside [0, {self.num_layers})",
                                 field="layer")

    def check_on_pool(self, name: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise NworInputError(f"{name}: on {t.device}, the pool is on {self.device}",
                                 field=name)

    def checked_stage_tensors(self, key: torch.Tensor, value: torch.Tensor | None,
                              slot_mapping: torch.Tensor) -> int:
        """How many tokens one ``stage_layer`` call stages. A latent pool (one plane) stages
        its latent as ``key`` and takes no ``value``."""
        heads, dim = self.head_shape
        if (value is None) != (self.planes == 1):
            raise NworInputError(
                "value: a latent pool takes none (its latent is the key)" if self.planes == 1
                else "value: a K/V pool needs one", field="value")
        for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
            if t is None and name == "value":
                continue
            if not isinstance(t, torch.Tensor):
                raise NworInputError(f"{name}: expected a tensor", field=name)
            self.check_on_pool(name, t)
        if key.dtype != self.stage_dtype:
            raise NworInputError(f"key: dtype {key.dtype}, staging holds {self.stage_dtype}",
                                 field="key")
        n = key.shape[0] if key.dim() else 0
        if key.shape not in ((n, heads, dim), (n, heads * dim)):
            raise NworInputError(
                f"key: shape {tuple(key.shape)}, expected [n, {heads}, {dim}] or "
                f"[n, {heads * dim}]", field="key")
        if value is not None and (value.shape != key.shape or value.dtype != key.dtype):
            raise NworInputError(
                f"value: {tuple(value.shape)} {value.dtype} differs from key's "
                f"{tuple(key.shape)} {key.dtype}", field="value")
        self.check_slots(slot_mapping, n)
        return n

    def check_slots(self, slot_mapping: torch.Tensor, n: int) -> None:
        """One int64 slot per staged token, on the pool's device."""
        if slot_mapping.dtype != torch.int64:
            raise SlotDtypeError(f"slot_mapping: dtype {slot_mapping.dtype}, slots are int64")
        if slot_mapping.shape != (n,) or slot_mapping.device != self.device:
            raise NworInputError(
                f"slot_mapping: shape {tuple(slot_mapping.shape)} on {slot_mapping.device}, "
                f"expected ({n},) on {self.device}", field="slot_mapping")

    def checked_slot_mapping(self, slot_mapping: torch.Tensor | np.ndarray,
                             total: int) -> torch.Tensor | np.ndarray:
        """``stage_from``'s slots: a tensor on the pool's device or a host array, int64, one per
        token of the window."""
        if not isinstance(slot_mapping, torch.Tensor | np.ndarray):
            raise NworInputError("slot_mapping: expected a tensor or a numpy array",
                                 field="slot_mapping")
        if isinstance(slot_mapping, torch.Tensor):
            self.check_slots(slot_mapping, total)
            return slot_mapping
        if slot_mapping.dtype != np.int64:
            raise SlotDtypeError(f"slot_mapping: dtype {slot_mapping.dtype}, slots are int64")
        if slot_mapping.shape != (total,):
            raise NworInputError(f"slot_mapping: shape {slot_mapping.shape}, expected "
                                 f"({total},)", field="slot_mapping")
        return slot_mapping

    def checked_staging(self, staging: torch.Tensor, tokens: int) -> torch.Tensor:
        """``staging`` (as ``stage_from`` takes it, holding at least ``tokens`` tokens) as the
        commit reads it: ``[num_layers, planes, capacity, H * D]``."""
        heads, dim = self.head_shape
        if not isinstance(staging, torch.Tensor):
            raise NworInputError("staging: expected a tensor", field="staging")
        shape = tuple(staging.shape)
        if (staging.dim() not in (4, 5) or shape[:2] != (self.num_layers, self.planes)
                or shape[3:] not in ((heads, dim), (heads * dim,)) or shape[2] < tokens
                or not staging.is_contiguous()):
            raise NworInputError(
                f"staging: shape {shape}, expected contiguous [{self.num_layers}, {self.planes}, "
                f">= {tokens}, {heads}, {dim}]", field="staging")
        if staging.dtype != self.stage_dtype or staging.device != self.device:
            raise NworInputError(
                f"staging: {staging.dtype} on {staging.device}, expected {self.stage_dtype} on "
                f"{self.device}", field="staging")
        return staging.view(self.num_layers, self.planes, shape[2], heads * dim)

    def checked_host_counts(self, accepted: Sequence[int] | np.ndarray, layout: WindowLayout,
                            host_slots: np.ndarray | None) -> tuple[np.ndarray, Kept]:
        """The counts as int64, and what the window keeps with them (`window_maths.keep`, with
        the host slots when the window has them): one pass that also finds a bad count."""
        counts = np.asarray(accepted)
        if counts.shape != (layout.num_requests,) or (counts.size and counts.dtype.kind not in
                                                      "iu"):
            raise NworInputError(
                f"accepted_counts: expected {layout.num_requests} integers, one per request",
                field="accepted_counts")
        counts = counts.astype(np.int64, copy=False)
        slots = _NO_SLOTS if host_slots is None else host_slots
        kept = keep(*layout.arrays, counts, slots, self.positions)
        r = kept[0]
        if r >= 0 and counts[r] < 0:
            raise InvalidValue(f"accepted_counts: request {r} has {counts[r]} accepted",
                               field="accepted_counts")
        if r >= 0:
            raise AcceptedExceedsDrafts(
                f"accepted_counts: request {r} accepted {counts[r]} of {layout.arrays[1][r]} "
                "drafts", field="accepted_counts")
        return counts, kept

    def checked_device_counts(self, accepted: torch.Tensor,
                              layout: WindowLayout) -> torch.Tensor:
        if accepted.shape != (layout.num_requests,) or not is_integer_tensor(accepted):
            raise NworInputError(
                f"accepted_counts: expected an integer tensor of shape ({layout.num_requests},)",
                field="accepted_counts")
        self.check_on_pool("accepted_counts", accepted)
        return accepted

    def checked_capture(self, max_window_tokens: int, *, window_open: bool) -> int:
        """The rows a graph for windows of up to ``max_window_tokens`` tokens covers."""
        if self.device.type != "cuda":
            raise NworInputError("device: CUDA graphs need a CUDA pool", field="device")
        if window_open:
            raise WindowStateError("window: capture a graph between windows, not inside one")
        if not 1 <= max_window_tokens <= self.max_tokens:
            raise NworInputError(f"max_window_tokens: outside [1, {self.max_tokens}]",
                                 field="max_window_tokens")
        return max_window_tokens

    def check_capture_requests(self, max_requests: int) -> None:
        if not 1 <= max_requests <= self.max_requests:
            raise NworInputError(f"max_requests: outside [1, {self.max_requests}]",
                                 field="max_requests")
