"""`HostTier`: the index of a host tier below the pool: which cached block each of its slots holds,
least recently used first, and the copies between pool and tier the device owes it.

The tier holds copies of registered prefix blocks under the keyed hash the prefix cache looks
them up by, so a tier hit needs what a pool hit needs: the same cache key, namespace and
everything before and in the block. Only registered blocks reach it (full, committed, written and
write-protected: the content of a registered block never changes), so no draft, padding or
half-written block can.

Content goes in write-through: a block is *offloaded* when it registers, not when the pool evicts
it. Eviction then costs the pool nothing and waits on no copy (the step that needs the block
hands it out at once), and a block is in the tier before anything can take it from the pool.
The price is link traffic for blocks that would never have been evicted: one block per full
prompt block, a few percent of the link at prefill speed (docs/design.md has the figures).

Content comes back by *onboarding* (`capacity.onboard`): a prompt whose prefix continues in the
tier past its pool hits gets fresh pool blocks for the rest, registered in the pool's cache as if
computed, and the copies into them are ordered before anything reads them (the caller's job:
`drain` hands them over with the offloads).

Slots are free or held; a held slot is in the LRU order (oldest first), which a hit or a repeated
offload refreshes, and a full tier evicts its oldest slot for new content.

Events (with ``record``): `BlockStored` with medium `MEDIUM_TIER` when an offload is drained (the
copy is on its way), `BlockRemoved` with it when a slot whose stored event went out is evicted.

Invariants (``check_invariants``): ``slot_of`` and ``lru`` are inverse maps; every slot is free
or held, never both, and appears once; every pending offload writes a held slot; with events,
the announced slots are held and have origins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from kvalloc.allocator.capacity.kv_events import (
    GROUP_INDEX,
    MEDIUM_TIER,
    BlockRemoved,
    BlockStored,
    NamespacedEvent,
)
from kvalloc.allocator.capacity.prefix_cache import Origin, PrefixCache, stored_runs
from kvalloc.allocator.capacity.tier_copies import TierCopies
from kvalloc.allocator.errors import InvalidValue, InvariantViolation


@dataclass
class TierCounters:
    """Cumulative counts; the metrics layer exports them."""

    offloaded_blocks: int = 0  # pool blocks copied into the tier
    onboarded_blocks: int = 0  # tier slots copied into fresh pool blocks (tier hits)
    evicted_blocks: int = 0  # held slots evicted for new content
    deferred_requests: int = 0  # new requests a step left out while their prefix came back


class HostTier:
    def __init__(self, num_slots: int, tokens_per_block: int, *,
                 record: Callable[[NamespacedEvent], None] | None = None) -> None:
        """``record``: where the tier's events go (None: no events, no origins kept)."""
        if num_slots <= 0:
            raise InvalidValue(f"host_tier_blocks: {num_slots} must be > 0",
                               field="host_tier_blocks")
        self.num_slots = num_slots
        self.tokens_per_block = tokens_per_block
        self.record = record
        self.slot_of: dict[bytes, int] = {}
        self.lru: OrderedDict[int, bytes] = OrderedDict()  # held slots, oldest first
        self.free = list(range(num_slots - 1, -1, -1))  # a stack, slot 0 on top
        self.origin: dict[int, Origin] = {}  # with events: what each held slot's event says
        self.announced: set[int] = set()  # held slots whose BlockStored went out
        self._offloads: dict[int, int] = {}  # slot -> block, until drained
        self._onboards: list[tuple[int, int]] = []  # (block, slot), until drained
        self.counters = TierCounters()

    @classmethod
    def below(cls, cache: PrefixCache | None, register_when_written: bool,
              num_slots: int) -> HostTier:
        """A tier under ``cache``, recording its events where the cache does. Only written
        blocks may be copied: the cache must register blocks once written, not scheduled."""
        if cache is None or not register_when_written:
            raise InvalidValue("host_tier_blocks: a host tier needs prefix caching with "
                               "register_when_written", field="host_tier_blocks")
        if cache.window is not None:  # its lookups run from a prompt's first block
            raise InvalidValue("host_tier_blocks: a windowed group keeps no host tier",
                               field="host_tier_blocks")
        return cls(num_slots, cache.tokens_per_block,
                   record=cache.record if cache.record_events else None)

    @property
    def held(self) -> int:
        return len(self.lru)

    def run(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, the tier holds in a row."""
        found = list(map(self.slot_of.__contains__, hashes))
        return found.index(False) if False in found else len(found)

    def store(self, hashes: list[bytes], blocks: list[int], origins: list[Origin | None]) -> None:
        """Offload registered pool blocks: each content the tier lacks takes a slot (the oldest
        held one when none is free) and owes a copy from its block; content it holds is only
        refreshed."""
        for block_hash, block, origin in zip(hashes, blocks, origins, strict=True):
            slot = self.slot_of.get(block_hash)
            if slot is not None:
                self.lru.move_to_end(slot)
                continue
            slot = self.free.pop() if self.free else self._evict_oldest()
            self.slot_of[block_hash] = slot
            self.lru[slot] = block_hash
            if origin is not None and self.record is not None:
                self.origin[slot] = origin
            self._offloads[slot] = block

    def origins(self, hashes: list[bytes]) -> list[Origin | None]:
        """What the held ``hashes``' events said (None without events)."""
        return [self.origin.get(self.slot_of[h]) for h in hashes]

    def store_registered(self, cache: PrefixCache) -> None:
        """Offload the blocks ``cache`` registered since it was last asked and that are still
        registered (`store`)."""
        blocks = [b for b in cache.drain_registered() if b in cache.hash_of]
        self.store([cache.hash_of[b] for b in blocks], blocks,
                   [cache.origin.get(b) for b in blocks])

    def onboard(self, hashes: list[bytes], blocks: list[int]) -> None:
        """Owe copies of the held ``hashes`` into pool ``blocks`` (a hit: they become the most
        recently used)."""
        for block_hash, block in zip(hashes, blocks, strict=True):
            slot = self.slot_of[block_hash]
            self.lru.move_to_end(slot)
            self._onboards.append((block, slot))

    def cancel_offloads(self, blocks: np.ndarray) -> None:
        """Pool ``blocks`` lost their content before their offload was drained: their slots
        would receive something else, so they are freed instead."""
        if not self._offloads or blocks.size == 0:
            return
        gone = set(blocks.tolist())
        for slot in [s for s, b in self._offloads.items() if b in gone]:
            del self._offloads[slot]
            self._release(slot)

    def drain(self) -> tuple[TierCopies, TierCopies]:
        """The onboards and offloads owed since the last drain, each oldest first, with the
        offloads' stored events recorded: the caller copies them now, onboards first (an offload
        may reuse a slot an onboard reads)."""
        offloads, self._offloads = self._offloads, {}
        onboards, self._onboards = self._onboards, []
        self.counters.offloaded_blocks += len(offloads)
        self.counters.onboarded_blocks += len(onboards)
        if self.record is not None:
            self._announce(list(offloads))
        return TierCopies.of(onboards), TierCopies.of([(b, s) for s, b in offloads.items()])

    def _announce(self, slots: list[int]) -> None:
        origins = [self.origin[slot] for slot in slots if slot in self.origin]
        self.announced.update(slot for slot in slots if slot in self.origin)
        assert self.record is not None
        for event in stored_runs(origins, self.tokens_per_block, MEDIUM_TIER):
            self.record(event)

    def stored_events(self, namespace: bytes) -> list[BlockStored]:
        """A `BlockStored` for every announced slot of ``namespace`` whose chain back to the root
        is in the tier, parents first (what a new subscriber must learn)."""
        reachable: set[int] = set()
        events = []
        for slot, origin in self.origin.items():
            if (slot not in self.announced or origin.namespace != namespace
                    or (origin.parent is not None and origin.parent not in reachable)):
                continue
            reachable.add(origin.route)
            events += [e.event for e in stored_runs([origin], self.tokens_per_block,
                                                    MEDIUM_TIER)]
        return events

    def _evict_oldest(self) -> int:
        slot, _ = next(iter(self.lru.items()))
        self._release(slot)
        self.counters.evicted_blocks += 1
        return self.free.pop()

    def _release(self, slot: int) -> None:
        """Free a held slot, with its `BlockRemoved` if its stored event went out."""
        del self.slot_of[self.lru.pop(slot)]
        self._offloads.pop(slot, None)
        origin = self.origin.pop(slot, None)
        if slot in self.announced:
            self.announced.discard(slot)
            if self.record is not None and origin is not None:
                self.record(NamespacedEvent(origin.namespace, BlockRemoved(
                    [origin.route], MEDIUM_TIER, GROUP_INDEX)))
        self.free.append(slot)

    def check_invariants(self) -> None:
        if len(self.slot_of) != len(self.lru) or any(
                self.slot_of.get(h) != s for s, h in self.lru.items()):
            raise InvariantViolation("the tier's hash-to-slot map and its LRU order disagree")
        held = set(self.lru)
        if len(set(self.free)) != len(self.free) or held & set(self.free):
            raise InvariantViolation("a tier slot is free twice, or both free and held")
        if len(held) + len(self.free) != self.num_slots:
            raise InvariantViolation(f"tier slots not conserved: {len(held)} held + "
                                     f"{len(self.free)} free != {self.num_slots}")
        if not set(self._offloads) <= held:
            raise InvariantViolation("an offload is owed to a tier slot that holds nothing")
        if not self.announced <= held or (self.record is not None
                                          and not self.announced <= set(self.origin)):
            raise InvariantViolation("an announced tier slot is not held, or has no origin")
