"""`DeviceRows`: what the device knows of each block-table row's request between steps.

An overlap worker launches step k before the host has read step k-1's outcome, so everything
step k needs of that outcome must already be on the device: the token each request feeds next
(its last emitted, ``pending``), how many drafts its step k-1 accepted (``lead``: its step k
starts that many positions past the reply's ``start_positions``), how many tokens it has emitted
(``generated``, which a device drafter indexes and the length limit is checked against) and
whether it is still going (``alive``: a request that hit its limit or a stop token in step k-1
may still be scheduled in step k, whose forward is then wasted and commits nothing).

The host writes a row only when a request is admitted to it (`admit`), as device operations on
the current stream: they land after every step already launched, so a row freed and taken again
in one call never sees the old request's in-flight updates after the new request's.

One row past the block table's, ``spare``, is never admitted and so never alive: the padded
entries of a decode step grown to a captured batch size (`worker.step.batch_buckets`) run on it,
emit nothing and keep nothing, and the step's metadata gives their tokens no slot.

Invariants: ``0 <= generated <= limit`` for a live row; ``lead`` is what the row's last emitting
step accepted (0 after a prompt's last chunk), and counts only where the host says the request
is behind a step it has not read; the spare row is not alive.
"""

from __future__ import annotations

import numpy as np
import torch
from kvalloc.allocator import InvariantViolation
from kvalloc.allocator.common.device_io import upload_int64


class DeviceRows:
    def __init__(self, num_rows: int, device: torch.device, *, truth_width: int = 0) -> None:
        """``num_rows``: the block table's; ``truth_width``: tokens per row a device drafter may
        draft from (0: none)."""
        self.device = device
        self.spare = num_rows
        num_rows += 1
        zeros = {"dtype": torch.int64, "device": device}
        self.pending = torch.zeros(num_rows, **zeros)
        self.lead = torch.zeros(num_rows, **zeros)
        self.generated = torch.zeros(num_rows, **zeros)
        self.limit = torch.zeros(num_rows, **zeros)
        self.alive = torch.zeros(num_rows, dtype=torch.bool, device=device)
        # Zeros, not a marker: the spare row's drafts are fed to the model too.
        self.truth = torch.zeros((num_rows, max(truth_width, 1)), **zeros)

    def admit(self, rows: np.ndarray, generated: np.ndarray, limit: np.ndarray,
              truth: np.ndarray | None = None) -> None:
        """Requests (re)admitted to ``rows`` having emitted ``generated`` of ``limit`` tokens;
        ``truth`` ``[len(rows), truth_width]``: what a device drafter drafts for each."""
        if rows.size == 0:
            return
        outside = rows[(rows < 0) | (rows >= self.spare)]
        if outside.size:
            raise InvariantViolation(f"rows: admitted to row {int(outside[0])}, outside the "
                                     f"table's 0..{self.spare - 1}")
        at = upload_int64(rows, self.device)
        self.generated[at] = upload_int64(generated, self.device)
        self.limit[at] = upload_int64(limit, self.device)
        self.lead[at] = 0
        self.alive[at] = True
        if truth is not None:
            width = self.truth.shape[1]
            self.truth[at] = upload_int64(truth[:, :width].reshape(-1), self.device).view(
                rows.size, width)

    def check_invariants(self) -> None:
        """A read back: for tests and debugging, never on the hot path."""
        alive = self.alive
        if bool(((self.generated < 0) | (self.generated > self.limit))[alive].any()):
            raise InvariantViolation("rows: a live row emitted more than its limit")
        if bool(alive[self.spare]):
            raise InvariantViolation("rows: the spare row is alive")
