"""`ServiceCore`: the one writer behind both transports.

It owns the pool as the workers share it (`server.service.shared_pool.SharedPool`: the storage,
the shards, the committers, each worker's staging and fences), the host-side `KVCacheManager`,
the `WorkerRegistry` and the `StepPipeline`, and dispatches every operation under one lock:
sessions and the epoch are checked first, then a worker's step ids (idempotent retries), then
the operation runs. REST and IPC decode a request into a `server.contract.wire` struct (a
`StepCall` for the step), call one method here and encode what it returns; they hold no logic.

Invariants:
- single writer: every method runs under ``self.lock``, so steps apply atomically and in
  arrival order, and a concurrent caller never sees half a step;
- all or nothing: a call that raises has changed nothing (every service check runs before the
  manager's step, and the manager validates the whole plan before it mutates);
- a worker's step ids only increase: the last id again, with the same body, returns the cached
  reply without applying anything; a smaller one is refused;
- every decode request of a worker's previous step is settled by its next step (results,
  reverts or finished), so a staged batch is committed exactly once; an overlap worker's by the
  step after (lag 2, `server.service.inflight`), and it commits its own tokens;
- a worker silent for ``lease_ttl_s`` loses its session, its requests and their blocks;
- a tensor-parallel pool's shards (`server.service.shards`) hold the same blocks: one manager
  allocates them, every shard's table copy is synced by the same step, and the step's commit
  writes every shard;
- a grouped pool's groups (`ServiceConfig.groups`, `KVCacheGroups`) hold the same requests in
  the same rows: every step and every drop goes through all of them, and the step's commit
  writes each group's pool at its own table's slots; with prefix caching each group's cache
  protects its own blocks (its committer's mask, the one its workers map). Its workers attach
  (`AttachRequired` otherwise): a reply's table changes and slot mapping would describe one
  table.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvalloc.allocator import (
    HashScope,
    InvariantViolation,
    KVCacheGroups,
    KVCacheManager,
    StepPlan,
    TensorAllocator,
    group_pools,
)
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall, StepResult
from kvalloc.server.contract.errors import (
    AttachRequired,
    LimitExceeded,
    NotReady,
    StaleEpoch,
    StepIdReused,
    StepOutOfOrder,
    WrongRank,
)
from kvalloc.server.contract.routing import SEED_BYTES, hash_seed, worker_salt
from kvalloc.server.contract.sharing import dtype_name
from kvalloc.server.service.events.stream import StreamFormat
from kvalloc.server.service.events.streams import EventStreams, per_worker
from kvalloc.server.service.pipeline import StepPipeline
from kvalloc.server.service.registry import Worker, WorkerRegistry
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.service.shared_pool import InProcessShare, SharedPool

log = logging.getLogger("kvalloc.service")


class ServiceObserver(Protocol):
    """What the service reports to metrics (`server.service.metrics.ServiceMetrics` is one)."""

    def observe_step(self, transport: str, seconds: float) -> None: ...

    def lease_expired(self, n: int = 1) -> None: ...

    def invariant_violation(self, n: int = 1) -> None: ...

    def shared_state_repaired(self, repaired: dict[str, int]) -> None:
        """Entries of the state workers map that another process changed, put back, by what
        (`SharedPool.repair`)."""

    def state_changed(self) -> None:
        """Called under the lock after each change and on every lease check (about once a
        second), so an observer can copy the state it reports without taking the lock later."""


class _Observers(list[ServiceObserver]):
    """Every observer, told as one."""

    def observe_step(self, transport: str, seconds: float) -> None:
        for obs in self:
            obs.observe_step(transport, seconds)

    def lease_expired(self, n: int = 1) -> None:
        for obs in self:
            obs.lease_expired(n)

    def invariant_violation(self, n: int = 1) -> None:
        for obs in self:
            obs.invariant_violation(n)

    def shared_state_repaired(self, repaired: dict[str, int]) -> None:
        for obs in self:
            obs.shared_state_repaired(repaired)

    def state_changed(self) -> None:
        for obs in self:
            obs.state_changed()


class _PauseWatch:
    """The gaps between two looks for expired leases that are pauses of the whole service (see
    `ServiceCore.watch_pauses`)."""

    def __init__(self, now: float) -> None:
        self.last_look = now
        # The longest gap that is not a pause; None: gaps are not watched.
        self.longest_quiet_s: float | None = None

    def watch(self, now: float, longest_quiet_s: float) -> None:
        self.last_look, self.longest_quiet_s = now, longest_quiet_s

    def paused(self, now: float) -> float:
        """How long the service was paused before this look at ``now`` (0.0: it was not)."""
        gap, self.last_look = now - self.last_look, now
        if self.longest_quiet_s is not None and gap > self.longest_quiet_s:
            return gap
        return 0.0


class ServiceCore:
    def __init__(self, config: ServiceConfig, *, clock: Callable[[], float] = time.monotonic,
                 epoch: int | None = None) -> None:
        self.config = config
        self.clock = clock
        # 52 bits: exact in every JSON reader, doubles included (jq, JavaScript).
        self.epoch = secrets.randbits(52) if epoch is None else epoch
        self.lock = threading.Lock()
        self.pool = SharedPool(config, self.epoch, functools.partial(_manager, config))
        # A grouped pool's first group's manager: what `get_request` and /metrics read.
        self.manager = self.pool.manager
        self.groups = self.pool.groups
        self.device = self.manager.device
        self.registry = WorkerRegistry(config.pool.max_batch_size, config.max_workers)
        # KV events: a service stream's first batch (AllBlocksCleared) goes out now: a new epoch,
        # an empty cache; a worker's stream opens when it registers.
        self.kv_events = _event_streams(config, self.manager)
        self.pipeline = StepPipeline(self.manager, self.pool.commits, self.registry,
                                     max_step_tokens=config.max_step_tokens,
                                     publish=None if self.kv_events is None
                                     else self.kv_events.publish,
                                     copy_tier=self.pool.copy_tier if self.pool.tier_stores
                                     else None, groups=self.groups)
        self.pipeline.sync_cache()
        self.layout = _layout(config, dtype_name(self.pool.staging_dtype))
        self._observers = _Observers()
        self.leases_expired = 0
        self.ready = True  # until `close`: /readyz answers it, every call checks it
        self._pauses = _PauseWatch(self.clock())

    # ------------------------------------------------------------------ lifecycle

    def add_observer(self, observer: ServiceObserver) -> None:
        self._observers.append(observer)

    def observe_step(self, transport: str, seconds: float) -> None:
        """Transports report each per-step call's service time here."""
        self._observers.observe_step(transport, seconds)

    def close(self) -> None:
        """Stop answering and unlink every shared-memory segment. Idempotent."""
        with self.lock:
            self.ready = False
            self.pool.close()
            if self.kv_events is not None:
                self.kv_events.close()

    def _check_open(self) -> None:
        if not self.ready:
            raise NotReady("service: shutting down")

    # ------------------------------------------------------------------ workers and leases

    def register(self, req: wire.RegisterRequest) -> wire.Registration:
        """Open a session for ``worker_id`` (see `WorkerRegistry` for ids held by a session)."""
        with self.lock:
            self._check_open()
            _check_rank(self.config, req)
            if self.groups is not None and not req.attached:
                raise AttachRequired(
                    f"attached: a grouped pool ({[g.name for g in self.config.groups]}) has a "
                    "block table per group, and replies carry one table's changes; register "
                    "attached (same host)")
            self._expire(self.clock())
            again = self.registry.retried(req)
            if again is not None:  # the first answer was lost: the same session, unchanged
                self.registry.worker(req.worker_id, again.session).last_seen = self.clock()
                return again
            replaced = self.registry.check_capacity(req.worker_id, req.replace)
            if replaced is not None:
                n = self._drop(replaced)
                log.warning("worker %r registered again with replace: its previous session "
                            "ended, %d requests freed", req.worker_id, n)
            if self.kv_events is not None:  # what was drained before goes to the others alone
                self.pipeline.sync_cache()
                self.kv_events.open_worker(req.worker_id,
                                           worker_salt(req.worker_id, self.config.cache_groups))
            own_table = _keeps_own_table(self.config, self.pool, req)
            worker = self.registry.add(lambda session: _new_worker(
                self.pool, req, session, self.clock(), self.config.cache_groups,
                own_table=own_table, fenced=_needs_fence(self.config, req, own_table)))
            self._observers.state_changed()
            registration = wire.Registration(
                worker_id=worker.worker_id, session=worker.session, epoch=self.epoch,
                lease_ttl_s=self.config.lease_ttl_s, next_step_id=0, layout=self.layout,
                attachment=worker.attachment, own_table=own_table,
            )
            worker.registered = (req, registration)
            return registration

    def holds(self, worker_id: str) -> bool:
        """Whether a live session holds ``worker_id``."""
        with self.lock:
            return self.registry.get(worker_id) is not None

    def drop_worker(self, worker_id: str) -> int:
        """End ``worker_id``'s session, whichever it is, as a replacing registration does;
        returns the requests freed."""
        with self.lock:
            worker = self.registry.get(worker_id)
            freed = 0 if worker is None else self._drop(worker)
            self._observers.state_changed()
            return freed

    def deregister(self, req: wire.WorkerRef) -> wire.Deregistered:
        with self.lock:
            self._check_open()
            self._expire(self.clock())
            if (done := self.registry.ended(req)) is not None:
                return done  # a retry whose first attempt's reply was lost: that reply again
            worker = self.registry.worker(req.worker_id, req.session)
            reply = wire.Deregistered(worker_id=req.worker_id, freed_requests=self._drop(worker))
            self.registry.remember_ended(req, reply)
            self._observers.state_changed()
            return reply

    def expire_leases(self) -> int:
        """Drop every worker whose lease ran out; returns how many. The reaper calls this."""
        with self.lock:
            if not self.ready:
                return 0
            expired = self._expire(self.clock())
            self._observers.state_changed()
            return expired

    def watch_pauses(self, longest_quiet_s: float) -> None:
        """From now on, a gap longer than ``longest_quiet_s`` between two looks for expired leases
        means the service did not run (SIGSTOP, swapped out, a long GC pause): leases are
        extended by it instead of all running out at once. The caller looks at least that
        often (the lease reaper), so no gap that long comes from a service that was running."""
        with self.lock:
            self._pauses.watch(self.clock(), longest_quiet_s)

    def _expire(self, now: float) -> int:
        paused = self._pauses.paused(now)
        if paused:
            self.registry.extend_leases(paused)
            log.warning("the service did not run for %.1fs (paused); every lease is extended "
                        "by that instead of running out", paused)
        ttl = self.config.lease_ttl_s
        expired = self.registry.expired(now, ttl)
        for worker in expired:
            free_before = self.pipeline.scarcest.free_blocks
            n = self._drop(worker)
            log.warning("lease of worker %r expired (silent > %.1fs): freed %d requests, "
                        "%d blocks", worker.worker_id, ttl, n,
                        self.pipeline.scarcest.free_blocks - free_before)
        if expired:
            self.leases_expired += len(expired)
            self._observers.lease_expired(len(expired))
        return len(expired)

    def _drop(self, worker: Worker) -> int:
        """End ``worker``'s session: its requests and their blocks go back, its staging too."""
        rows = self.registry.remove(worker)
        self.pool.end_writes(worker)  # before its blocks can go to anyone else
        if rows.size:
            (self.groups or self.manager).step(StepPlan(finished_rows=rows))
        self.pool.release(worker)
        if self.kv_events is not None:
            self.kv_events.close_worker(worker.worker_id)
        return int(rows.size)

    # ------------------------------------------------------------------ the per-step call

    def step(self, call: StepCall) -> StepResult:
        with self.lock:
            self._check_open()
            if call.epoch != self.epoch:  # checked first: a restart is reported as such
                raise StaleEpoch(f"epoch: {call.epoch} is stale, the service restarted (epoch "
                                 f"now {self.epoch}); register again")
            self._expire(self.clock())
            worker = self.registry.worker(call.worker_id, call.session)
            worker.last_seen = self.clock()
            last = worker.last_step_id
            if last is not None and call.step_id <= last:
                if call.step_id < last:
                    raise StepOutOfOrder(f"step_id: {call.step_id} is older than the last "
                                         f"applied step {last}")
                if call != worker.last_call:
                    raise StepIdReused(f"step_id: {last} was applied with a different body; "
                                       f"a retry must resend the same step")
                assert worker.last_result is not None
                return worker.last_result
            _check_limits(self.config, call)
            result = self.pipeline.execute(worker, call, self.epoch)
            worker.last_step_id, worker.last_call, worker.last_result = (call.step_id, call,
                                                                         result)
            # Silence counts from the reply: a step the service itself was slow to answer (a
            # first call compiling the step's loops) is no silence of the worker's.
            worker.last_seen = self.clock()
            self._observers.state_changed()
            return result

    def shared_tensors(self, worker_id: str) -> InProcessShare:
        """The pool, the block table, ``worker_id``'s staging buffer and fence, and the
        protection of cached blocks (prefix caching), with every shard's or group's, as this
        process holds them: what an in-process worker uses instead of mapping the handles."""
        with self.lock:
            return self.pool.shared_tensors(self.registry.worker(worker_id, None))

    # ------------------------------------------------------------------ inspection

    def get_request(self, req: wire.RequestRef) -> wire.RequestState:
        with self.lock:
            self._check_open()
            self._expire(self.clock())
            worker = self.registry.worker(req.worker_id, req.session)
            row = self.registry.row_of(worker, req.req_id)
            view = self.manager.view(row)
            return wire.RequestState(
                worker_id=req.worker_id, req_id=req.req_id, handle=self.registry.handle(row),
                row=row, capacity=view.capacity, history=view.history,
                pending_overlap_slack=view.pending_overlap_slack,
                pending_draft_len=view.pending_draft_len, num_blocks=view.num_blocks,
                block_ids=view.block_ids.tolist(),
            )

    def get_pool(self, req: wire.PoolQuery) -> wire.PoolState:
        """Occupancy, workers and counters (a grouped pool's: its group with the fewest free
        blocks, `StepPipeline.scarcest`); ``verify`` first puts back any shared state another
        process changed (`repair_shared_state`), then checks every invariant."""
        repaired = req.verify and any(self.repair_shared_state().values())
        with self.lock:
            self._check_open()
            mgr, now = self.pipeline.scarcest, self.clock()
            if req.verify:
                self.check_invariants()
            totals = mgr.totals()
            return wire.PoolState(
                epoch=self.epoch, layout=self.layout, free_blocks=mgr.free_blocks,
                used_blocks=mgr.held_blocks, parked_blocks=mgr.pool.num_parked,
                num_requests=mgr.num_requests,
                workers=[wire.WorkerState(
                    worker_id=w.worker_id, num_requests=len(w.req_ids),
                    last_step_id=w.last_step_id,
                    lease_expires_in_s=max(0.0, w.last_seen + self.config.lease_ttl_s - now),
                ) for w in self.registry],
                capacity_tokens=totals["capacity_tokens"], history_tokens=totals["history_tokens"],
                pending_slack_tokens=totals["pending_slack_tokens"],
                leases_expired=self.leases_expired,
                counters={k: int(v) for k, v in dataclasses.asdict(mgr.counters).items()},
                invariants=("unchecked" if not req.verify else "repaired" if repaired
                            else "ok"),
            )

    def repair_shared_state(self) -> dict[str, int]:
        """Compare what workers map read-only (every shard's block table, protection of cached
        blocks and fence words) with the service's own state, and rewrite what another process
        changed (`SharedPool.repair`); returns the entries rewritten, by what, and counts them.
        A verify query runs it, and the service itself every ``verify_interval_s``."""
        with self.lock:
            if not self.ready:
                return {}
            self.pipeline.sync_cache()  # protection flips not yet shared are no tampering
            repaired = self.pool.repair({w.fence_slot: w.session for w in self.registry})
            if any(repaired.values()):
                self._observers.shared_state_repaired(repaired)
            return repaired

    def check_invariants(self) -> None:
        """The manager's invariants (every group's, and that they hold the same requests) plus
        the registry's (workers own exactly the live requests, in the rows the manager holds
        them) and the committers'."""
        try:
            (self.groups or self.manager).check_invariants()
            self.registry.check_invariants(self.manager.live_rows)
            self.pool.check_invariants()
        except InvariantViolation:
            self._observers.invariant_violation(1)
            raise


