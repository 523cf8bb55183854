"""The host arithmetic of one NWOR window: each token's tables for the device commit, and the
commit's keep rule applied on the host when the accepted counts (and perhaps the slots) are
known there.

A window lists its requests in slot-mapping order: request ``r`` schedules ``num_tokens[r]``
tokens, the last ``num_draft[r]`` of them drafts, so its token ``j`` has draft index
``j - (num_tokens[r] - num_draft[r])`` (< 0: not a draft). A token is kept iff its draft index is
below its request's accepted count: every non-draft token, and a request's first ``accepted[r]``
drafts. A kept draft counts in histogram bucket ``min(draft index, positions - 1)``.

Each function is a numpy reference stating what it computes and a compiled loop (`jit`) that
runs instead where numba imports; the window's arrays are a few hundred values, where numpy's
per-call cost outweighs the work. Tests compare the two.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch
from kvalloc.allocator.common.jit import jit, numba

# What `keep` returns: (bad, kept_slots, per_position, committed, written).
Kept = tuple[int, np.ndarray, np.ndarray, int, int]
INT64_MAX = int(np.iinfo(np.int64).max)
Indexable = TypeVar("Indexable", np.ndarray, torch.Tensor)


def keep_rule(index: Indexable, entry: Indexable, bound: Indexable) -> Indexable:
    """NWOR's keep rule, the one every commit applies (numpy or torch alike): token ``t`` is
    kept iff ``index[t] < bound[entry[t]]``. A window states it with draft indices and accepted
    counts, an overlap worker's step with indices in the entry and kept counts
    (`packed_commit`)."""
    return index < bound[entry]


def window_total_reference(num_tokens: np.ndarray, num_draft: np.ndarray) -> int:
    """The window's scheduled tokens (int64 counts), saturating at ``INT64_MAX`` (more than any
    window holds); -1 unless ``0 <= num_draft[r] <= num_tokens[r]`` for every request."""
    if ((num_draft < 0) | (num_draft > num_tokens)).any():
        return -1
    return min(sum(num_tokens.tolist()), INT64_MAX)


def token_table_reference(num_tokens: np.ndarray, num_draft: np.ndarray,
                          positions: int) -> np.ndarray:
    """Per token of the window, int64 ``[total, 3]``: its request, its draft index and its
    histogram bucket (``positions`` for a token that is not a draft)."""
    total = int(num_tokens.sum())
    request = np.repeat(np.arange(num_tokens.size), num_tokens)
    first_draft = np.cumsum(num_tokens) - num_draft  # flat index of each request's first draft
    draft_index = np.arange(total) - first_draft[request]
    bucket = np.where(draft_index < 0, positions, np.minimum(draft_index, positions - 1))
    return np.stack([request, draft_index, bucket], axis=1).astype(np.int64, copy=False)


def keep_reference(num_tokens: np.ndarray, num_draft: np.ndarray, accepted: np.ndarray,
                   slots: np.ndarray, positions: int) -> Kept:
    """The window's commit with int64 ``accepted`` counts, one per request, in one call.

    ``bad``: the first request whose count is negative, else the first whose count exceeds its
    drafts, else -1; when it is >= 0 nothing else is computed (the rest comes back empty or 0).
    Otherwise ``kept_slots`` is ``slots`` (the window's host slots, one per token) with rejected
    tokens' slots at -1, empty when ``slots`` is (the slots live elsewhere); ``per_position[i]``
    the kept drafts in bucket ``i`` (``positions`` buckets); ``committed`` the kept tokens;
    ``written`` the kept tokens whose slot is not negative (0 when ``slots`` is empty).
    """
    negative = np.flatnonzero(accepted < 0)
    over = np.flatnonzero(accepted > num_draft)
    if negative.size or over.size:
        bad = int(negative[0] if negative.size else over[0])
        return bad, np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0
    total = int(num_tokens.sum())
    committed = total - int(num_draft.sum()) + int(accepted.sum())
    last = positions - 1
    per_position = np.zeros(positions, dtype=np.int64)
    per_position[:last] = (accepted[:, None] > np.arange(last)).sum(axis=0)
    per_position[last] = np.maximum(accepted - last, 0).sum()
    if slots.size == 0:
        return -1, np.zeros(0, np.int64), per_position, committed, 0
    table = token_table_reference(num_tokens, num_draft, positions)
    kept = keep_rule(table[:, 1], table[:, 0], accepted)
    kept_slots = np.where(kept, slots, -1)
    return -1, kept_slots, per_position, committed, int(np.count_nonzero(kept_slots >= 0))


def _window_total_loop(num_tokens, num_draft):  # type: ignore[no-untyped-def]  # pragma: no cover
    # Compiled by numba; window_total_reference states what it computes.
    total = 0
    for r in range(num_tokens.size):
        if num_draft[r] < 0 or num_draft[r] > num_tokens[r]:
            return -1
        total = INT64_MAX if num_tokens[r] > INT64_MAX - total else total + num_tokens[r]
    return total


def _token_table_loop(num_tokens, num_draft,  # type: ignore[no-untyped-def]
                      positions):  # pragma: no cover
    # Compiled by numba; token_table_reference states what it computes.
    total = 0
    for r in range(num_tokens.size):
        total += num_tokens[r]
    table = np.empty((total, 3), dtype=np.int64)
    i = 0
    for r in range(num_tokens.size):
        first_draft = num_tokens[r] - num_draft[r]
        for j in range(num_tokens[r]):
            index = j - first_draft
            table[i, 0] = r
            table[i, 1] = index
            table[i, 2] = positions if index < 0 else min(index, positions - 1)
            i += 1
    return table


def _keep_loop(num_tokens, num_draft, accepted,  # type: ignore[no-untyped-def]
               slots, positions):  # pragma: no cover
    # Compiled by numba; keep_reference states what it computes. A request's kept tokens are its
    # first num_tokens - num_draft + accepted, so one pass over the requests does it all.
    over = -1
    for r in range(accepted.size):
        if accepted[r] < 0:
            return r, np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0
        if over < 0 and accepted[r] > num_draft[r]:
            over = r
    if over >= 0:
        return over, np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0
    last = positions - 1
    per_position = np.zeros(positions, dtype=np.int64)
    kept_slots = np.full(slots.size, -1, dtype=np.int64)
    committed = written = start = 0
    for r in range(num_tokens.size):
        a = accepted[r]
        for j in range(min(a, last)):
            per_position[j] += 1
        if a > last:
            per_position[last] += a - last
        kept = num_tokens[r] - num_draft[r] + a
        committed += kept
        if slots.size:
            for i in range(start, start + kept):
                kept_slots[i] = slots[i]
                if slots[i] >= 0:
                    written += 1
        start += num_tokens[r]
    return -1, kept_slots, per_position, committed, written


window_total = jit(_window_total_loop) if numba is not None else window_total_reference
token_table = jit(_token_table_loop) if numba is not None else token_table_reference
keep = jit(_keep_loop) if numba is not None else keep_reference
