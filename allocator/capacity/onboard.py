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

A step may bring back a bounded number of blocks (the copies are made before the forward that
follows, which every request of the worker's batch waits for): a prompt whose run the bound cuts
is brought back in part and left out of the step (`Deferral`), refused with
`REFUSED_ONBOARDING`; asked again, it finds that part in the pool, and the next step brings more.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from kvalloc.allocator.capacity.block_pool import BlockPool
from kvalloc.allocator.capacity.host_tier import HostTier
from kvalloc.allocator.capacity.prefix_cache import Forgotten, PrefixCache, Prompt
from kvalloc.allocator.capacity.step.plan import REFUSED_ONBOARDING, PlanArrays, StepOutcome


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
        # Prompts (by position) whose run the step's budget cut: they wait for the next step.
        self.deferred: list[int] = []

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
            prompt_lens: np.ndarray, budget: int | None = None) -> Onboarding | None:
    """Bring back from ``tier`` the blocks that continue each prompt's pool hits, prompt by
    prompt (a later prompt hits what an earlier one brought); None when no prompt continues
    there. A prompt's last token is never a hit (as in `PrefixCache.lookup`), and no prompt's
    pool hits are evicted to make room. ``budget``: blocks the step may bring back (None: no
    bound); a prompt whose run it cuts gets what is left and is deferred (`Onboarding.deferred`):
    admitted now it would recompute what the tier holds, asked again it finds the pool hold
    more."""
    tpb = cache.tokens_per_block
    wanted = [(i, p.hashes[: (int(prompt_lens[i]) - 1) // tpb]) for i, p in enumerate(prompts)
              if p is not None]
    keep = {b for _, hashes in wanted for b in _pool_run(cache, hashes)}
    onboarding: Onboarding | None = None
    left = budget
    for i, hashes in wanted:
        n = len(_pool_run(cache, hashes))
        more = tier.run(hashes[n:])
        if not more:
            continue
        onboarding = onboarding or Onboarding(cache, pool, tier)
        take = more if left is None else min(more, left)
        taken = onboarding.take(hashes[n : n + take], keep)
        keep.update(taken)
        if left is not None:
            left -= len(taken)
        if len(taken) < more and left is not None and left == 0:
            onboarding.deferred.append(i)
    return onboarding


def _pool_run(cache: PrefixCache, hashes: list[bytes]) -> list[int]:
    """The blocks of the pool's cache holding ``hashes``, from the first, in a row."""
    found = list(map(cache.block_of.get, hashes))
    return found[: found.index(None)] if None in found else found  # type: ignore[return-value]


class Deferral(NamedTuple):
    """A step's plan without its deferred new requests: ``kept`` are the positions of the new
    requests it still carries, in order."""

    arrays: PlanArrays
    prompts: list[Prompt | None]
    kept: np.ndarray

    @classmethod
    def of(cls, arrays: PlanArrays, prompts: list[Prompt | None], deferred: list[int],
           max_seq_len: int) -> Deferral | None:
        """None when nothing is deferred, or when a new request is invalid: the whole plan
        then goes to the step, which names what is wrong where the caller put it."""
        lens, chunks = arrays.prompt_lens, arrays.first_chunks
        if not deferred or not ((lens >= 1) & (lens <= max_seq_len) & (chunks >= 0)
                                & (chunks <= lens)).all():
            return None
        kept = np.setdiff1d(np.arange(lens.size), deferred)
        return cls(arrays._replace(prompt_lens=lens[kept], first_chunks=chunks[kept]),
                   [prompts[i] for i in kept.tolist()], kept)

    def outcome(self, ran: StepOutcome, num_new: int) -> StepOutcome:
        """``ran``'s outcome with the deferred requests back in their places, refused with
        `REFUSED_ONBOARDING`."""
        admitted = np.full(num_new, -1, dtype=np.int64)
        refusals = np.full(num_new, REFUSED_ONBOARDING, dtype=np.int8)
        cached = np.zeros(num_new, dtype=np.int64)
        admitted[self.kept], refusals[self.kept] = ran.admitted_rows, ran.new_refusals
        cached[self.kept] = ran.cached_tokens
        return dataclasses.replace(ran, admitted_rows=admitted, new_refusals=refusals,
                                   cached_tokens=cached)