def _new_worker(pool: SharedPool, req: wire.RegisterRequest, session: int, now: float,
                cache_groups: dict[str, list[str]], *, own_table: bool,
                fenced: bool) -> Worker:
    """The worker ``req`` registers in ``session``, with what the pool shares with it."""
    share = pool.attach(req.worker_id, session, overlap=req.overlap, fenced=fenced)
    return Worker(req.worker_id, session, req.attached, stagings=share.stagings,
                  writers=share.writers, fence_slot=share.fence_slot,
                  attachment=share.attachment, fence=share.fence, last_seen=now,
                  overlap=req.overlap, own_table=own_table,
                  cache_salt=worker_salt(req.worker_id, cache_groups))


def _keeps_own_table(config: ServiceConfig, pool: SharedPool,
                     req: wire.RegisterRequest) -> bool:
    """Whether ``req``'s worker keeps its own block table: one that did not attach always; one
    that asks, where that spares the service device work (one table on one CUDA device: a
    shared-memory table costs a worker nothing to read, a copy would only cost it)."""
    return not req.attached or (req.own_table and not config.groups and len(pool.shards) == 1
                                and pool.shards[0].spec.device.type == "cuda")


def _needs_fence(config: ServiceConfig, req: wire.RegisterRequest, own_table: bool) -> bool:
    """Whether ``req``'s worker needs a step fence: unless the service does no device work on
    its calls (it commits its own tokens and keeps its own table, and no prefix cache writes
    protection or host-tier copies) and no other worker can be handed a block its forward,
    launched ahead, still writes (a freed block reaches another worker's forward only behind
    the fence's order): a service of one worker."""
    return not (own_table and req.overlap and not config.prefix_caching
                and config.max_workers == 1)


