"""Prefix caching: full, committed prompt blocks addressed by content, shared between requests.

A block's hash chains over its parent's hash and its token ids, from a root that covers the
cache key (model variant, LoRA adapter) and a salt (a tenant's namespace, vLLM's ``cache_salt``):
two requests share a block only if their key and salt are the same and everything before the
block and in it is. The root is keyed with an optional secret seed (BLAKE2b's ``key``), so
whoever lacks the seed cannot compute a guessed prompt's hashes to match them against
published ones; every later hash inherits that from the root it chains on.

The hash is BLAKE2b with a 128-bit digest: an accidental collision needs about 2^64 distinct
blocks, and being a cryptographic hash a client cannot craft a prompt whose
block collides with another tenant's to read its KV; it is in the standard library and costs
about a microsecond per 16-token block.

A block is registered (``block_of[hash]``) only once it is full and every token in it is
committed: prompt tokens count once their prefill is scheduled (prefill carries no speculation),
so drafts, overlap slack and padding, which always sit past a request's history, never are.
Registered blocks form each row's leading columns (``RowState.cached``): a row stops registering
at the first block whose content another block already holds.

Only prompt blocks are cached (generated tokens reach the manager as counts, not ids).

When a block is registered is the caller's choice (`KVCacheManager`'s ``register_when_written``):
as soon as its tokens are scheduled (an engine that writes a step's K/V before the next step, as
vLLM does), or only once the caller says they are written (``mark_written``: a service whose
commit runs after the next step, or may drop a finished request's last tokens). Registered blocks
are write-protected (``protected``, for `DeferredWriteManager.protect`) until evicted;
``drain_protection`` gives the flips since the last drain, for a device copy.

Events (``record_events``): a `BlockStored` when blocks register, a `BlockRemoved` when they are
evicted, each with the namespace it concerns; ``stored_events`` rebuilds what a new subscriber of
one namespace must learn from ``origin``.

**Sliding windows** (``window``, `capacity.windows`): a query at position ``h`` reads only the
keys in ``(h - W, h]``, so a hit of ``h`` tokens in a windowed group needs only the blocks
covering ``(h - W, h]``: those from `windows.hits.hit_released` on, the columns before them start
`RELEASED` in the new row. The chain hash of a block covers everything before it, so a block
found stands for its whole prefix even where earlier blocks were evicted. The window releases
cached columns like any other, and a released cached block nobody holds is parked, not freed
(`windows.release`): it stays evictable and reusable. A row's cached columns ``[0, cached)``
may thus begin with released ones; it holds ``[released, cached)``. The window never releases
a block that is still to register: a row stays ``registering`` while its prompt has full blocks
that may register (not all registered, and none found already held by another block), and the
release keeps its columns from ``cached`` on meanwhile (`WindowRelease.keep_from`), however late
``mark_written`` comes.

Invariants (``check_invariants``): ``block_of`` and ``hash_of`` are inverse maps, ``origin`` has
the keys of ``hash_of`` (with events); a ``registering`` row is live with a prompt, fewer of
whose full blocks are cached; every row's cached columns it holds (``[released,
cached)``) are registered blocks whose hashes are the row's prompt hashes in order; every
registered block is owned (in some row's cached columns) or parked, never on the free stack, so
a cached block in no row is evictable; a block with more than one owner is registered.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from kvalloc.allocator.capacity.block_pool import BlockPool
from kvalloc.allocator.capacity.kv_events import (
    GROUP_INDEX,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    NamespacedEvent,
    block_stored,
    published,
    route_chain,
)
from kvalloc.allocator.capacity.state import RowState
from kvalloc.allocator.capacity.step.reference import Hits
from kvalloc.allocator.capacity.tier_copies import NO_COPIES, TierCopies
from kvalloc.allocator.capacity.windows.hits import hit_released, servable
from kvalloc.allocator.errors import InvalidValue, InvariantViolation

HASH_BYTES = 16
MAX_SEED_BYTES = hashlib.blake2b.MAX_KEY_SIZE


def chain_root(cache_key: bytes = b"", salt: bytes = b"", seed: bytes = b"") -> bytes:
    """The hash a prompt's chain starts from. The key's length goes in first, so no key and salt
    pair reads as another (``b"ab" + b"c"`` is not ``b"a" + b"bc"``)."""
    if len(seed) > MAX_SEED_BYTES:
        raise InvalidValue(f"seed: {len(seed)} bytes, at most {MAX_SEED_BYTES}", field="seed")
    return hashlib.blake2b(b"kvalloc-prefix\0" + len(cache_key).to_bytes(4, "big") + cache_key
                           + salt, digest_size=HASH_BYTES, key=seed).digest()


def block_hashes(tokens: np.ndarray, tokens_per_block: int, cache_key: bytes = b"", *,
                 salt: bytes = b"", seed: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens`` (a 1-D integer array), from
    `chain_root`."""
    data = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    step = tokens_per_block * 8
    parent = chain_root(cache_key, salt, seed)
    out = []
    for start in range(0, (len(data) // step) * step, step):
        parent = hashlib.blake2b(parent + data[start : start + step],
                                 digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class Prompt:
    """A prompt's token ids, the hashes of its full blocks, the namespace (salt) they were
    hashed under and, for KV events, the root of the chain routers see (`route_root`; None
    without events: the chain is hashed only for blocks that register). Build it when the
    request arrives (``of``) to keep the hashing out of the step that admits it."""

    tokens: np.ndarray
    hashes: list[bytes]
    namespace: bytes = b""
    route_root: bytes | None = None

    @classmethod
    def of(cls, tokens: np.ndarray, tokens_per_block: int, cache_key: bytes = b"", *,
           salt: bytes = b"", seed: bytes = b"", route_root: bytes | None = None) -> Prompt:
        return cls(tokens, block_hashes(tokens, tokens_per_block, cache_key, salt=salt,
                                        seed=seed), salt, route_root)


class Origin(NamedTuple):
    """What a registered block's `BlockStored` said: its namespace, its chain digest and its
    `published` form (its router hash), its parent's router hash (None at the root) and its
    token ids."""

    namespace: bytes
    digest: bytes
    route: int
    parent: int | None
    tokens: np.ndarray


class Forgotten(NamedTuple):
    """A registered block's entry, kept to put it back (`PrefixCache.rollback`)."""

    block: int
    block_hash: bytes
    origin: Origin | None


def stored_runs(origins: list[Origin], tokens_per_block: int,
                medium: str) -> list[NamespacedEvent]:
    """`BlockStored` events of ``origins`` in ``medium``: one per run of blocks that chain on
    one another in one namespace."""
    events: list[NamespacedEvent] = []
    run: list[Origin] = []
    for origin in [*origins, None]:
        if run and (origin is None or origin.namespace != run[-1].namespace
                    or origin.parent != run[-1].route):
            events.append(NamespacedEvent(run[0].namespace, block_stored(
                [o.route for o in run], run[0].parent, np.concatenate([o.tokens for o in run]),
                tokens_per_block, run[0].namespace, medium)))
            run = []
        if origin is not None:
            run.append(origin)
    return events


class CacheChanges(NamedTuple):
    """What a prefix cache changed since it was last drained (`PrefixCache.drain_changes`)."""

    blocks: np.ndarray  # int64: blocks whose write protection flipped
    protected: np.ndarray  # bool, one per block: its protection now
    events: list[NamespacedEvent]  # oldest first
    # With a host tier: the copies the pool's owner makes now, onboards first.
    onboards: TierCopies = NO_COPIES
    offloads: TierCopies = NO_COPIES


class PrefixCache:
    def __init__(self, num_blocks: int, tokens_per_block: int, num_rows: int, *,
                 record_events: bool = False, track_protection: bool = False,
                 window: int | None = None) -> None:
        """``track_protection``: keep the protection flips for ``drain_protection`` (whoever
        asks for them must drain them, or they pile up); ``window``: the group's sliding
        window (None: full attention), which decides what a hit needs."""
        self.tokens_per_block = tokens_per_block
        self.window = window
        self.protected = np.zeros(num_blocks, dtype=bool)  # exactly the registered blocks
        self.track_protection = track_protection
        self._flipped: list[int] = []
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.prompts: dict[int, Prompt] = {}  # rows admitted with token ids
        # Per row: a row of ``prompts`` whose full prompt blocks may still register (not all
        # are, and its run has met no block whose content another block holds). A window's
        # release reads it in place (`WindowRelease.keep_from`).
        self.registering = np.zeros(num_rows, dtype=bool)
        # With events: the registered blocks, in the order they registered.
        self.origin: dict[int, Origin] = {}
        self.record_events = record_events
        self.events: list[NamespacedEvent] = (
            [NamespacedEvent(None, AllBlocksCleared())] if record_events else [])
        self._registered: list[int] = []  # since the last `drain_registered`

    def record(self, event: NamespacedEvent) -> None:
        """Add an event of another tier, in order with the cache's own."""
        self.events.append(event)

    def drain_registered(self) -> list[int]:
        """Blocks registered (by ``register``, not ``adopt``) since the last drain, in order."""
        blocks, self._registered = self._registered, []
        return blocks

    def drain_events(self) -> list[NamespacedEvent]:
        """The events since the last drain, oldest first."""
        events, self.events = self.events, []
        return events

    def lookup(self, prompts: list[Prompt | None], prompt_lens: np.ndarray,
               hit_tokens: np.ndarray | None = None) -> Hits:
        """The longest hit each prompt can be served (`servable`), leaving at least one token to
        compute (the forward needs a query for the next token's logits); ``hit_tokens``: the
        hit to serve each prompt instead (one it can be served: `KVCacheGroups` agrees one
        length over several caches)."""
        counts = np.zeros(len(prompts), dtype=np.int64)
        released = np.zeros(len(prompts), dtype=np.int64)
        blocks: list[int] = []
        for i, prompt in enumerate(prompts):
            if prompt is None:
                continue
            limit = (int(prompt_lens[i]) - 1) // self.tokens_per_block
            # map/index run in C: a prompt costs a few microseconds, not one per block.
            found = list(map(self.block_of.get, prompt.hashes[:limit]))
            if hit_tokens is not None:
                n = self._asked(found, int(hit_tokens[i]), i)
            elif self.window is None:
                n = found.index(None) if None in found else len(found)
            else:
                n = int(np.flatnonzero(servable(found, self.window, self.tokens_per_block))[-1])
            first = hit_released(n, self.window, self.tokens_per_block)
            blocks += found[first:n]
            counts[i], released[i] = n - first, first
        return Hits(counts, np.array(blocks, dtype=np.int64), released)

    def servable(self, prompt: Prompt, prompt_len: int) -> np.ndarray:
        """Per hit length in blocks, 0 to the longest a prompt of ``prompt_len`` tokens may have
        (one token left to compute): whether this cache holds every block that hit needs
        (`windows.hits.servable`)."""
        limit = (prompt_len - 1) // self.tokens_per_block
        return servable(list(map(self.block_of.get, prompt.hashes[:limit])), self.window,
                        self.tokens_per_block)

    def _asked(self, found: list[int | None], tokens: int, index: int) -> int:
        """The blocks of an asked hit of ``tokens``, or InvalidValue if this cache cannot serve
        it to the ``index``-th prompt."""
        n, rest = divmod(tokens, self.tokens_per_block)
        if rest or not 0 <= n <= len(found) or not servable(found[:n], self.window,
                                                            self.tokens_per_block)[n]:
            raise InvalidValue(f"hit_tokens[{index}]: {tokens} is not a hit this cache serves",
                               field="hit_tokens")
        return n

    def forget(self, evicted: np.ndarray) -> None:
        """Evicted blocks' content is gone: drop their hashes."""
        blocks = evicted.tolist()
        removed = [self.hash_of.pop(block) for block in blocks]
        self.protected[blocks] = False
        if self.track_protection:
            self._flipped.extend(blocks)
        for block_hash in removed:
            del self.block_of[block_hash]
        if self.record_events and removed:
            self._record_removed([self.origin.pop(block) for block in blocks])

    def _record_removed(self, origins: list[Origin]) -> None:
        """One `BlockRemoved` per namespace, its blocks in eviction order."""
        by_namespace: dict[bytes, list[int]] = {}
        for origin in origins:
            by_namespace.setdefault(origin.namespace, []).append(origin.route)
        for namespace, hashes in by_namespace.items():
            self.events.append(NamespacedEvent(namespace, BlockRemoved(
                hashes, MEDIUM_POOL, GROUP_INDEX)))

    def admit(self, row: int, prompt: Prompt, cached: int) -> None:
        """Row ``row`` was admitted with ``prompt``, its first ``cached`` blocks a hit."""
        self.prompts[row] = prompt
        self.registering[row] = cached < prompt.tokens.size // self.tokens_per_block

    def register(self, row: int, rows: RowState, host: np.ndarray,
                 written: int | None = None) -> None:
        """Register the row's prompt blocks that are now full and committed (and, when
        ``written`` is given, within its first ``written`` tokens)."""
        prompt = self.prompts[row]
        tpb = self.tokens_per_block
        full = min(int(rows.history[row]), prompt.tokens.size,
                   prompt.tokens.size if written is None else written) // tpb
        first = int(rows.cached[row])
        if full <= first or not self.registering[row]:
            return
        candidates = prompt.hashes[first:full]
        # The row's cached run ends at the first block whose content another block holds.
        held = list(map(self.block_of.__contains__, candidates))
        n = held.index(True) if True in held else len(candidates)
        if n < len(candidates) or first + n == prompt.tokens.size // tpb:
            self.registering[row] = False
        stored = candidates[:n]
        blocks = host[row, first : first + n].tolist()
        self.block_of.update(zip(stored, blocks, strict=True))
        self.hash_of.update(zip(blocks, stored, strict=True))
        if self.record_events and blocks:
            self._record_stored(prompt, first, blocks, self._parent(prompt, first))
        self.protected[blocks] = True
        if self.track_protection:
            self._flipped.extend(blocks)
            self._registered.extend(blocks)
        rows.cached[row] = first + len(stored)

    def adopt(self, blocks: list[int], hashes: list[bytes],
              origins: list[Origin | None]) -> None:
        """Register unowned ``blocks`` as holding ``hashes``' content that came from elsewhere
        (a host tier), with the origins it had there; the caller parks them."""
        self.block_of.update(zip(hashes, blocks, strict=True))
        self.hash_of.update(zip(blocks, hashes, strict=True))
        self.protected[blocks] = True
        if self.track_protection:
            self._flipped.extend(blocks)
        if self.record_events:
            known = [o for o in origins if o is not None]
            assert len(known) == len(blocks), "a tier without events feeds a cache with them"
            self.origin.update(zip(blocks, known, strict=True))
            self.events += stored_runs(known, self.tokens_per_block, MEDIUM_POOL)

    def _parent(self, prompt: Prompt, first: int) -> Origin | None:
        """The origin of the block before ``first`` in ``prompt`` (None: ``first`` is its first
        block): registered still, though a window may have released it from the row, or, once
        evicted, its chain digest worked out again from the prompt."""
        if first == 0:
            return None
        block = self.block_of.get(prompt.hashes[first - 1])
        if block is not None:
            return self.origin[block]
        assert prompt.route_root is not None, "a prompt made without events"
        tpb = self.tokens_per_block
        digest = route_chain(prompt.route_root, prompt.tokens[: first * tpb], tpb)[-1]
        return Origin(prompt.namespace, digest, published(digest), None,
                      prompt.tokens[(first - 1) * tpb : first * tpb])

    def _record_stored(self, prompt: Prompt, first: int, blocks: list[int],
                       parent: Origin | None) -> None:
        """The registered blocks' origins, and their `BlockStored`. ``parent``: the block
        before ``first`` (None: ``first`` is the prompt's first block)."""
        assert prompt.route_root is not None, "a prompt made without events"
        tpb = self.tokens_per_block
        tokens = prompt.tokens[first * tpb : (first + len(blocks)) * tpb]
        digests = route_chain(prompt.route_root if parent is None else parent.digest, tokens,
                              tpb)
        routes = [published(d) for d in digests]
        parents = [None if parent is None else parent.route, *routes[:-1]]
        for i, block in enumerate(blocks):
            self.origin[block] = Origin(prompt.namespace, digests[i], routes[i], parents[i],
                                        tokens[i * tpb : (i + 1) * tpb])
        self.events.append(NamespacedEvent(prompt.namespace, block_stored(
            routes, parents[0], tokens, tpb, prompt.namespace, MEDIUM_POOL)))

    def stored_events(self, namespace: bytes) -> list[BlockStored]:
        """A `BlockStored` for every block of ``namespace`` that can serve a hit (its chain back
        to the root registered), parents first: what a new subscriber of that namespace must
        learn to hold what the live events since would have told it."""
        reachable: set[int] = set()
        events = []
        for origin in self.origin.values():
            if origin.namespace != namespace or (origin.parent is not None
                                                 and origin.parent not in reachable):
                continue
            reachable.add(origin.route)
            events.append(block_stored([origin.route], origin.parent, origin.tokens,
                                       self.tokens_per_block, namespace, MEDIUM_POOL))
        return events

    def journal(self) -> tuple[int, int]:
        """Where the logs of events and protection flips stand, for `rollback`."""
        return len(self.events), len(self._flipped)

    def rollback(self, journal: tuple[int, int], adopted: list[int],
                 forgotten: list[Forgotten]) -> None:
        """Undo ``adopt`` of the ``adopted`` blocks and ``forget`` of the ``forgotten`` entries,
        made since ``journal``, with their events and flips."""
        for block in adopted:
            del self.block_of[self.hash_of.pop(block)]
            self.origin.pop(block, None)
        self.protected[adopted] = False
        for entry in forgotten:
            self.block_of[entry.block_hash], self.hash_of[entry.block] = (entry.block,
                                                                          entry.block_hash)
            if entry.origin is not None:
                self.origin[entry.block] = entry.origin
            self.protected[entry.block] = True
        del self.events[journal[0]:]
        del self._flipped[journal[1]:]

    def drain_protection(self) -> tuple[np.ndarray, np.ndarray]:
        """Blocks whose protection changed since the last drain, and their protection now."""
        blocks = np.array(self._flipped, dtype=np.int64)
        self._flipped = []
        return blocks, self.protected[blocks]

    def drain_changes(self) -> CacheChanges:
        """The protection flips and the events since the last drain of either."""
        blocks, protected = self.drain_protection()
        return CacheChanges(blocks, protected, self.drain_events())

    def check_invariants(self, rows: RowState, host: np.ndarray, pool: BlockPool) -> None:
        if len(self.block_of) != len(self.hash_of) or any(
                self.block_of.get(h) != b for b, h in self.hash_of.items()):
            raise InvariantViolation("the hash-to-block and block-to-hash maps disagree")
        if self.record_events and self.origin.keys() != self.hash_of.keys():
            raise InvariantViolation("the registered blocks' origins are not exactly the "
                                     "registered blocks")
        if any(not rows.live[r] or r not in self.prompts
               or rows.cached[r] >= self.prompts[r].tokens.size // self.tokens_per_block
               for r in np.flatnonzero(self.registering).tolist()):
            raise InvariantViolation("a registering row is not live, has no prompt or has "
                                     "cached every full prompt block")
        in_rows = np.zeros(pool.num_blocks, dtype=bool)
        for row in np.flatnonzero(rows.live).tolist():
            cached, first = int(rows.cached[row]), int(rows.released[row])
            blocks = host[row, first:cached].tolist()
            prompt = self.prompts.get(row)
            if cached and (prompt is None or [self.hash_of.get(b) for b in blocks]
                           != prompt.hashes[first:cached]):
                raise InvariantViolation(f"row {row}'s cached columns are not its prompt blocks")
            if cached * self.tokens_per_block > rows.history[row]:
                raise InvariantViolation(f"row {row} caches blocks past its history")
            in_rows[blocks] = True
        registered = np.zeros(pool.num_blocks, dtype=bool)
        registered[list(self.hash_of)] = True
        parked = np.zeros(pool.num_blocks, dtype=bool)
        parked[pool.parked()] = True
        if not np.array_equal(registered, in_rows | parked):
            raise InvariantViolation("registered blocks are not exactly the cached columns and "
                                     "the parked blocks")
        if not np.array_equal(self.protected, registered):
            raise InvariantViolation("write protection differs from the registered blocks")
        if (pool.refcounts[~registered] > 1).any():
            raise InvariantViolation("a block with more than one owner is not a cached block")
