"""Onboarding: a step's prompts whose cached prefix continues in the host tier past the pool get
that content back into the pool before the step looks its prompts up.

Each such run of tier blocks gets pool blocks (free ones first, then the least recently used
parked ones, never a block one of the step's prompts hits), registered in the prefix cache with
the tier's hashes and origins and parked at the LRU tail: to the step they are pool hits like any
other, so admission, sharing, protection and events need no second rule. The copies into them are
owed by the tier (`HostTier.onboard`) and made by the pool's owner before anything reads them.

The step that follows may still refuse its plan (a typed error changes nothing): `Onboarding`
keeps what it changed and ``undo`` puts it back, blocks, hashes, protection and events alike; only
``commit``, once the step applied, tells the tier (its LRU order and the copies it owes).
"""

from __future__ import annotations

import numpy as np
from kvalloc.allocator.capacity.block_pool import BlockPool
from kvalloc.allocator.capacity.host_tier import HostTier
from kvalloc.allocator.capacity.prefix_cache import Forgotten, PrefixCache, Prompt


class Onboarding:
    """What onboarding a step's prompts changed, until the step applies (``commit``) or is
    refused (``undo``)."""

    def __init__(self, cache: PrefixCache, pool: BlockPool, tier: HostTier) -> None:
        self.cache, self.pool, self.tier = cache, pool, tier
        self._pool_arrays = [a.copy() for a in (pool.free_stack, pool.refcounts, pool.lru_prev,
                                                pool.lru_next, pool.lru)]
        self._num_free = pool.num_free
        self._journal = cache.journal()
        self.evicted: list[Forgotten] = []
        self.hashes: list[bytes] = []
        self.blocks: list[int] = []

    def take(self, hashes: list[bytes], keep: set[int]) -> list[int]:
        """Pool blocks for the tier's ``hashes`` (as many as the pool can give, from the first),
        registered and parked; the blocks in ``keep`` are never evicted for them."""
        pool, cache = self.pool, self.cache
        want = min(len(hashes), pool.num_free + self._evictable(len(hashes), keep))
        while pool.num_free < want:
            self._evict(self._oldest_outside(keep))
        if want == 0:
            return []
        blocks = pool.allocate(want).tolist()
        pool.refcounts[blocks] = 0
        taken = hashes[:want]
        cache.adopt(blocks, taken, self.tier.origins(taken))
        for block in blocks:
            pool.park(block)
        self.hashes += taken
        self.blocks += blocks
        return blocks

    def _evictable(self, limit: int, keep: set[int]) -> int:
        """Parked blocks outside ``keep``, counted up to ``limit``."""
        n, block = 0, int(self.pool.lru[0])
        while block >= 0 and n < limit:
            n += block not in keep
            block = int(self.pool.lru_next[block])
        return n

    def _oldest_outside(self, keep: set[int]) -> int:
        block = int(self.pool.lru[0])
        while block in keep:
            block = int(self.pool.lru_next[block])
        return block

    def _evict(self, block: int) -> None:
        pool, cache = self.pool, self.cache
        pool.unpark(block)
        pool.free_stack[pool.num_free] = block
        pool.num_free += 1
        self.evicted.append(Forgotten(block, cache.hash_of[block], cache.origin.get(block)))
        cache.forget(np.array([block], dtype=np.int64))

    def commit(self) -> int:
        """The step applied: the tier owes the copies. Returns the blocks the pool evicted."""
        self.tier.onboard(self.hashes, self.blocks)
        evicted = np.array([e.block for e in self.evicted], dtype=np.int64)
        self.tier.cancel_offloads(evicted)
        return evicted.size

    def undo(self) -> None:
        """The step was refused: the pool, the cache's maps, protection and events as they
        were before onboarding."""
        pool, cache = self.pool, self.cache
        for target, saved in zip((pool.free_stack, pool.refcounts, pool.lru_prev,
                                  pool.lru_next, pool.lru), self._pool_arrays, strict=True):
            target[:] = saved
        pool.num_free = self._num_free
        cache.rollback(self._journal, self.blocks, self.evicted)


def onboard(cache: PrefixCache, pool: BlockPool, tier: HostTier, prompts: list[Prompt | None],
            prompt_lens: np.ndarray) -> Onboarding | None:
    """Bring back from ``tier`` the blocks that continue each prompt's pool hits, prompt by
    prompt (a later prompt hits what an earlier one brought); None when no prompt continues
    there. A prompt's last token is never a hit (as in `PrefixCache.lookup`), and no prompt's
    pool hits are evicted to make room."""
    tpb = cache.tokens_per_block
    wanted = [(p.hashes[: (int(n) - 1) // tpb]) for p, n in zip(prompts, prompt_lens.tolist(),
                                                                  strict=True) if p is not None]
    keep = {b for hashes in wanted for b in _pool_run(cache, hashes)}
    onboarding: Onboarding | None = None
    for hashes in wanted:
        n = len(_pool_run(cache, hashes))
        more = tier.run(hashes[n:])
        if more:
            onboarding = onboarding or Onboarding(cache, pool, tier)
            keep.update(onboarding.take(hashes[n : n + more], keep))
    return onboarding


def _pool_run(cache: PrefixCache, hashes: list[bytes]) -> list[int]:
    """The blocks of the pool's cache holding ``hashes``, from the first, in a row."""
    found = list(map(cache.block_of.get, hashes))
    return found[: found.index(None)] if None in found else found  # type: ignore[return-value]
