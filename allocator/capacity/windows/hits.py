"""What a prefix hit needs in a group, and one hit for a request across groups (`groups`).

A query at position ``h`` reads the keys in ``(h - W, h]``: a hit of ``h`` tokens (the query at
``h`` is the first it leaves to compute) needs the cached blocks from `hit_released` on, none
behind its window (`release.released_columns` of ``h``), and full attention all of them.

Each group's cache says which hit lengths it can serve a prompt (`PrefixCache.servable`, in its
own blocks): full attention every length up to its longest run of cached blocks; a window those
whose last ``W`` tokens' blocks it still holds, so a longer hit may be servable where a shorter
one is not. A request must be admitted with one hit in every group (its capacity and history
are the same in each), so the hit is the longest length every group serves. Hits stay
block-aligned in every group (no group is padded to another's page): the common hit is a
multiple of every group's block size, their least common multiple (with block sizes powers of
two, the largest), and 0 is always one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from kvalloc.allocator.capacity.windows.release import released_columns


def hit_released(columns: int, window: int | None, tokens_per_block: int) -> int:
    """The leading columns a hit of ``columns`` blocks needs no block for (its row starts
    `RELEASED` there): none under full attention (``window`` None)."""
    if window is None:
        return 0
    return int(released_columns(np.int64(columns * tokens_per_block), window, tokens_per_block))


def servable(found: list[int | None], window: int | None, tokens_per_block: int) -> np.ndarray:
    """Per hit length in blocks, 0 to ``len(found)``: whether every block it needs is found
    (``found``: a prompt's blocks in the cache, None where missing). Under full attention the
    lengths served run from 0 to the first missing block; in a window a hit may be servable
    where a shorter one is not (the shorter needs an earlier block, evicted)."""
    missing = np.array([b is None for b in found], dtype=bool)
    # The last missing block before each hit length (-1: none).
    last = np.maximum.accumulate(np.concatenate([[-1], np.where(
        missing, np.arange(missing.size), -1)]))
    lengths = np.arange(missing.size + 1, dtype=np.int64)
    first = (np.zeros_like(lengths) if window is None else
             released_columns(lengths * tokens_per_block, window, tokens_per_block))
    return last < first


def common_hit(servable: Sequence[tuple[np.ndarray, int]]) -> int:
    """The longest hit in tokens that every group serves: ``servable`` holds, per group, its
    mask over hit lengths in blocks (`PrefixCache.servable`) and its block size."""
    step = math.lcm(*(size for _, size in servable))
    longest = min((mask.size - 1) * size for mask, size in servable)
    lengths = np.arange(0, longest + 1, step, dtype=np.int64)
    ok = np.logical_and.reduce([mask[lengths // size] for mask, size in servable])
    return int(lengths[ok][-1])
