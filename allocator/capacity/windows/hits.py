"""One prefix hit for a request across KV cache groups (`groups`).

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


def common_hit(servable: Sequence[tuple[np.ndarray, int]]) -> int:
    """The longest hit in tokens that every group serves: ``servable`` holds, per group, its
    mask over hit lengths in blocks (`PrefixCache.servable`) and its block size."""
    step = math.lcm(*(size for _, size in servable))
    longest = min((mask.size - 1) * size for mask, size in servable)
    lengths = np.arange(0, longest + 1, step, dtype=np.int64)
    ok = np.logical_and.reduce([mask[lengths // size] for mask, size in servable])
    return int(lengths[ok][-1])
