"""NWOR's window vocabulary: a step's layout, what one window did, and the cumulative metrics."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import FrozenInstanceError, dataclass, field

import numpy as np
from kvalloc.allocator.errors import NworInputError
from kvalloc.allocator.nwor.window_maths import INT64_MAX, window_total

# Why a window fell back (the keys of `NworMetrics.fallbacks`): the reasons known before any
# window runs, so the metrics can serve each at 0 from the start. Two more are open-ended: a write
# that raised counts as "error:<exception type>", `DeferredWriteManager.cancel` as its caller says.
INCOMPLETE_STAGING = "incomplete_staging"  # a layer staged only part of the window
INVALID_COUNTS = "accepted_out_of_range"  # accepted counts on the device outside [0, drafts]
FALLBACK_REASONS = (INCOMPLETE_STAGING, INVALID_COUNTS)

# Validated counts: read-only int64 (num_tokens, num_draft) and the window's total.
_Valid = tuple[np.ndarray, np.ndarray, int]


class WindowLayout:
    """One step's requests in slot-mapping order: ``num_tokens[r]`` scheduled tokens, of which the
    last ``num_draft[r]`` are drafts (0 for a prefill chunk). Immutable; equal to any layout of
    the same counts.

    The counts are kept as read-only int64 arrays (``arrays``): a window reads them on every step.
    ``num_tokens`` and ``num_draft`` are tuples of the counts as given; for a layout of arrays
    they are made on first read, since converting a few hundred numpy ints to Python ones costs
    more than the window's maths and the window itself never reads them.
    """

    _arrays: tuple[np.ndarray, np.ndarray]
    _total: int  # saturates at INT64_MAX: begin_window then refuses the layout

    def __init__(self, num_tokens: Sequence[int] | np.ndarray,
                 num_draft: Sequence[int] | np.ndarray) -> None:
        given = (num_tokens, num_draft)
        valid = None
        if all(isinstance(g, np.ndarray) and g.ndim == 1 for g in given) and (
                len(num_tokens) == len(num_draft)):
            valid = _valid_arrays(*given)  # type: ignore[arg-type]
        if valid is None:  # counts as sequences, or arrays the check refuses
            tokens, drafts = _as_tuples(*given)
            valid = _checked_counts(tokens, drafts)
            object.__setattr__(self, "num_tokens", tokens)
            object.__setattr__(self, "num_draft", drafts)
        object.__setattr__(self, "_arrays", valid[:2])
        object.__setattr__(self, "_total", valid[2])

    @classmethod
    def decode(cls, draft_lens: Sequence[int]) -> WindowLayout:
        """Decode requests only: each schedules its last verified token and its drafts."""
        return cls(tuple(1 + d for d in draft_lens), tuple(draft_lens))

    @classmethod
    def of_arrays(cls, num_tokens: np.ndarray, num_draft: np.ndarray) -> WindowLayout:
        """The layout of two integer arrays (what a scheduler holds), checked as arrays."""
        return cls(num_tokens, num_draft)

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(num_tokens, num_draft)`` as read-only int64 arrays."""
        return self._arrays

    @property
    def total_tokens(self) -> int:
        return self._total

    # Non-data descriptors: the tuples of a layout of sequences, set in __init__, shadow them.
    @functools.cached_property
    def num_tokens(self) -> tuple[int, ...]:
        return tuple(self._arrays[0].tolist())

    @functools.cached_property
    def num_draft(self) -> tuple[int, ...]:
        return tuple(self._arrays[1].tolist())

    @property
    def num_requests(self) -> int:
        return self._arrays[0].size

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WindowLayout):
            return NotImplemented
        return all(np.array_equal(a, b) for a, b in zip(self._arrays, other._arrays, strict=True))

    def __hash__(self) -> int:  # equal layouts hold equal int64 arrays, so equal bytes
        return hash(tuple(a.tobytes() for a in self._arrays))

    def __repr__(self) -> str:
        return f"WindowLayout(num_tokens={self.num_tokens!r}, num_draft={self.num_draft!r})"


def _as_tuples(*given: Sequence[int] | np.ndarray) -> tuple[tuple[int, ...], ...]:
    """The counts as tuples: of Python ints for arrays, of the given values otherwise."""
    return tuple(tuple(g.tolist()) if isinstance(g, np.ndarray) else tuple(g) for g in given)


def _checked_counts(tokens: tuple[int, ...], drafts: tuple[int, ...]) -> _Valid:
    """The counts as read-only int64 arrays and their total; `NworInputError` naming the first
    bad request."""
    if len(tokens) != len(drafts):
        raise NworInputError(
            f"layout: {len(tokens)} token counts but {len(drafts)} draft counts",
            field="layout")
    arrays = _valid_counts(tokens, drafts)
    if arrays is not None:  # one vectorised check for a whole batch
        return arrays
    # Otherwise find the first offending request; bools, nested sequences, ints beyond int64
    # and anything else numpy cannot type as a flat integer array are judged one by one.
    for r, (n, d) in enumerate(zip(tokens, drafts, strict=True)):
        if not all(isinstance(c, int | np.integer) and not isinstance(c, bool) for c in (n, d)):
            raise NworInputError(f"layout: request {r}: counts must be integers",
                                 field="layout")
        if not 0 <= n <= INT64_MAX:
            raise NworInputError(f"layout: request {r} schedules {n} tokens, outside "
                                 f"[0, {INT64_MAX}]", field="layout")
        if not 0 <= d <= n:
            raise NworInputError(
                f"layout: request {r} schedules {n} tokens with {d} drafts "
                "(needs 0 <= drafts <= tokens)", field="layout")
    raise AssertionError("unreachable: every layout the vectorised check refuses is named")


def _valid_counts(tokens: tuple[int, ...], drafts: tuple[int, ...]) -> _Valid | None:
    """Both as read-only int64 arrays, and the total, if they are flat integer sequences with
    0 <= drafts <= tokens everywhere; None otherwise."""
    try:
        n, d = np.asarray(tokens), np.asarray(drafts)
    except (TypeError, ValueError, OverflowError):  # ragged nesting
        return None
    return _valid_arrays(n, d)


def _valid_arrays(n: np.ndarray, d: np.ndarray) -> _Valid | None:
    """`_valid_counts` for arrays: read-only int64 copies and the total, or None."""
    if n.size == 0 and d.size == 0:
        n = d = np.zeros(0, dtype=np.int64)
        n.flags.writeable = False
        return n, d, 0
    if not (n.ndim == d.ndim == 1 and n.dtype.kind in "iu" and d.dtype.kind in "iu"):
        return None
    # A count beyond int64 (unsigned) turns negative here, which window_total refuses.
    n, d = n.astype(np.int64), d.astype(np.int64)
    total = window_total(n, d)
    if total < 0:
        return None
    n.flags.writeable = d.flags.writeable = False
    return n, d, total


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
