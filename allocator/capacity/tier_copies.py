"""`TierCopies`: copies between the pool and a host tier that the pool's owner makes
(`capacity.host_tier` decides them, the owner of the memory carries them out)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class TierCopies(NamedTuple):
    """Pool block ``blocks[i]`` and tier slot ``slots[i]``, pair by pair (int64). Offloads copy
    block to slot, onboards slot to block."""

    blocks: np.ndarray
    slots: np.ndarray

    @classmethod
    def of(cls, pairs: list[tuple[int, int]]) -> TierCopies:
        if not pairs:
            return NO_COPIES
        blocks, slots = zip(*pairs, strict=True)
        return cls(np.array(blocks, dtype=np.int64), np.array(slots, dtype=np.int64))


NO_COPIES = TierCopies(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
