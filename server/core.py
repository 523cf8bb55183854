"""`ServiceCore`: the one writer behind both transports.

It owns one `KVCacheManager` (pool, block table, capacity accounting), the NWOR commit, the
registry of workers with their leases, and the shared-memory / CUDA IPC exports. REST and IPC
decode a request into a `server.wire` struct, call one method here and encode what it returns;
they hold no logic.

Invariants:
- single writer: every method runs under ``self.lock``, so steps apply atomically and in
  arrival order, and a concurrent caller never sees half a step;
- all or nothing: a call that raises has changed nothing (the manager validates the whole plan
  before it mutates; the service's own checks run before the manager's);
- a worker's step ids only increase: the last id again returns the cached reply without
  applying anything; a smaller one is refused;
- every request of a worker's previous step is settled by its next step (results, reverts or
  finished), so a staged window is committed exactly once;
- request ids live in their worker's namespace: the manager keys requests by
  ``(worker_id, req_id)``, so one worker can never touch another's requests;
- a worker silent for ``lease_ttl_s`` loses its registration, its requests and their blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from allocator import InvariantViolation, KVCacheManager, StepOutcome, StepPlan, UnknownRequest

from . import wire
from .commit import Committer
from .errors import (
    LimitExceeded,
    NotReady,
    RequestNotFound,
    StaleEpoch,
    StepIdReused,
    StepOutOfOrder,
    TooManyWorkers,
    UnknownWorker,
    WindowNotSettled,
)
from .settings import ServiceConfig
from .sharing import StepFence, TensorExporter, dtype_name
from .window import Window

log = logging.getLogger("kvalloc.service")

class ServiceObserver(Protocol):
    """What the service reports to metrics (`allocator.metrics.AllocatorMetrics` is one)."""

    def observe_step(self, transport: str, seconds: float) -> None: ...

    def lease_expired(self, n: int = 1) -> None: ...

    def invariant_violation(self, n: int = 1) -> None: ...

    def state_changed(self) -> None:
        """Called under the lock after each change and on every lease check (about once a
        second), so an observer can copy the state it reports without taking the lock later."""


@dataclass
class Worker:
    worker_id: str
    staging: torch.Tensor
    attachment: wire.Attachment
    fence: StepFence | None
    last_seen: float
    rows: dict[str, int] = field(default_factory=dict)  # its live requests -> block-table row
    last_step_id: int | None = None
    last_request: wire.StepRequest | None = None
    last_reply: wire.StepReply | None = None
    window: Window | None = None


class ServiceCore:
    def __init__(self, config: ServiceConfig, *, clock: Callable[[], float] = time.monotonic,
                 epoch: int | None = None) -> None:
        self.config = config
        self.clock = clock
        # 52 bits: exact in every JSON reader, doubles included (jq, JavaScript).
        self.epoch = secrets.randbits(52) if epoch is None else epoch
        self.lock = threading.Lock()
        self.manager = KVCacheManager(config.pool)
        self.device = self.manager.device
        self._tpb = config.pool.tokens_per_block
        self._exporter = TensorExporter(prefix=f"kvalloc-{self.epoch:016x}")
        # The pool and the block table move into shared memory (CPU) or get CUDA IPC handles
        # before anything else holds a reference to them.
        storage = self.manager.storage
        assert storage is not None
        storage.kv, self._kv_handle = self._exporter.share(storage.kv, "kv")
        table = self.manager.table
        table.device_table, self._table_handle = self._exporter.share(table.device_table,
                                                                      "table")
        self.staging_dtype = (torch.bfloat16 if config.pool.dtype == "fp8_e4m3"
                              else config.pool.torch_dtype)
        self.committer = Committer(storage, max_tokens=config.max_step_tokens,
                                   stage_dtype=self.staging_dtype)
        self.layout = _layout(config, dtype_name(self.staging_dtype))
        self._workers: dict[str, Worker] = {}
        self._fences: dict[str, tuple[StepFence, wire.EventHandle, wire.EventHandle]] = {}
        self._observers: list[ServiceObserver] = []
        self.leases_expired = 0
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def add_observer(self, observer: ServiceObserver) -> None:
        self._observers.append(observer)

    def observe_step(self, transport: str, seconds: float) -> None:
        """Transports report each per-step call's service time here."""
        for obs in self._observers:
            obs.observe_step(transport, seconds)

    @property
    def ready(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Stop answering and unlink every shared-memory segment. Idempotent."""
        with self.lock:
            self._closed = True
            self._workers.clear()
            self._exporter.close()

    def _state_changed(self) -> None:
        for obs in self._observers:
            obs.state_changed()

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady("service: shutting down")

    # ------------------------------------------------------------------ workers and leases

    def register(self, req: wire.RegisterRequest) -> wire.Registration:
        """Register ``worker_id``, or start it afresh: a re-registration frees its requests."""
        with self.lock:
            self._check_open()
            self._expire(self.clock())
            worker = self._workers.get(req.worker_id)
            if worker is not None:
                self._free_requests(worker)
                worker.last_step_id = worker.last_request = worker.last_reply = None
                worker.window = None
            else:
                worker = self._new_worker(req.worker_id)
            worker.last_seen = self.clock()
            self._state_changed()
            return wire.Registration(
                worker_id=worker.worker_id, epoch=self.epoch, lease_ttl_s=self.config.lease_ttl_s,
                next_step_id=0, layout=self.layout, attachment=worker.attachment,
            )

    def _new_worker(self, worker_id: str) -> Worker:
        if len(self._workers) >= self.config.max_workers:
            raise TooManyWorkers(f"worker_id: {self.config.max_workers} workers are registered "
                                 f"(max_workers); deregister one first")
        pool = self.config.pool
        shape = (pool.num_layers, 2, self.config.max_step_tokens, pool.num_kv_heads, pool.head_dim)
        staging, handle = self._exporter.empty(f"staging-{worker_id}", shape, self.staging_dtype,
                                               self.device)
        fence, fwd, com = self._fence(worker_id)
        attachment = wire.Attachment(kv=self._kv_handle, block_table=self._table_handle,
                                     staging=handle, forward_done=fwd, commit_done=com)
        worker = Worker(worker_id, staging, attachment, fence, last_seen=self.clock())
        self._workers[worker_id] = worker
        return worker

    def _fence(self, worker_id: str) -> tuple[StepFence | None, wire.EventHandle | None,
                                              wire.EventHandle | None]:
        """The worker id's interprocess events (CUDA pools only), made once and kept until the
        service closes: using an imported event after its exporter destroyed it is undefined, and
        a worker whose lease expired may still record its event once before it learns so."""
        if self.device.type != "cuda":
            return None, None, None
        if worker_id not in self._fences:
            self._fences[worker_id] = StepFence.create(self.device)
        return self._fences[worker_id]

    def deregister(self, req: wire.WorkerRef) -> wire.Deregistered:
        with self.lock:
            self._check_open()
            worker = self._worker(req.worker_id)
            freed = self._drop_worker(worker)
            self._state_changed()
            return wire.Deregistered(worker_id=req.worker_id, freed_requests=freed)

    def expire_leases(self) -> int:
        """Drop every worker whose lease ran out; returns how many. The reaper calls this."""
        with self.lock:
            if self._closed:
                return 0
            expired = self._expire(self.clock())
            self._state_changed()
            return expired

    def _expire(self, now: float) -> int:
        ttl = self.config.lease_ttl_s
        expired = [w for w in self._workers.values() if now - w.last_seen > ttl]
        for worker in expired:
            free_before = self.manager.free_blocks
            n = self._drop_worker(worker)
            log.warning("lease of worker %r expired (silent > %.1fs): freed %d requests, "
                        "%d blocks", worker.worker_id, ttl, n,
                        self.manager.free_blocks - free_before)
        if expired:
            self.leases_expired += len(expired)
            for obs in self._observers:
                obs.lease_expired(len(expired))
        return len(expired)

    def _drop_worker(self, worker: Worker) -> int:
        n = self._free_requests(worker)
        del self._workers[worker.worker_id]
        self._exporter.release(f"staging-{worker.worker_id}")
        return n

    def _free_requests(self, worker: Worker) -> int:
        keys = [(worker.worker_id, r) for r in worker.rows]
        if keys:
            self.manager.step(StepPlan(finished=keys))
        worker.rows.clear()
        return len(keys)

    def _worker(self, worker_id: str, epoch: int | None = None) -> Worker:
        """The live worker, checking the epoch first: a restart is reported as such."""
        if epoch is not None and epoch != self.epoch:
            raise StaleEpoch(f"epoch: {epoch} is stale, the service restarted (epoch now "
                             f"{self.epoch}); register again")
        self._expire(self.clock())
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(f"worker_id: {worker_id!r} is not registered (never, or its "
                                f"lease expired); register again")
        return worker

    # ------------------------------------------------------------------ the per-step call

    def step(self, req: wire.StepRequest) -> wire.StepReply:
        with self.lock:
            self._check_open()
            worker = self._worker(req.worker_id, req.epoch)
            worker.last_seen = self.clock()
            last = worker.last_step_id
            if last is not None and req.step_id <= last:
                if req.step_id < last:
                    raise StepOutOfOrder(f"step_id: {req.step_id} is older than the last "
                                         f"applied step {last}")
                if req != worker.last_request:
                    raise StepIdReused(f"step_id: {last} was applied with a different body; "
                                       f"a retry must resend the same step")
                assert worker.last_reply is not None
                return worker.last_reply
            self._check_limits(req)
            reply = self._apply(worker, req)
            worker.last_step_id, worker.last_request, worker.last_reply = req.step_id, req, reply
            self._state_changed()
            return reply

    def _check_limits(self, req: wire.StepRequest) -> None:
        cap = self.config.pool.max_batch_size
        lists = {"results": req.results, "reverts": req.reverts, "finished": req.finished,
                 "grants": req.grants, "padding": req.padding, "prefill": req.prefill,
                 "new": req.new}
        for name, items in lists.items():
            if len(items) > cap:
                raise LimitExceeded(f"{name}: {len(items)} entries, more than max_batch_size="
                                    f"{cap}", field=name)
        demand = {
            "grants": sum(1 + d for d in _drafts(req).values()),
            "prefill": sum(p.num_tokens for p in req.prefill),
            "new": sum(n.first_chunk or n.prompt_len for n in req.new),
        }
        limit, total = self.config.max_step_tokens, 0
        for name, tokens in demand.items():
            total += tokens
            if total > limit:
                raise LimitExceeded(f"{name}: the step would schedule {sum(demand.values())} "
                                    f"tokens, more than max_step_tokens={limit}", field=name)

    def _apply(self, worker: Worker, req: wire.StepRequest) -> wire.StepReply:
        mgr = self.manager
        accepted = {r.req_id: r.num_accepted for r in req.results}
        dropped = {*req.reverts, *req.finished}
        previous = worker.window
        if previous is not None:
            missing = previous.unsettled(accepted.keys() | dropped)
            if missing:
                raise WindowNotSettled(
                    f"results: request {missing[0]!r} ran in step {worker.last_step_id}: report "
                    f"its accepted count, revert it or finish it ({len(missing)} unsettled)")
        # Rows never change while a request lives: read them before the step frees any.
        touched = dict.fromkeys([*(x.req_id for x in req.results), *req.reverts,
                                 *(x.req_id for x in req.grants),
                                 *(x.req_id for x in req.padding),
                                 *(x.req_id for x in req.prefill)])
        finishing = set(req.finished)
        rows = {r: worker.rows[r] for r in touched if r in worker.rows and r not in finishing}
        finished_rows = {r: worker.rows[r] for r in req.finished if r in worker.rows}
        touched_rows = np.fromiter(rows.values(), dtype=np.int64, count=len(rows))
        blocks_before = mgr.row_block_counts(touched_rows)

        if worker.fence is not None:
            worker.fence.service_begin()
        outcome = mgr.step(_plan(worker.worker_id, req))
        # ---- applied: nothing below raises on input.
        for r in req.finished:
            del worker.rows[r]
        admitted_rows = {key[1]: row for key, row in outcome.rows.items()}
        worker.rows.update(admitted_rows)
        committed = self._commit(worker, previous, accepted, dropped)
        worker.window = self._schedule(worker, req, outcome, {**rows, **admitted_rows})
        if worker.fence is not None:
            worker.fence.service_end()
        host = mgr.table.host
        return wire.StepReply(
            epoch=self.epoch, step_id=req.step_id, scheduled=worker.window.scheduled(),
            refused=self._refused(req, outcome),
            table_updates=[*_row_changes(rows, touched_rows, blocks_before, mgr),
                           *(wire.TableUpdate(req_id=r, row=row, start=0, block_ids=[],
                                              num_blocks=0) for r, row in finished_rows.items()),
                           *_new_rows(admitted_rows, host)],
            slot_mapping=worker.window.slots.tolist(), committed=committed,
            free_blocks=mgr.free_blocks,
        )

    def _schedule(self, worker: Worker, req: wire.StepRequest, outcome: StepOutcome,
                  rows: dict[str, int]) -> Window:
        """This step's forward: the granted decodes, prefill chunks and admitted prompts."""
        mgr, wid = self.manager, worker.worker_id
        drafts = _drafts(req)
        decode = [g.req_id for g, ok in zip(req.grants, outcome.granted.tolist(), strict=True)
                  if ok]
        prefill = [p for p, ok in zip(req.prefill, outcome.prefill_granted.tolist(), strict=True)
                   if ok]
        admitted = [n for n, ok in zip(req.new, outcome.admitted.tolist(), strict=True) if ok]
        ids = [*decode, *(p.req_id for p in prefill), *(n.req_id for n in admitted)]
        n_decode, n_running = len(decode), len(decode) + len(prefill)
        decode_drafts = np.fromiter((drafts[r] for r in decode), dtype=np.int64, count=n_decode)
        num_tokens = np.fromiter(
            (*(p.num_tokens for p in prefill), *(n.first_chunk or n.prompt_len for n in admitted)),
            dtype=np.int64, count=len(ids) - n_decode)
        # Decode tokens start at the settled history; a prefill chunk already counts in it.
        starts = np.zeros(len(ids), dtype=np.int64)
        starts[:n_running] = mgr.histories([*((wid, r) for r in decode),
                                            *((wid, p.req_id) for p in prefill)])
        starts[n_decode:n_running] -= num_tokens[:n_running - n_decode]
        num_drafts = np.zeros(len(ids), dtype=np.int64)
        num_drafts[:n_decode] = decode_drafts
        return Window(
            req_ids=ids, decode=np.arange(len(ids)) < n_decode, rows=[rows[r] for r in ids],
            starts=starts, num_tokens=np.concatenate([1 + decode_drafts, num_tokens]),
            num_drafts=num_drafts, table=mgr.table, tokens_per_block=self._tpb,
        )

    def _commit(self, worker: Worker, window: Window | None, accepted: dict[str, int],
                dropped: set[str]) -> wire.CommitSummary:
        """Commit the previous step's staged tokens: exactly the accepted ones, into blocks their
        requests still own (see `Window.commit_slots`)."""
        if window is None or window.total_tokens == 0:
            return wire.CommitSummary(tokens=0, written=0)
        blocks_after = (self.manager.table.host[window.rows] >= 0).sum(axis=1)
        gone = window.mask(dropped)
        return self.committer.commit(worker.staging, window, window.accepted_counts(accepted),
                                     window.commit_slots(gone, blocks_after), gone)

    def _refused(self, req: wire.StepRequest, outcome: StepOutcome) -> list[wire.Refused]:
        new_reason = "batch_full" if self.manager.table.num_free_rows == 0 else "out_of_blocks"
        return [
            *(wire.Refused(req_id=g.req_id, kind="grant", reason="out_of_blocks")
              for g, ok in zip(req.grants, outcome.granted.tolist(), strict=True) if not ok),
            *(wire.Refused(req_id=p.req_id, kind="prefill", reason="out_of_blocks")
              for p, ok in zip(req.prefill, outcome.prefill_granted.tolist(), strict=True)
              if not ok),
            *(wire.Refused(req_id=n.req_id, kind="new", reason=new_reason)
              for n, ok in zip(req.new, outcome.admitted.tolist(), strict=True) if not ok),
        ]

    # ------------------------------------------------------------------ inspection

    def get_request(self, req: wire.RequestRef) -> wire.RequestState:
        with self.lock:
            self._check_open()
            self._worker(req.worker_id)
            key, mgr = (req.worker_id, req.req_id), self.manager
            try:
                row = mgr.row(key)
            except UnknownRequest:
                raise RequestNotFound(f"req_id: worker {req.worker_id!r} has no request "
                                      f"{req.req_id!r}") from None
            return wire.RequestState(
                worker_id=req.worker_id, req_id=req.req_id, row=row, capacity=mgr.capacity(key),
                history=mgr.history(key), pending_overlap_slack=mgr.pending_overlap_slack(key),
                pending_draft_len=mgr.pending_draft_len(key), num_blocks=mgr.num_blocks(key),
                block_ids=mgr.block_ids(key).tolist(),
            )

    def get_pool(self, req: wire.PoolQuery) -> wire.PoolState:
        with self.lock:
            self._check_open()
            mgr, now = self.manager, self.clock()
            if req.verify:
                self.check_invariants()
            totals = mgr.totals()
            return wire.PoolState(
                epoch=self.epoch, layout=self.layout, free_blocks=mgr.free_blocks,
                used_blocks=mgr.pool.num_blocks - mgr.free_blocks, num_requests=mgr.num_requests,
                workers=[wire.WorkerState(
                    worker_id=w.worker_id, num_requests=len(w.rows),
                    last_step_id=w.last_step_id,
                    lease_expires_in_s=max(0.0, w.last_seen + self.config.lease_ttl_s - now),
                ) for w in self._workers.values()],
                capacity_tokens=totals["capacity_tokens"], history_tokens=totals["history_tokens"],
                pending_slack_tokens=totals["pending_slack_tokens"],
                leases_expired=self.leases_expired,
                counters={k: int(v) for k, v in dataclasses.asdict(mgr.counters).items()},
                invariants="ok" if req.verify else "unchecked",
            )

    def check_invariants(self) -> None:
        """The manager's invariants plus the service's: workers own exactly the live requests,
        in the rows the manager gave them."""
        try:
            self.manager.check_invariants()
            mgr = self.manager
            owned = {(w.worker_id, r): row for w in self._workers.values()
                     for r, row in w.rows.items()}
            if owned != {key: mgr.row(key) for key in mgr.request_ids}:
                raise InvariantViolation("workers' requests differ from the manager's")
        except InvariantViolation:
            for obs in self._observers:
                obs.invariant_violation(1)
            raise


def _drafts(req: wire.StepRequest) -> dict[str, int]:
    """Drafts each grant runs with: its draft_len, or its padded_draft_len when padded (the
    manager refuses padding below the grant, so the padded value is the larger)."""
    drafts = {g.req_id: g.draft_len for g in req.grants}
    drafts.update((p.req_id, p.padded_draft_len) for p in req.padding if p.req_id in drafts)
    return drafts


def _plan(wid: str, req: wire.StepRequest) -> StepPlan:
    return StepPlan(
        reverts=[(wid, r) for r in req.reverts],
        result_ids=[(wid, r.req_id) for r in req.results],
        num_accepted=[r.num_accepted for r in req.results],
        finished=[(wid, r) for r in req.finished],
        grant_ids=[(wid, g.req_id) for g in req.grants],
        draft_lens=[g.draft_len for g in req.grants],
        padding_ids=[(wid, p.req_id) for p in req.padding],
        padded_draft_lens=[p.padded_draft_len for p in req.padding],
        prefill_ids=[(wid, p.req_id) for p in req.prefill],
        prefill_tokens=[p.num_tokens for p in req.prefill],
        new_ids=[(wid, n.req_id) for n in req.new],
        prompt_lens=[n.prompt_len for n in req.new],
        first_chunks=[n.first_chunk for n in req.new],
    )


def _row_changes(rows: dict[str, int], idx: np.ndarray, before: np.ndarray,
                 mgr: KVCacheManager) -> list[wire.TableUpdate]:
    """Updates for the rows of requests that stayed alive and whose block count changed (a
    row only grows or shrinks at its tail, so the counts locate every rewritten cell)."""
    if not rows:
        return []
    after = mgr.row_block_counts(idx)
    starts = np.minimum(before, after)
    host, names = mgr.table.host, list(rows)
    return [wire.TableUpdate(req_id=names[i], row=int(idx[i]), start=int(starts[i]),
                             block_ids=host[idx[i], starts[i]:after[i]].tolist(),
                             num_blocks=int(after[i]))
            for i in np.flatnonzero(before != after).tolist()]


def _new_rows(admitted: dict[str, int], host: np.ndarray) -> list[wire.TableUpdate]:
    out = []
    for req_id, row in admitted.items():
        ids = host[row][host[row] >= 0].tolist()
        out.append(wire.TableUpdate(req_id=req_id, row=row, start=0, block_ids=ids,
                                    num_blocks=len(ids)))
    return out


def _layout(config: ServiceConfig, staging_dtype: str) -> wire.PoolLayout:
    pool = config.pool
    return wire.PoolLayout(
        num_blocks=pool.total_blocks, tokens_per_block=pool.tokens_per_block,
        num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
        dtype=pool.dtype, staging_dtype=staging_dtype, device=str(pool.device),
        max_batch_size=pool.max_batch_size, max_blocks_per_seq=pool.max_blocks_per_seq,
        max_draft_len=pool.max_draft_len, max_step_tokens=config.max_step_tokens,
        overlap_scheduler=pool.overlap_scheduler,
        k_scales=list(pool.k_scales) if pool.k_scales else None,
        v_scales=list(pool.v_scales) if pool.v_scales else None,
    )