def _check_rank(config: ServiceConfig, req: wire.RegisterRequest) -> None:
    rank = config.data_parallel_rank
    if req.data_parallel_rank is not None and req.data_parallel_rank != (rank or 0):
        raise WrongRank(f"data_parallel_rank: the worker is of rank {req.data_parallel_rank}, "
                        f"this service allocates for rank {rank or 0}")


def _check_limits(config: ServiceConfig, call: StepCall) -> None:
    cap = config.pool.max_batch_size
    entries = call.entries()
    if max(entries.values()) <= cap:  # the common call: no list is named
        return
    for name, n in entries.items():
        if n > cap:
            raise LimitExceeded(f"{name}: {n} entries, more than max_batch_size={cap}",
                                field=name)


def _manager(config: ServiceConfig,
             placement: TensorAllocator) -> KVCacheManager | KVCacheGroups:
    """The host-side manager (a grouped pool's groups), its block tables made where the pool
    places them. A grouped pool's groups register blocks when they are written, as a pool does;
    they publish no KV events and keep no host tier (the configuration refuses both)."""
    if config.groups:
        return KVCacheGroups(group_pools(config.pool, config.groups), allocate=placement,
                             prefix_caching=config.prefix_caching, hash_seed=_hash_seed(config))
    return KVCacheManager(config.pool, allocate=placement, prefix_caching=config.prefix_caching,
                          hash_seed=_hash_seed(config), kv_events=config.kv_events is not None,
                          event_hashes=(HashScope.CONTENT if config.kv_events is not None
                                        and per_worker(config.kv_events)
                                        else HashScope.NAMESPACE),
                          register_when_written=True, host_tier_blocks=config.host_tier_blocks,
                          onboard_blocks_per_step=config.onboard_blocks_per_step)


