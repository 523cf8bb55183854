"""NWOR's window vocabulary: a step's layout, what one window did, and the cumulative metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .nwor_errors import NworInputError

_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True)
class WindowLayout:
    """One step's requests in slot-mapping order: ``num_tokens[r]`` scheduled tokens, of which the
    last ``num_draft[r]`` are drafts (0 for a prefill chunk)."""

    num_tokens: tuple[int, ...]
    num_draft: tuple[int, ...]
    # The counts as read-only int64 arrays, kept from the validation: a window reads them on
    # every step, and converting a few hundred Python ints costs more than the window's maths.
    _arrays: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = (self.num_tokens, self.num_draft)
        tokens, drafts = (tuple(g.tolist()) if isinstance(g, np.ndarray) else tuple(g)
                          for g in given)
        object.__setattr__(self, "num_tokens", tokens)
        object.__setattr__(self, "num_draft", drafts)
        if len(tokens) != len(drafts):
            raise NworInputError(
                f"layout: {len(tokens)} token counts but {len(drafts)} draft counts",
                field="layout")
        arrays = (_valid_arrays(*given) if all(isinstance(g, np.ndarray) for g in given)
                  else _valid_counts(tokens, drafts))
        if arrays is not None:  # one vectorised check for a whole batch
            object.__setattr__(self, "_arrays", arrays)
            return
        # Otherwise find the first offending request; bools, nested sequences, ints beyond int64
        # and anything else numpy cannot type as a flat integer array are judged one by one.
        for r, (n, d) in enumerate(zip(tokens, drafts, strict=True)):
            if not (isinstance(n, int | np.integer) and isinstance(d, int | np.integer)):
                raise NworInputError(f"layout: request {r}: counts must be integers",
                                     field="layout")
            if not 0 <= n <= _INT64_MAX:
                raise NworInputError(f"layout: request {r} schedules {n} tokens, outside "
                                     f"[0, {_INT64_MAX}]", field="layout")
            if not 0 <= d <= n:
                raise NworInputError(
                    f"layout: request {r} schedules {n} tokens with {d} drafts "
                    "(needs 0 <= drafts <= tokens)", field="layout")
        raise AssertionError("unreachable: every layout the vectorised check refuses is named")

    @classmethod
    def decode(cls, draft_lens: Sequence[int]) -> WindowLayout:
        """Decode requests only: each schedules its last verified token and its drafts."""
        return cls(tuple(1 + d for d in draft_lens), tuple(draft_lens))

    @classmethod
    def of_arrays(cls, num_tokens: np.ndarray, num_draft: np.ndarray) -> WindowLayout:
        """The layout of two integer arrays (what a scheduler holds), checked as arrays."""
        return cls(num_tokens, num_draft)  # type: ignore[arg-type]

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(num_tokens, num_draft)`` as read-only int64 arrays."""
        return self._arrays

    @property
    def num_requests(self) -> int:
        return len(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return int(self._arrays[0].sum())


def _valid_counts(tokens: tuple[int, ...],
                  drafts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """Both as read-only int64 arrays if they are flat integer sequences with
    0 <= drafts <= tokens everywhere; None otherwise."""
    try:
        n, d = np.asarray(tokens), np.asarray(drafts)
    except (TypeError, ValueError, OverflowError):  # ragged nesting
        return None
    return _valid_arrays(n, d)


def _valid_arrays(n: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """`_valid_counts` for arrays: read-only int64 copies, or None."""
    if n.size == 0 and d.size == 0:
        n = d = np.zeros(0, dtype=np.int64)
        n.flags.writeable = False
        return n, d
    if not (n.ndim == d.ndim == 1 and n.dtype.kind in "iu" and d.dtype.kind in "iu"
            and n.max() <= _INT64_MAX and not ((n < 0) | (d < 0) | (d > n)).any()):
        return None
    n, d = n.astype(np.int64), d.astype(np.int64)
    n.flags.writeable = d.flags.writeable = False
    return n, d


@dataclass(frozen=True)
class WindowStats:
    """What one window did. ``tokens == committed + rejected + fallback_tokens``.

    ``written``: for a window staged with host slots, the tokens it sent to a slot (kept, or all
    of them after a fallback, and with a slot other than -1); None otherwise."""

    tokens: int
    committed: int
    rejected: int
    fallback_tokens: int
    path: str  # empty | fast | masked | device | graph | fallback
    fallback_reason: str | None = None
    written: int | None = None


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
