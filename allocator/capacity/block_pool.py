"""`BlockPool`: host-side ownership of block ids: an O(1) free stack, reference counts, and the
least-recently-used list of unowned blocks that still hold cached prefix content.

A block whose last owner lets go goes on the free stack, unless it holds cached content
(`prefix_cache`): then it is *parked* at the tail of the LRU list, still reusable by a request
with the same prefix, and only evicted (head first) onto the free stack when the pool needs it.
The LRU list is intrusive (``lru_prev`` / ``lru_next`` per block, ``lru`` = head, tail, length)
so that parking, taking back and evicting are O(1) per block and the compiled step can park
blocks itself.

Invariants (checked by ``check_invariants``):
- conservation: ``num_free + num_parked + #(refcount > 0) == num_blocks``;
- a block is on the free stack or in the LRU list exactly when its refcount is 0, never both,
  and appears there once.

The stack is LIFO on purpose: a block freed by a rewind is the first one handed out again, so
the block-boundary churn of grant/rewind under speculative decoding stays in warm memory.
"""

from __future__ import annotations

import numpy as np
from kvalloc.allocator.errors import InvalidValue, InvariantViolation, OutOfBlocks


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
        self.lru_prev = np.full(num_blocks, -1, dtype=np.int32)
        self.lru_next = np.full(num_blocks, -1, dtype=np.int32)
        self.lru = np.array([-1, -1, 0], dtype=np.int64)  # head (oldest), tail, length

    @property
    def num_parked(self) -> int:
        """Unowned blocks holding cached content (the LRU list's length)."""
        return int(self.lru[2])

    def park(self, block: int) -> None:
        """Append an unowned cached block at the LRU tail (most recently used)."""
        tail = int(self.lru[1])
        self.lru_prev[block] = tail
        self.lru_next[block] = -1
        if tail >= 0:
            self.lru_next[tail] = block
        else:
            self.lru[0] = block
        self.lru[1] = block
        self.lru[2] += 1

    def unpark(self, block: int) -> None:
        """Take ``block`` out of the LRU list (a request reuses it, or it is evicted)."""
        before, after = int(self.lru_prev[block]), int(self.lru_next[block])
        if before >= 0:
            self.lru_next[before] = after
        else:
            self.lru[0] = after
        if after >= 0:
            self.lru_prev[after] = before
        else:
            self.lru[1] = before
        self.lru_prev[block] = self.lru_next[block] = -1
        self.lru[2] -= 1

    def evict_oldest(self) -> int:
        """Move the least recently used parked block onto the free stack; return its id."""
        block = int(self.lru[0])
        self.unpark(block)
        self.free_stack[self.num_free] = block
        self.num_free += 1
        return block

    def parked(self) -> list[int]:
        """The LRU list, oldest first (for checks and tests; O(num_parked))."""
        out, block = [], int(self.lru[0])
        while block >= 0 and len(out) <= self.num_blocks:
            out.append(block)
            block = int(self.lru_next[block])
        return out

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
        parked = np.array(self.parked(), dtype=np.int64)
        if parked.size != self.num_parked or np.unique(parked).size != parked.size:
            raise InvariantViolation("the LRU list's links disagree with its length")
        if (self.refcounts[parked] != 0).any():
            raise InvariantViolation("a parked block is still referenced")
        if np.intersect1d(parked, free).size:
            raise InvariantViolation("a block is both parked and on the free stack")
        owned = int((self.refcounts > 0).sum())
        if (self.refcounts < 0).any():
            raise InvariantViolation("negative reference count")
        if owned + self.num_free + self.num_parked != self.num_blocks:
            raise InvariantViolation(
                f"blocks not conserved: {owned} owned + {self.num_free} free + "
                f"{self.num_parked} parked != {self.num_blocks}"
            )
