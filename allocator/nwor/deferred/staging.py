"""`StagingBuffers`: where a window's K/V waits for its commit, and the slots it goes to.

A window stages one of two ways:

- ``stage_layer``, layer by layer, into the manager's own ``staged`` ``[L, P, max_tokens, H * D]``
  (P planes: K and V, or a latent) with each layer's slots in its row of ``slots``; ``rows[l]``
  (and on the device ``layer_rows[l]``) counts layer ``l``'s staged tokens, so layers stage
  independently and in chunks;
- ``stage_from``, every layer at once: the commit reads the caller's buffer in place
  (``source``). Its slots are a device tensor, copied into ``slots[0]`` and from there into
  every layer's row, or a host array (``host_slots``): every layer then shares one slot row,
  read through a stride-0 view (`every_layer`) with ``all_rows`` as its row counts, and both
  of the window's slot rows (as staged, then with rejected tokens at -1) travel in one upload
  when it commits: ``shared_slots`` holds ``[staged | kept]``.

Slots in protected blocks are set to -1 as they are staged or uploaded (`BlockProtection`).

Invariants: between windows ``source`` is ``staged``, no host slots are held and no layer has
rows; in a window, no layer stages past the window's tokens, and a window staged from the
caller's buffer has every layer at the window's tokens and host slots only if so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from kvalloc.allocator.common.device_io import PinnedUploads
from kvalloc.allocator.errors import InvariantViolation
from kvalloc.allocator.nwor.deferred.input_checks import StagingSpec
from kvalloc.allocator.nwor.deferred.protection import BlockProtection


class StagingBuffers:
    def __init__(self, spec: StagingSpec, protection: BlockProtection,
                 uploads: PinnedUploads) -> None:
        self.spec = spec
        self.protection = protection
        self.uploads = uploads
        layers, tokens, dev, i64 = spec.num_layers, spec.max_tokens, spec.device, torch.int64
        self.staged = torch.zeros((layers, spec.planes, tokens, spec.row), dtype=spec.stage_dtype,
                                  device=dev)
        self.source = self.staged  # what the commit reads
        self.slots = torch.full((layers, tokens), -1, dtype=i64, device=dev)
        self.layer_rows = torch.zeros(layers, dtype=i64, device=dev)
        self.rows = [0] * layers
        self.shared_slots = torch.full((2 * tokens,), -1, dtype=i64, device=dev)
        self.all_rows = torch.full((layers,), tokens, dtype=i64, device=dev)
        self.host_slots: np.ndarray | None = None
        self.host_slots_uploaded = False

    @property
    def own_buffer(self) -> bool:
        """Whether the commit reads ``staged`` (not the caller's buffer)."""
        return self.source is self.staged

    def any_staged(self) -> bool:
        return any(self.rows)

    def partly_staged(self, tokens: int) -> bool:
        """Whether a layer holds some but not all of a window's ``tokens``."""
        return any(0 < rows < tokens for rows in self.rows)

    def reset(self) -> None:
        """Hold no window: the next stages into ``staged``, from no rows."""
        self.rows = [0] * self.spec.num_layers
        self.source = self.staged
        self.host_slots = None

    def start_chunk(self, layer: int) -> int:
        """Where ``layer``'s next chunk starts. The window's first chunk (no layer has rows yet)
        restarts every layer's device row count from 0."""
        if not any(self.rows):
            self.layer_rows.zero_()
        return self.rows[layer]

    def write_chunk(self, layer: int, offset: int, key: torch.Tensor,
                    value: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """Stage ``key``/``value`` (checked: ``StagingSpec.checked_stage_tensors``) at
        ``offset`` of ``layer``; the guard counts refused tokens in layer 0 only, once each."""
        n = slot_mapping.shape[0]
        end = offset + n
        self.staged[layer, 0, offset:end].copy_(key.reshape(n, self.spec.row))
        if value is not None:
            self.staged[layer, 1, offset:end].copy_(value.reshape(n, self.spec.row))
        self.slots[layer, offset:end].copy_(slot_mapping)
        self.protection.guard(self.slots[layer, offset:end], count=layer == 0)
        self.rows[layer] = end
        self.layer_rows[layer].fill_(end)

    def stage_from(self, source: torch.Tensor, slot_mapping: torch.Tensor | np.ndarray) -> None:
        """The window's every layer, from the caller's ``source`` (checked:
        ``StagingSpec.checked_staging`` and ``checked_slot_mapping``)."""
        total = slot_mapping.shape[0]
        if isinstance(slot_mapping, np.ndarray):
            self.host_slots, self.host_slots_uploaded = slot_mapping.copy(), False
        else:
            self.slots[0, :total].copy_(slot_mapping)
            self.protection.guard(self.slots[0, :total], count=True)
            self.share_first_slot_row(total)
        self.rows = [total] * self.spec.num_layers
        self.source = source

    @contextmanager
    def reading(self, source: torch.Tensor) -> Iterator[None]:
        """Between windows, the commit reads ``source`` for a while (a capture of its work)."""
        self.source = source
        try:
            yield
        finally:
            self.source = self.staged

    def staged_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V; a latent pool's one plane as both (MLA reads its V out of the latent)."""
        staged = self.source[layer, :, :self.rows[layer]].unflatten(-1, self.spec.head_shape)
        return staged[0], staged[-1]

    def upload_host_slots(self, kept_slots: np.ndarray | None = None) -> None:
        """The window's host slots (and ``kept_slots``, the same with rejected tokens at -1) in
        one upload; slots in protected blocks become -1, counted once per staged token."""
        assert self.host_slots is not None
        total = self.host_slots.size
        rows = self.host_slots if kept_slots is None else np.concatenate(
            [self.host_slots, kept_slots])
        self.uploads.into(self.shared_slots[: rows.size], rows)
        if self.protection.blocks is not None:  # its views cost more than the check, every window
            self.protection.guard_host_rows(
                self.shared_slots[:total],
                None if kept_slots is None else self.shared_slots[total: 2 * total])
        self.host_slots_uploaded = True

    def shared_row(self, row: int) -> torch.Tensor:
        """Row ``row`` of the uploaded ``[staged | kept]`` slots, as every layer's slots."""
        assert self.host_slots is not None
        total = self.host_slots.size
        return self.every_layer(self.shared_slots, row * total, total)

    def every_layer(self, slots: torch.Tensor, start: int = 0,
                    count: int | None = None) -> torch.Tensor:
        """``count`` slots of the contiguous row ``slots`` from ``start`` (default: all of it) as
        every layer's: a stride-0 view, made in one call (slicing first costs as much again)."""
        count = slots.numel() - start if count is None else count
        return slots.as_strided((self.spec.num_layers, count), (0, 1),
                                slots.storage_offset() + start)

    def share_first_slot_row(self, total: int) -> None:
        """Every layer writes with ``slots[0]``'s first ``total`` slots."""
        layers = self.spec.num_layers
        self.slots[1:, :total].copy_(self.slots[0, :total].expand(layers - 1, total))
        self.layer_rows.fill_(total)

    def host_slots_to_slot_rows(self) -> None:
        """A window staged with host slots, as one staged with a device tensor: what a commit
        with device counts reads."""
        if self.host_slots is None:
            return
        total = self.host_slots.size
        if not self.host_slots_uploaded:
            self.upload_host_slots()
        self.slots[0, :total].copy_(self.shared_slots[:total])
        self.share_first_slot_row(total)
        self.host_slots = None

    def check_invariants(self, window_tokens: int | None) -> None:
        """``window_tokens``: the open window's, None between windows."""
        if window_tokens is None:
            if not self.own_buffer or self.host_slots is not None or any(self.rows):
                raise InvariantViolation("staging: a closed window still holds staged state")
            return
        if max(self.rows, default=0) > window_tokens or min(self.rows, default=0) < 0:
            raise InvariantViolation("staging: a layer staged past the window")
        if not self.own_buffer and self.rows != [window_tokens] * self.spec.num_layers:
            raise InvariantViolation("staging: the caller's buffer stages the window partly")
        if self.host_slots is not None and (self.own_buffer
                                            or self.host_slots.shape != (window_tokens,)):
            raise InvariantViolation("staging: host slots without the caller's buffer, or not "
                                     "one per token")
