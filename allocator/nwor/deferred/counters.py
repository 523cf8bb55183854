"""`WindowCounters`: what the closed windows did, as `NworMetrics` and the last `WindowStats`.

A window whose accepted counts the host knows is counted on the host when it closes. One whose
counts live on the device (a tensor, or acceptance computed in ``verify_and_commit``) is counted
there by the keep mask (`keep_mask.mask_rejected`), with no host synchronisation: the host keeps
its token count and a placeholder, and ``metrics`` and ``last_window`` read the device back.

Invariants: every window is counted once, as a host window or as a device window, and per
window staged == committed + rejected + fallback tokens; so ``staged_tokens`` is the host
windows' committed, rejected and fallback tokens plus the device windows' tokens, and no metric
can go negative.
"""

from __future__ import annotations

import numpy as np
import torch
from kvalloc.allocator.errors import InvariantViolation
from kvalloc.allocator.nwor.window import INVALID_COUNTS, NworMetrics, WindowStats

DEVICE_PATHS = ("device", "graph")  # the paths of windows counted on the device

DeviceCounters = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class WindowCounters:
    def __init__(self, positions: int, device: torch.device) -> None:
        self.windows = self.staged_tokens = 0
        self.committed = self.rejected = self.fallback_tokens = 0  # host windows'
        self.device_windows = self.device_tokens = 0
        self.fallbacks: dict[str, int] = {}  # host windows', by reason
        self.per_position = np.zeros(positions, dtype=np.int64)  # host windows' kept drafts
        self.last: WindowStats | None = None
        self.last_device_path: str | None = None  # set while the last window was a device one
        self.counted_on_device = False  # this window's counters already landed on the device
        # Device windows' counters, this window and in total: kept tokens (windows with valid
        # counts), windows with invalid counts, tokens of those windows; and kept tokens per
        # histogram bucket (the last collects non-draft tokens).
        i64 = torch.int64
        self.dev_window = torch.zeros(3, dtype=i64, device=device)
        self.dev_total = torch.zeros(3, dtype=i64, device=device)
        self.dev_per_position = torch.zeros(positions + 1, dtype=i64, device=device)

    @property
    def on_device(self) -> DeviceCounters:
        """What the keep mask counts a device window into."""
        return self.dev_window, self.dev_total, self.dev_per_position

    def saved_on_device(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.on_device]

    def restore_on_device(self, saved: list[torch.Tensor]) -> None:
        for counter, value in zip(self.on_device, saved, strict=True):
            counter.copy_(value)

    def uncount_device_window(self) -> None:
        """Take back what the device counted of a window that falls back after all (the
        fallback counts it). accepted_per_position keeps it: it has no per-window copy."""
        if self.counted_on_device:
            self.dev_total.sub_(self.dev_window)

    def device_window(self, tokens: int, path: str) -> WindowStats:
        """Placeholder stats for a window whose counts live on the device (see last_window)."""
        self.last_device_path = path
        self.device_windows += 1
        self.device_tokens += tokens
        return WindowStats(tokens, 0, 0, 0, path)

    def count_kept_drafts(self, per_position: np.ndarray) -> None:
        self.per_position += per_position

    def count_fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def close(self, stats: WindowStats) -> None:
        if stats.path not in DEVICE_PATHS:
            self.last_device_path = None
            self.committed += stats.committed
            self.rejected += stats.rejected
            self.fallback_tokens += stats.fallback_tokens
        self.windows += 1
        self.staged_tokens += stats.tokens
        self.last = stats

    def metrics(self, protected_refusals: int) -> NworMetrics:
        """Reads the device counters back if any window was counted there."""
        committed, invalid, fallback = (
            self.dev_total.tolist() if self.device_windows else (0, 0, 0))
        rejected = self.device_tokens - committed - fallback
        per_position = self.per_position + (
            self.dev_per_position[:-1].cpu().numpy() if self.device_windows else 0)
        fallbacks = dict(self.fallbacks)
        if invalid:
            fallbacks[INVALID_COUNTS] = fallbacks.get(INVALID_COUNTS, 0) + invalid
        return NworMetrics(
            windows=self.windows,
            staged_tokens=self.staged_tokens,
            committed_tokens=self.committed + committed,
            rejected_tokens=self.rejected + rejected,
            fallback_tokens=self.fallback_tokens + fallback,
            fallbacks=fallbacks,
            accepted_per_position=tuple(int(c) for c in per_position),
            protected_refusals=protected_refusals,
        )

    def last_window(self) -> WindowStats | None:
        """Reads the device counters back if the last window was counted there."""
        if self.last is not None and self.last_device_path is not None:
            committed, invalid, fallback = self.dev_window.tolist()
            tokens = self.last.tokens
            return WindowStats(
                tokens, committed, tokens - committed - fallback, fallback,
                "fallback" if invalid else self.last_device_path,
                INVALID_COUNTS if invalid else None)
        return self.last

    def check_invariants(self) -> None:
        """The host's counts only: reading the device's would synchronise."""
        counts = (self.windows, self.staged_tokens, self.committed, self.rejected,
                  self.fallback_tokens, self.device_windows, self.device_tokens)
        if min(counts) < 0 or (self.per_position < 0).any() or any(
                n < 1 for n in self.fallbacks.values()):
            raise InvariantViolation("counters: a count is negative (or a reason counted 0)")
        if self.staged_tokens != (self.committed + self.rejected + self.fallback_tokens
                                  + self.device_tokens):
            raise InvariantViolation("counters: staged != committed + rejected + fallback + "
                                     "tokens of device windows")
        if self.device_windows + sum(self.fallbacks.values()) > self.windows:
            raise InvariantViolation("counters: more device and fallback windows than windows")
        if (self.last is None) != (self.windows == 0):
            raise InvariantViolation("counters: a last window without windows, or none after")
        if self.last_device_path is not None and (
                self.last is None or self.last.path != self.last_device_path):
            raise InvariantViolation("counters: the last device path is not the last window's")