def _event_streams(config: ServiceConfig, manager: KVCacheManager) -> EventStreams | None:
    if config.kv_events is None:
        return None
    assert manager.cache is not None  # the configuration requires prefix caching with events
    form = StreamFormat(shape=config.kv_events_shape,
                        data_parallel_rank=config.data_parallel_rank)
    return EventStreams(config.kv_events, config.kv_events_replay, form, config.event_access,
                        manager.stored_events)


def _hash_seed(config: ServiceConfig) -> bytes:
    """The block hashes' key: from the configured secret, else random (then nobody outside this
    process can compute a hash; a router indexes the events' token ids instead)."""
    if config.hash_seed is None:
        return secrets.token_bytes(SEED_BYTES)
    return hash_seed(config.hash_seed.get_secret_value())


def _layout(config: ServiceConfig, staging_dtype: str) -> wire.PoolLayout:
    pool = config.pool
    # A grouped pool's figures above its groups are its first group's.
    return wire.PoolLayout(
        num_blocks=config.groups[0].num_blocks if config.groups else pool.total_blocks,
        tokens_per_block=pool.tokens_per_block,
        num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
        kv_layout=pool.kv_layout,
        dtype=pool.dtype, staging_dtype=staging_dtype, device=str(pool.device),
        max_batch_size=pool.max_batch_size, max_blocks_per_seq=pool.max_blocks_per_seq,
        max_draft_len=pool.max_draft_len, max_step_tokens=config.max_step_tokens,
        overlap_scheduler=pool.overlap_scheduler,
        k_scales=list(pool.k_scales) if pool.k_scales else None,
        v_scales=list(pool.v_scales) if pool.v_scales else None,
        tensor_parallel=config.tensor_parallel, data_parallel_rank=config.data_parallel_rank,
        window=config.groups[0].window if config.groups else pool.window,
        groups=[wire.GroupLayout(name=g.name, layers=list(g.layers), window=g.window,
                                 num_blocks=g.num_blocks) for g in config.groups],
    )
