"""`BlockPool`: host-side ownership of block ids: an O(1) free stack and reference counts.

Invariants (checked by ``check_invariants``):
- conservation: ``num_free + #(refcount > 0) == num_blocks``;
- a block is on the free stack exactly when its refcount is 0, and appears there once.

The stack is LIFO on purpose: a block freed by a rewind is the first one handed out again, so
the block-boundary churn of grant/rewind under speculative decoding stays in warm memory.
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidValue, InvariantViolation, OutOfBlocks


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise InvalidValue(f"num_blocks: {num_blocks} must be > 0", field="num_blocks")
        self.num_blocks = num_blocks
        # Reversed so that block 0 is handed out first: tables read naturally in tests and logs.
        # The stack is ``free_stack[:num_free]``, its top at the end. The compiled step pushes
        # and pops on these arrays directly, so they are public.
        self.free_stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self.num_free = num_blocks
        self.refcounts = np.zeros(num_blocks, dtype=np.int32)

    def refcount(self, block_ids: np.ndarray) -> np.ndarray:
        return self.refcounts[block_ids].copy()

    def allocate(self, n: int) -> np.ndarray:
        """Take ``n`` blocks with refcount 1, or raise ``OutOfBlocks`` having taken none."""
        if n < 0:
            raise InvalidValue(f"num_blocks: {n} must be >= 0", field="num_blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"num_blocks: asked for {n} blocks, {self.num_free} free")
        # Pop from the top of the stack: the most recently freed block is handed out first.
        ids = self.free_stack[self.num_free - n : self.num_free][::-1].copy()
        self.num_free -= n
        self.refcounts[ids] = 1
        return ids

    def incref(self, block_ids: np.ndarray) -> None:
        """Share already-owned blocks (prefix sharing, forks)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise InvalidValue("block_ids: out of range", field="block_ids")
        if ids.size and (self.refcounts[ids] <= 0).any():
            raise InvalidValue("block_ids: cannot share a free block", field="block_ids")
        np.add.at(self.refcounts, ids, 1)

    def release(self, block_ids: np.ndarray) -> None:
        """Drop one reference per id; blocks reaching 0 go back on the free stack at once."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            raise InvalidValue("block_ids: out of range", field="block_ids")
        # O(k log k) in the ids released, never O(pool size).
        uniq, counts = np.unique(ids, return_counts=True)
        if (self.refcounts[uniq] < counts).any():
            raise InvalidValue("block_ids: releases a block more often than it is held",
                               field="block_ids")
        self.refcounts[uniq] -= counts.astype(np.int32)
        freed = uniq[self.refcounts[uniq] == 0].astype(np.int32)
        self.free_stack[self.num_free : self.num_free + freed.size] = freed
        self.num_free += freed.size

    def release_unique(self, block_ids: np.ndarray) -> None:
        """Fast path of ``release`` for ids known to be distinct and held once (the hot path)."""
        ids = np.asarray(block_ids)
        if ids.size == 0:
            return
        self.refcounts[ids] -= 1
        freed = ids[self.refcounts[ids] == 0]
        self.free_stack[self.num_free : self.num_free + freed.size] = freed
        self.num_free += freed.size

    def check_invariants(self) -> None:
        free = self.free_stack[: self.num_free]
        if np.unique(free).size != free.size:
            raise InvariantViolation("a block is on the free stack twice")
        if (self.refcounts[free] != 0).any():
            raise InvariantViolation("a block on the free stack is still referenced")
        owned = int((self.refcounts > 0).sum())
        if (self.refcounts < 0).any():
            raise InvariantViolation("negative reference count")
        if owned + self.num_free != self.num_blocks:
            raise InvariantViolation(
                f"blocks not conserved: {owned} owned + {self.num_free} free != {self.num_blocks}"
            )
