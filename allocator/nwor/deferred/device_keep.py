"""`DeviceKeep`: the device keep mask's inputs for the open window, and the mask itself.

A commit whose accepted counts are a device tensor (or computed in ``verify_and_commit``) keeps
tokens on the device (`keep_mask.mask_rejected`): it reads, per token, the token's request, its
draft index (< 0: not a draft; ``NEVER``: past the window, so never kept) and its histogram
bucket; per request, the most it may accept (``NEVER`` past the window), then the window's
tokens; and the accepted counts. They are made and uploaded only when a device path needs them,
once a window: a commit with host counts applies the keep rule on the host (`window_maths.keep`).

Invariants: rows of ``tokens`` past ``written`` read as padding, so a smaller window never reads
a larger one's tokens; between windows the tables count as stale.
"""

from __future__ import annotations

import numpy as np
import torch
from kvalloc.allocator.common.device_io import PinnedUploads
from kvalloc.allocator.errors import InvariantViolation
from kvalloc.allocator.nwor.commit_kernel import Backend
from kvalloc.allocator.nwor.deferred.counters import DeviceCounters
from kvalloc.allocator.nwor.deferred.input_checks import StagingSpec
from kvalloc.allocator.nwor.keep_mask import NEVER, mask_rejected
from kvalloc.allocator.nwor.window import WindowLayout
from kvalloc.allocator.nwor.window_maths import token_table


class DeviceKeep:
    def __init__(self, spec: StagingSpec, uploads: PinnedUploads) -> None:
        self.spec = spec
        self.uploads = uploads
        tokens, dev, i64 = spec.max_tokens, spec.device, torch.int64
        self.uploaded = False  # the open window's tables are on the device
        self.tokens = torch.zeros((tokens, 3), dtype=i64, device=dev)
        self._pad = torch.tensor([0, NEVER, spec.positions], dtype=i64,
                                 device=dev).expand(tokens, 3).contiguous()
        self.tokens.copy_(self._pad)
        self.written = 0  # rows of tokens written since they last read as padding
        self.requests = torch.full((spec.max_requests + 1,), NEVER, dtype=i64, device=dev)
        self.accepted = torch.zeros(spec.max_requests, dtype=i64, device=dev)
        # What the mask writes: the staged slots, with rejected tokens' at -1.
        self.masked_slots = torch.full((spec.num_layers, tokens), -1, dtype=i64, device=dev)

    def upload(self, layout: WindowLayout) -> None:
        """The open window's per-token and per-request tables, on the device (once a window):
        what the device keep mask, acceptance and the captured graphs read."""
        if self.uploaded:
            return
        total = layout.total_tokens
        self.uploads.into(self.tokens[:total], token_table(*layout.arrays, self.spec.positions))
        # Rows past the window must read as padding; only rows an earlier window wrote can not.
        if self.written > total:
            self.tokens[total:self.written].copy_(self._pad[total:self.written])
        self.written = total
        limits = np.full(self.spec.max_requests + 1, NEVER, dtype=np.int64)
        limits[: layout.num_requests] = layout.arrays[1]
        limits[-1] = total
        self.uploads.into(self.requests, limits)
        self.accepted.zero_()  # no count from an earlier window lingers on a padded request
        self.uploaded = True

    def mark_stale(self) -> None:
        """The window closed: the next one uploads its own tables."""
        self.uploaded = False

    def num_draft(self, num_requests: int) -> torch.Tensor:
        """The window's draft counts, on the device (once uploaded)."""
        return self.requests[:num_requests]

    def load_counts(self, accepted: torch.Tensor | np.ndarray) -> None:
        """The window's accepted counts, one per request, from the device or the host."""
        if isinstance(accepted, torch.Tensor):
            self.accepted[: accepted.shape[0]].copy_(accepted)
        else:
            self.uploads.into(self.accepted[: accepted.size], accepted)

    def mask(self, slots: torch.Tensor, rows: int, counters: DeviceCounters | None, *,
             backend: Backend) -> None:
        """``masked_slots`` = the first ``rows`` of ``slots`` with rejected tokens' at -1."""
        mask_rejected(self.tokens, self.accepted, self.requests, slots, rows,
                      self.masked_slots, counters, backend=backend)

    def check_invariants(self, *, window_open: bool) -> None:
        """Reads the padding rows back: a synchronisation on CUDA."""
        if self.uploaded and not window_open:
            raise InvariantViolation("keep tables: marked uploaded between windows")
        if not 0 <= self.written <= self.spec.max_tokens:
            raise InvariantViolation("keep tables: more rows written than max_tokens")
        if not torch.equal(self.tokens[self.written:], self._pad[self.written:]):
            raise InvariantViolation("keep tables: a row past the last window is not padding")
