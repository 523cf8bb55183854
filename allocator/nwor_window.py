"""NWOR's window vocabulary: a step's layout, what one window did, and the cumulative metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .nwor_errors import NworInputError


@dataclass(frozen=True)
class WindowLayout:
    """One step's requests in slot-mapping order: ``num_tokens[r]`` scheduled tokens, of which the
    last ``num_draft[r]`` are drafts (0 for a prefill chunk)."""

    num_tokens: tuple[int, ...]
    num_draft: tuple[int, ...]

    def __post_init__(self) -> None:
        tokens, drafts = tuple(self.num_tokens), tuple(self.num_draft)
        object.__setattr__(self, "num_tokens", tokens)
        object.__setattr__(self, "num_draft", drafts)
        if len(tokens) != len(drafts):
            raise NworInputError(
                f"layout: {len(tokens)} token counts but {len(drafts)} draft counts",
                field="layout")
        if _valid_counts(tokens, drafts):
            return  # one vectorised check for a whole batch
        # Otherwise find the first offending request; bools, nested sequences, ints beyond int64
        # and anything else numpy cannot type as a flat integer array are judged one by one.
        for r, (n, d) in enumerate(zip(tokens, drafts, strict=True)):
            if not (isinstance(n, int | np.integer) and isinstance(d, int | np.integer)):
                raise NworInputError(f"layout: request {r}: counts must be integers",
                                     field="layout")
            if n < 0 or not 0 <= d <= n:
                raise NworInputError(
                    f"layout: request {r} schedules {n} tokens with {d} drafts "
                    "(needs 0 <= drafts <= tokens)", field="layout")

    @classmethod
    def decode(cls, draft_lens: Sequence[int]) -> WindowLayout:
        """Decode requests only: each schedules its last verified token and its drafts."""
        return cls(tuple(1 + d for d in draft_lens), tuple(draft_lens))

    @property
    def num_requests(self) -> int:
        return len(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


def _valid_counts(tokens: tuple[int, ...], drafts: tuple[int, ...]) -> bool:
    """Whether both are flat integer sequences with 0 <= drafts <= tokens everywhere."""
    try:
        n, d = np.asarray(tokens), np.asarray(drafts)
    except (TypeError, ValueError):  # ragged nesting
        return False
    return (n.ndim == d.ndim == 1 and n.dtype.kind in "iu" and d.dtype.kind in "iu"
            and not ((n < 0) | (d < 0) | (d > n)).any())


@dataclass(frozen=True)
class WindowStats:
    """What one window did. ``tokens == committed + rejected + fallback_tokens``."""

    tokens: int
    committed: int
    rejected: int
    fallback_tokens: int
    path: str  # empty | fast | masked | device | graph | fallback
    fallback_reason: str | None = None


@dataclass(frozen=True)
class NworMetrics:
    """Cumulative over closed windows; ``staged == committed + rejected + fallback``.

    ``accepted_per_position[i]``: drafts committed at draft position i (0 = first draft); the last
    entry also counts any deeper position (the pool's ``max_draft_len`` bounds the length).
    """

    windows: int
    staged_tokens: int
    committed_tokens: int
    rejected_tokens: int
    fallback_tokens: int
    fallbacks: dict[str, int] = field(default_factory=dict)
    accepted_per_position: tuple[int, ...] = ()
    # Staged tokens whose slot lay in a protected (shared, cached) block: refused, never written.
    protected_refusals: int = 0
