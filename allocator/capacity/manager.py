"""`KVCacheManager`: per-request capacity, history and overlap slack, and the blocks behind them.

The manager is host-only: it owns the block pool's bookkeeping and the block table (host mirror
plus the device copy it keeps in sync), not the KV pool itself (`KVStorage`, built by whoever
runs the model). Its state is keyed by block-table row (`state.RowState`).

This module is the batched core: ``step`` applies one `StepPlan`, and every grant site and every
settlement goes through it. The step runs compiled (`step.compiled`, numba) or as the numpy
specification (`step.reference`); both change the same state identically. The per-request API of
docs/design.md (``add_request``, ``try_allocate_generation``, ``update_resources``, ``free``,
``capacity``, ...) is a facade over ``step`` (`capacity.requests`): it names a request by the id
it was added under and translates it at the edge (``rows_of``).

Invariants (``check_invariants`` verifies all of them):
- history <= capacity, and num_blocks == ceil(capacity / tokens_per_block) <= max_blocks_per_seq;
- a request holds at most one generation grant at a time, and at lag 2 at most one unsettled
  step behind it (granted at lag 2 too); the pending grant added exactly ``1 + draft + slack``
  (slack per `reference.grant_slack`: `accounting.slack_for` at lag 1, `accounting.lag2_slack`
  at lag 2), which is what a revert takes back (never below history: `accounting.revert`);
- blocks are conserved (free + parked + owned == total); reference counts equal the number of
  rows holding a block, and a block held by more than one row, or parked, is a cached prefix
  block (`prefix_cache`): registered, write-protected, in the leading ``cached`` columns of
  every row that holds it; a registered block no row holds is parked (evictable), a window's
  released cached block included;
- block-table rows hold the request's blocks and -1 beyond; the device copy equals the host;
- full attention (``config.window`` None) releases nothing (a windowed group's hits and cached
  blocks: `prefix_cache`; it keeps no host tier); a windowed group's rows hold
  `RELEASED`, never a block, in their first ``released`` columns (cached ones among them),
  exactly those wholly behind the window of the lowest position a step still reads short of a
  prompt block still to register (the cache's ``registering`` rows), a real block from there
  to their last block, and at most `config.window_row_blocks` blocks besides those kept
  (`capacity.windows` states and checks it);
- the rows off the free-row stack are exactly the live rows; a row that is not live holds
  nothing (all its state is zero) and no request id.

Every public call validates its whole input before it changes anything: an error leaves the
manager exactly as it was.

Prefill tokens carry no speculation, so a prefill chunk counts as history as soon as it is
scheduled (capacity == history for it). A request takes generation grants once its whole
prompt is scheduled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from kvalloc.allocator.capacity.accounting import blocks_for, lag2_slack
from kvalloc.allocator.capacity.block_pool import BlockPool
from kvalloc.allocator.capacity.block_table import BlockTable
from kvalloc.allocator.capacity.host_tier import HostTier
from kvalloc.allocator.capacity.kv_events import (
    BlockStored,
    HashScope,
    NamespacedEvent,
    route_root,
)
from kvalloc.allocator.capacity.onboard import Deferral, onboard
from kvalloc.allocator.capacity.prefix_cache import CacheChanges, PrefixCache, Prompt, chain_root
from kvalloc.allocator.capacity.requests import RequestApi, RequestIds
from kvalloc.allocator.capacity.slots import run_slots
from kvalloc.allocator.capacity.state import (
    POLICY_CODES,
    CapacityState,
    ManagerCounters,
    RowState,
    StepLimits,
)
from kvalloc.allocator.capacity.step import compiled as step_compiled
from kvalloc.allocator.capacity.step.codes import ROW_OVERFLOW, raise_step_error
from kvalloc.allocator.capacity.step.plan import (
    PlanArrays,
    RequestView,
    StepOutcome,
    StepPlan,
    coerce,
    prompt_token_arrays,
)
from kvalloc.allocator.capacity.step.reference import NO_HITS, StepRun, grant_slack, reference_step
from kvalloc.allocator.capacity.windows.release import WindowRelease
from kvalloc.allocator.common.placement import TensorAllocator, plain_tensor
from kvalloc.allocator.config import PoolConfig, SlackPolicy
from kvalloc.allocator.errors import InvalidValue, InvariantViolation, UnknownRequest
from numpy.typing import ArrayLike


class KVCacheManager(RequestApi):
    def __init__(self, config: PoolConfig, *, allocate: TensorAllocator = plain_tensor,
                 compiled: bool | None = None, prefix_caching: bool = False,
                 cache_key: bytes = b"", hash_seed: bytes = b"", kv_events: bool = False,
                 event_hashes: HashScope = HashScope.NAMESPACE,
                 register_when_written: bool = False, host_tier_blocks: int = 0,
                 onboard_blocks_per_step: int | None = None) -> None:
        """``compiled``: run the step compiled (True), as numpy (False), or compiled when numba
        imports (None). ``prefix_caching``: new requests admitted with their prompt token ids
        share cached full blocks (`prefix_cache`); ``cache_key`` separates model variants;
        ``hash_seed``: the secret the block hashes are keyed with (`prefix_cache.chain_root`);
        ``kv_events``: record KV events for ``drain_kv_events``, their block hashes over
        ``event_hashes`` (`kv_events.router_hashes`); ``register_when_written``: a prompt block
        becomes shareable when ``mark_written`` says its tokens are in the pool, not when its
        prefill is scheduled (a window keeps the block until then); ``host_tier_blocks``: slots
        of a host tier below the pool (`capacity.host_tier`), which needs both (only written
        blocks may be copied); ``onboard_blocks_per_step``: the most blocks one step brings
        back from it (None: no bound; `capacity.onboard`). With ``config.window`` the rows are
        one sliding-window group's: the blocks behind every window go back to the pool after
        each step (`capacity.windows`)."""
        window = config.window
        self.cache = (PrefixCache(config.total_blocks, config.tokens_per_block,
                                  config.max_batch_size, record_events=kv_events,
                                  track_protection=register_when_written, window=window)
                      if prefix_caching else None)
        self.window = None if window is None else WindowRelease(
            window, config.tokens_per_block, config.max_batch_size, self.cache)
        self.config = config
        self.device = torch.device(config.device)
        self.policy = SlackPolicy(config.slack_policy)
        self.tokens_per_block = config.tokens_per_block
        self.max_blocks_per_seq = config.max_blocks_per_seq
        self.pool = BlockPool(config.total_blocks)
        self.table = BlockTable(config.max_batch_size, self.max_blocks_per_seq, self.device,
                                allocate=allocate)
        self.rows = RowState.empty(config.max_batch_size)
        self.counters = ManagerCounters()
        self.state = CapacityState(StepLimits.of(config), self.rows, self.pool, self.table)
        if compiled is None:
            compiled = step_compiled.available()
        self.compiled = compiled
        self._run = (step_compiled.CompiledStep(self.state, self.window).run if compiled
                     else reference_step)
        self.cache_key, self.hash_seed = bytes(cache_key), bytes(hash_seed)
        chain_root(self.cache_key, seed=self.hash_seed)  # a seed too long fails here, not later
        self.register_when_written = register_when_written
        self.tier = (None if host_tier_blocks == 0 else
                     HostTier.below(self.cache, register_when_written, host_tier_blocks))
        self.onboard_blocks_per_step = onboard_blocks_per_step
        self.event_hashes = event_hashes
        # The per-request API's ids; rows a batched step admits have none.
        self.ids = RequestIds()

    # ------------------------------------------------------------------ the batched step

    def step(self, plan: StepPlan) -> StepOutcome:
        """Apply a whole scheduler step in one call (see `StepPlan` for the order); rows as
        integer arrays. Raises a typed error, changing nothing, on bad input."""
        arrays = coerce(plan)
        outcome = self.step_arrays(arrays, prompt_token_arrays(plan.prompt_tokens,
                                                               arrays.prompt_lens))
        assert outcome is not None
        return outcome

    def step_arrays(self, arrays: PlanArrays, tokens: Sequence[Any] = (), *, apply: bool = True,
                    hit_tokens: np.ndarray | None = None) -> StepOutcome | None:
        """`step` for a plan its caller already converted and checked as `step` would (`coerce`
        or `plan.checked_plan`; ``tokens`` as `prompt_token_arrays` returns them): rows,
        bounds and the state machine are still the step's to check, and a typed error still
        changes nothing. ``apply`` False: it stops before its first change, raising the error it
        would or returning None (how `windows.groups` checks every group first). ``hit_tokens``:
        each new request's prefix hit, not the longest (`windows.groups` agrees one over groups)."""
        if hit_tokens is not None and self.tier is not None:
            raise InvalidValue("hit_tokens: not with a host tier", field="hit_tokens")
        prompts: list[Prompt | None] = []
        hits, onboarding, deferral, ran = NO_HITS, None, None, arrays
        if self.cache is not None and any(t is not None for t in tokens):
            prompts = [t if t is None or isinstance(t, Prompt) else self.prompt(t)
                       for t in tokens]
            if self.tier is not None:
                onboarding = onboard(self.cache, self.pool, self.tier, prompts,
                                     arrays.prompt_lens, self.onboard_blocks_per_step)
                deferral = onboarding and Deferral.of(arrays, prompts, onboarding.deferred,
                                                      self.config.max_seq_len)
            ran, looked_up = (arrays, prompts) if deferral is None else deferral[:2]
            hits = self.cache.lookup(looked_up, ran.prompt_lens, hit_tokens)
        result: StepRun = self._run(ran, self.state, hits, apply)
        if result.error[0] or not apply:
            if onboarding is not None:
                onboarding.undo()
            self.counters.row_overflows += int(result.error[0] == ROW_OVERFLOW)
            if result.error[0]:
                raise_step_error(result.error, ran, self.ids.name)
            return None
        assert result.outcome is not None and result.counter_deltas is not None
        self.counters.add(result.counter_deltas)
        if self.window is not None and not self.compiled:  # the compiled step released
            result = dataclasses.replace(result, outcome=self.window.release(
                ran, result.outcome, self.state))
        if onboarding is not None:
            self.counters.evicted_blocks += onboarding.commit()
        if deferral is not None:
            assert self.tier is not None
            self.tier.counters.deferred_requests += arrays.prompt_lens.size - deferral.kept.size
            result = dataclasses.replace(result, outcome=deferral.outcome(
                result.outcome, arrays.prompt_lens.size))
        if self.cache is not None:
            self._cache_after(arrays, result, prompts)
        if arrays.finished_rows.size:
            self.ids.forget(arrays.finished_rows)
        return result.outcome

    def _cache_after(self, arrays: PlanArrays, result: StepRun,
                     prompts: list[Prompt | None]) -> None:
        """Evicted blocks lose their hashes; finished rows their prompts; admitted rows and
        scheduled prefill chunks register the blocks they filled."""
        cache, outcome = self.cache, result.outcome
        assert cache is not None and outcome is not None and result.evicted is not None
        if result.evicted.size:
            cache.forget(result.evicted)
            if self.tier is not None:
                self.tier.cancel_offloads(result.evicted)
        if cache.prompts and arrays.finished_rows.size:
            cache.registering[arrays.finished_rows] = False
            for row in arrays.finished_rows.tolist():
                cache.prompts.pop(row, None)
        for i, prompt in enumerate(prompts):
            row = int(outcome.admitted_rows[i])
            if prompt is not None and row >= 0:
                cache.admit(row, prompt, int(self.rows.cached[row]))
                if not self.register_when_written:
                    cache.register(row, self.rows, self.table.host)
                self.counters.prefix_queried_tokens += prompt.tokens.size
                self.counters.prefix_hit_tokens += int(outcome.cached_tokens[i])
        if cache.prompts and arrays.prefill_rows.size and not self.register_when_written:
            for row in arrays.prefill_rows[outcome.prefill_granted].tolist():
                if row in cache.prompts:
                    cache.register(row, self.rows, self.table.host)

    def mark_written(self, rows: np.ndarray, written_tokens: np.ndarray) -> None:
        """With ``register_when_written``: the first ``written_tokens[i]`` tokens of live row
        ``rows[i]`` are in the pool, so its full prompt blocks among them become shareable (and
        write-protected). Rows admitted without token ids are skipped."""
        cache = self.cache
        if cache is None or not cache.prompts:
            return
        for row, written in zip(np.asarray(rows).tolist(), np.asarray(written_tokens).tolist(),
                                strict=True):
            if row in cache.prompts and self.rows.live[row]:
                cache.register(row, self.rows, self.table.host, written)

    def token_slots(self, rows: np.ndarray, starts: np.ndarray,
                    num_tokens: np.ndarray) -> np.ndarray:
        """Where runs of tokens live in the pool, by the host table (`slots.run_slots`): run
        ``i`` is ``num_tokens[i]`` tokens from position ``starts[i]`` of row ``rows[i]``. int64
        slots, run after run; -1 where a position has no block."""
        return run_slots(self.table.host, rows, starts, num_tokens, self.tokens_per_block)

    def drain_cache_changes(self) -> CacheChanges:
        """What the prefix cache changed since the last drain: the blocks whose write protection
        flipped, their protection now (for a device copy of the mask) and the KV events, oldest
        first. Nothing without prefix caching."""
        if self.cache is None:
            return CacheChanges(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool), [])
        if self.tier is None:
            return self.cache.drain_changes()
        self.tier.store_registered(self.cache)
        onboards, offloads = self.tier.drain()
        return self.cache.drain_changes()._replace(onboards=onboards, offloads=offloads)

    def prompt(self, tokens: ArrayLike, salt: bytes = b"") -> Prompt:
        """``tokens`` with their block hashes under this manager's cache key and seed, for
        ``StepPlan.prompt_tokens``: hashing when a request arrives keeps it out of the step.
        ``salt``: the prompt's namespace (vLLM's ``cache_salt``); prompts share blocks only
        under the same salt. Token ids given bare to the step are hashed with no salt."""
        root = (None if self.cache is None or not self.cache.record_events
                else route_root(self.cache_key,
                                salt if self.event_hashes is HashScope.NAMESPACE else b""))
        return Prompt.of(np.asarray(tokens, dtype=np.int64), self.tokens_per_block,
                         self.cache_key, salt=salt, seed=self.hash_seed, route_root=root)

    def stored_events(self, namespace: bytes) -> list[BlockStored]:
        """What a new subscriber of ``namespace`` must learn: a `BlockStored` for every block of
        it the pool can serve a hit from, then for every one in the host tier."""
        assert self.cache is not None
        tier = [] if self.tier is None else self.tier.stored_events(namespace)
        return [*self.cache.stored_events(namespace), *tier]

    def drain_kv_events(self) -> list[NamespacedEvent]:
        """KV events since the last drain (``kv_events=True``; empty otherwise), oldest first."""
        return self.cache.drain_events() if self.cache is not None else []

    def clear_prefix_cache(self) -> None:
        """Evict every parked block (they go back on the free stack; the event stream says
        ``BlockRemoved``). Blocks live requests hold stay cached."""
        if self.cache is None:
            return
        evicted = [self.pool.evict_oldest() for _ in range(self.pool.num_parked)]
        self.cache.forget(np.array(evicted, dtype=np.int64))
        self.counters.evicted_blocks += len(evicted)

    # ------------------------------------------------------------------ queries

    def view(self, row: int) -> RequestView:
        """Everything about one live row (UnknownRequest naming ``row`` otherwise)."""
        if not (isinstance(row, int | np.integer) and 0 <= row < self.rows.live.size
                and self.rows.live[row]):
            raise UnknownRequest(f"row: {row!r} is not a live row", field="row")
        r = self.rows
        return RequestView(
            row=int(row), capacity=int(r.capacity[row]), history=int(r.history[row]),
            pending_overlap_slack=int(r.slack[row]),
            pending_draft_len=int(r.draft_len[row]) if r.pending[row] else None,
            num_blocks=int(r.num_blocks[row]),
            block_ids=self.table.host[row, : r.num_blocks[row]].copy(),
        )

    @property
    def live_rows(self) -> np.ndarray:
        return np.flatnonzero(self.rows.live)

    @property
    def prefix_caching(self) -> bool:
        return self.cache is not None

    @property
    def free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def used_blocks(self) -> int:
        """Blocks off the free stack: held by requests, or parked in the prefix cache."""
        return self.pool.num_blocks - self.pool.num_free

    @property
    def held_blocks(self) -> int:
        """Blocks live requests hold: off the free stack and not parked in the prefix cache."""
        return self.used_blocks - self.pool.num_parked

    @property
    def num_requests(self) -> int:
        """Live requests, with or without an id."""
        return self.config.max_batch_size - self.table.num_free_rows

    def totals(self) -> dict[str, int]:
        """Sums and maxima over live requests (for metrics and the pool endpoint)."""
        live = self.rows.live
        cap, hist = self.rows.capacity[live], self.rows.history[live]
        # Blocks held: a windowed row's released columns hold none.
        slack = self.rows.slack[live]
        blocks = self.rows.num_blocks[live] - self.rows.released[live]
        return {
            "capacity_tokens": int(cap.sum()),
            "history_tokens": int(hist.sum()),
            "pending_slack_tokens": int(slack.sum()),
            "max_capacity_tokens": int(cap.max(initial=0)),
            "max_history_tokens": int(hist.max(initial=0)),
            "max_pending_slack_tokens": int(slack.max(initial=0)),
            "max_uncommitted_tokens": int((cap - hist).max(initial=0)),
            "max_blocks": int(blocks.max(initial=0)),
        }

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise InvariantViolation if any documented invariant does not hold."""
        r = self.rows
        self.pool.check_invariants()
        live = np.flatnonzero(r.live)
        dead = ~r.live
        if any(arr[dead].any() for arr in vars(r).values()):
            raise InvariantViolation("a row that is not live holds state")
        if (r.history[live] > r.capacity[live]).any():
            raise InvariantViolation("history > capacity")
        expected = blocks_for(r.capacity[live], self.tokens_per_block)
        if not np.array_equal(expected, r.num_blocks[live]):
            raise InvariantViolation("num_blocks != ceil(capacity / tokens_per_block)")
        if (r.num_blocks[live] > self.max_blocks_per_seq).any():
            raise InvariantViolation("a row holds more than max_blocks_per_seq blocks")
        _check_grant_records(r, live, self.state.limits, POLICY_CODES[self.policy])
        self.table.check_invariants(live, r.num_blocks[live], self.pool.num_blocks, synced=True,
                                    released=r.released[live])
        if self.window is not None:
            self.window.check_invariants(r)
        elif r.released.any():
            raise InvariantViolation("released columns under full attention")
        self.table.check_held_rows(r.live)
        held = self.table.host[live]
        held = held[held >= 0]
        refs = np.zeros(self.pool.num_blocks, dtype=np.int64)
        np.add.at(refs, held, 1)
        if not np.array_equal(refs, self.pool.refcounts):
            raise InvariantViolation("block-table ownership disagrees with reference counts")
        if self.tier is not None:
            self.tier.check_invariants()
        if self.cache is not None:
            self.cache.check_invariants(r, self.table.host, self.pool)
        elif self.pool.num_parked or r.cached.any() or (self.pool.refcounts > 1).any():
            raise InvariantViolation("cached or shared blocks without prefix caching")
        self.ids.check_invariants(r.live)


def _check_grant_records(r: RowState, live: np.ndarray, limits: StepLimits,
                         policy: int) -> None:
    """A pending grant's slack is what its grant site adds (`grant_slack`, by the lag it was
    made at); a step behind it was granted at lag 2 too; nothing is recorded without them."""
    pend = live[r.pending[live]]
    want = grant_slack(r.draft_len[pend], r.ahead[pend], r.lead[pend], limits)
    if not np.array_equal(r.slack[pend], want):
        raise InvariantViolation("a pending grant's slack is not what its grant site adds")
    idle = live[~r.pending[live]]
    if (r.slack[idle] != 0).any() or (r.draft_len[idle] != 0).any() or r.ahead[idle].any():
        raise InvariantViolation("slack or drafts recorded without a pending grant")
    behind = live[r.behind[live]]
    if not (r.pending[behind] & r.ahead[behind]).all():
        raise InvariantViolation("a step behind a grant that is not a pending lag-2 grant")
    if not np.array_equal(r.behind_slack[behind], lag2_slack(r.behind_draft[behind], policy)):
        raise InvariantViolation("a step behind records a slack its grant did not add")
    alone = live[~r.behind[live]]
    if r.behind_draft[alone].any() or r.behind_slack[alone].any():
        raise InvariantViolation("a step behind recorded where there is none")
