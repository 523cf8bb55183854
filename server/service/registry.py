"""`WorkerRegistry`: who is registered, under which session, and which requests each one owns.

A worker registers once per process and gets a *session*, a random number it sends with every
call: a call with an ended session is refused (`StaleSession`), so a worker whose lease expired,
or whose id was taken over by its replacement, can never act in the new session. An id held by a
live session is only taken over on request (``replace``), never silently.

Requests are named by a string id once, at admission, and by an integer *handle* afterwards:
``handle = generation << ROW_BITS | row``, where ``row`` is the request's block-table row and
``generation`` counts the admissions into that row. ``handles[row]`` is the handle of the row's
latest admission, so a handle is live when its row is owned by the caller's session and holds
exactly that handle (`live_rows`, one compiled pass over a step's handles): the handle of a
freed request is refused even after its row was given to another request. Both arrays end with
a sentinel row that is never owned: a handle naming a row past the table lands there and is
refused like any other.

Invariants (`check_invariants`):
- a row is owned (``owner[row]`` = a live session) exactly when the manager holds a request in
  it, and that session's worker lists the request's id for that row; the sentinel never is;
- ``handles[row]`` names ``row``, and handles are never reused: a row's generation only grows.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from kvalloc.allocator import InvariantViolation, WriterFence
from kvalloc.allocator.common.jit import jit, numba, views
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import NO_VALUES, StepCall, StepResult
from kvalloc.server.contract.errors import (
    DuplicateRequestId,
    RequestNotFound,
    StaleSession,
    TooManyWorkers,
    UnknownHandle,
    UnknownWorker,
    WorkerIdInUse,
)
from kvalloc.server.contract.sharing import FenceGroup, StepFence
from kvalloc.server.service.batch import ScheduledBatch
from kvalloc.server.service.inflight import InFlight
from kvalloc.server.service.settings import MAX_ROWS

log = logging.getLogger("kvalloc.service")

ROW_BITS = MAX_ROWS.bit_length() - 1
NO_OWNER = -1
# Deregistrations answered again (`ended`): the latest per worker id, the oldest id forgotten
# past this many. A retry comes within a client's few reply timeouts of its first attempt.
ENDED_KEPT = 256


@dataclass
class Worker:
    worker_id: str
    session: int
    attached: bool
    stagings: list[torch.Tensor]  # one per shard, in shard order (`server.service.shards`)
    # Its session's fence word on every shard (`SharedPool.end_writes` closes them), and the
    # slot they hold in the shards' tables of words.
    writers: list[WriterFence]
    fence_slot: int
    attachment: wire.Attachment
    fence: StepFence | FenceGroup | None
    last_seen: float  # the clock at its last call; only grows (the clock is monotonic)
    # Its steps run at lag 2 (`server.service.inflight`) and it commits its own tokens.
    overlap: bool = False
    # It keeps its own device copy of the block table from its replies' table changes: the
    # service uploads none of its rows (`BlockTable.left_to_worker`).
    own_table: bool = False
    cache_salt: bytes = b""  # its prompts' prefix-cache namespace (`server.contract.routing`)
    # The request that opened the session and its answer, to answer a retry of it again.
    registered: tuple[wire.RegisterRequest, wire.Registration] | None = None
    req_ids: dict[str, int] = field(default_factory=dict)  # live request id -> row
    last_step_id: int | None = None
    last_call: StepCall | None = None
    last_result: StepResult | None = None
    batch: ScheduledBatch | None = None  # its last step's forward; the next call commits it
    flights: InFlight = field(default_factory=InFlight)  # an overlap worker's last two steps


class WorkerRegistry:
    def __init__(self, num_rows: int, max_workers: int) -> None:
        self.max_workers = max_workers
        self._workers: dict[str, Worker] = {}
        self._earliest_seen = math.inf  # no live worker was last seen before this (see expired)
        self.owner = np.full(num_rows + 1, NO_OWNER, dtype=np.int64)  # session owning each row
        self.handles = np.arange(num_rows + 1, dtype=np.int64)  # generation 0: never handed out
        self._row_req_id: list[str | None] = [None] * num_rows
        self._ended: dict[str, tuple[int, wire.Deregistered]] = {}  # id -> (session, reply)

    # ------------------------------------------------------------------ sessions

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def retried(self, req: wire.RegisterRequest) -> wire.Registration | None:
        """The registration ``req`` already opened, if it is a retry: it carries a nonce, and
        the id's live session was opened by this very request and has not stepped since."""
        current = self._workers.get(req.worker_id)
        if (req.nonce is None or current is None or current.registered is None
                or current.last_step_id is not None):
            return None
        request, registration = current.registered
        return registration if request == req else None

    def ended(self, req: wire.WorkerRef) -> wire.Deregistered | None:
        """The reply of the deregistration that ended ``req``'s session, if one did lately: a
        client retries a call whose reply was lost, and the retry must get that reply, not
        `UnknownWorker` (the session is a secret of the worker, so nobody else names it)."""
        kept = self._ended.get(req.worker_id)
        return kept[1] if kept is not None and kept[0] == req.session else None

    def remember_ended(self, req: wire.WorkerRef, reply: wire.Deregistered) -> None:
        self._ended.pop(req.worker_id, None)  # to the newest end
        self._ended[req.worker_id] = (req.session, reply)
        if len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]

    def check_capacity(self, worker_id: str, replace: bool) -> Worker | None:
        """The worker ``register`` would replace (None: a new id); raises if it may not."""
        current = self._workers.get(worker_id)
        if current is not None and not replace:
            raise WorkerIdInUse(f"worker_id: {worker_id!r} is registered by a live session; "
                                f"deregister it, wait for its lease to expire, or register "
                                f"with replace=true")
        if current is None and len(self._workers) >= self.max_workers:
            raise TooManyWorkers(f"worker_id: {self.max_workers} workers are registered "
                                 f"(max_workers); deregister one first")
        return current

    def add(self, make: Callable[[int], Worker]) -> Worker:
        """Register the worker ``make(session)`` builds, under a fresh session."""
        session = secrets.randbits(52)  # exact in every JSON reader, doubles included
        worker = make(session)
        self._workers[worker.worker_id] = worker
        self._earliest_seen = min(self._earliest_seen, worker.last_seen)
        return worker

    def extend_leases(self, by_s: float) -> None:
        """Every live worker counts as seen ``by_s`` later: time the service itself did not run
        is no worker's silence."""
        for worker in self._workers.values():
            worker.last_seen += by_s
        self._earliest_seen += by_s

    def remove(self, worker: Worker) -> np.ndarray:
        """Forget ``worker``; returns the rows of its requests (the caller frees them)."""
        del self._workers[worker.worker_id]
        rows = np.fromiter(worker.req_ids.values(), dtype=np.int64, count=len(worker.req_ids))
        self.release(worker, rows)
        return rows

    def worker(self, worker_id: str, session: int | None) -> Worker:
        """The live worker of ``session`` (None: any session, for inspection)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            raise UnknownWorker(f"worker_id: {worker_id!r} is not registered (never, or its "
                                f"lease expired); register again")
        if session is not None and session != worker.session:
            raise StaleSession(f"session: {session} has ended (worker {worker_id!r} registered "
                               f"again since); register again")
        return worker

    def expired(self, now: float, ttl: float) -> list[Worker]:
        """Workers silent for more than ``ttl``. Every call checks this, so the common answer
        costs one comparison: no worker was seen before ``_earliest_seen`` (a lower bound, as a
        worker's ``last_seen`` only grows), and only a lease that may have run out starts a scan.
        """
        if now - self._earliest_seen <= ttl:
            return []
        expired = [w for w in self._workers.values() if now - w.last_seen > ttl]
        self._earliest_seen = min((w.last_seen for w in self._workers.values()
                                   if now - w.last_seen <= ttl), default=math.inf)
        return expired

    # ------------------------------------------------------------------ handles

    def rows_of_handles(self, worker: Worker, names: tuple[str, ...],
                        lists: tuple[np.ndarray, ...]) -> list[np.ndarray]:
        """Rows of every list of handles, in order, checked in one pass; `UnknownHandle` naming
        the first that is not a live request of ``worker`` (``<name>[<index>]``, ``names`` one
        per list)."""
        rows, bad, i = live_rows(lists, self.handles, self.owner, worker.session)
        if bad >= 0:
            raise UnknownHandle(f"{names[bad]}[{i}]: handle {int(lists[bad][i])} names no live "
                                f"request of worker {worker.worker_id!r}",
                                field=f"{names[bad]}[{i}]")
        return views(rows, [part.size for part in lists[:-1]])

    def check_new(self, worker: Worker, req_ids: tuple[str, ...]) -> None:
        """New ids must be unique in the call and among the worker's live requests."""
        if not req_ids:
            return
        known = worker.req_ids
        if len(set(req_ids)) != len(req_ids) or not known.keys().isdisjoint(req_ids):
            seen: set[str] = set()
            for i, req_id in enumerate(req_ids):
                if req_id in known or req_id in seen:
                    raise DuplicateRequestId(f"new.req_ids[{i}]: worker {worker.worker_id!r} "
                                             f"already has a request {req_id!r}",
                                             field=f"new.req_ids[{i}]")
                seen.add(req_id)

    def admit(self, worker: Worker, req_ids: tuple[str, ...], rows: np.ndarray) -> np.ndarray:
        """Give the admitted requests (``rows`` >= 0) to ``worker``; returns their handles
        (-1 where a request was refused)."""
        if rows.size == 0:
            return NO_VALUES
        handles = take_rows(rows, self.handles, self.owner, worker.session)
        for req_id, row in zip(req_ids, rows.tolist(), strict=True):
            if row >= 0:
                worker.req_ids[req_id] = row
                self._row_req_id[row] = req_id
        return handles

    def release(self, worker: Worker, rows: np.ndarray) -> None:
        """The requests in ``rows`` are gone (finished, or their worker left)."""
        if rows.size == 0:  # most steps finish nothing
            return
        self.owner[rows] = NO_OWNER
        for row in rows.tolist():
            req_id = self._row_req_id[row]
            self._row_req_id[row] = None
            worker.req_ids.pop(req_id, None)  # type: ignore[arg-type]

    def handle(self, row: int) -> int:
        return int(self.handles[row])

    def row_of(self, worker: Worker, req_id: str) -> int:
        try:
            return worker.req_ids[req_id]
        except KeyError:
            raise RequestNotFound(f"req_id: worker {worker.worker_id!r} has no request "
                                  f"{req_id!r}") from None

    def check_invariants(self, live_rows: np.ndarray) -> None:
        """Rows owned here are exactly the manager's ``live_rows``, each listed by its worker."""
        owned = np.flatnonzero(self.owner != NO_OWNER)
        if not np.array_equal(np.sort(live_rows), owned):
            raise InvariantViolation("rows owned by workers differ from the manager's requests")
        rows = self.handles[:-1]  # (the sentinel's is never handed out)
        if not np.array_equal(rows & (MAX_ROWS - 1), np.arange(rows.size)):
            raise InvariantViolation("a row's handle names another row")
        sessions = {w.session: w for w in self._workers.values()}
        listed = 0
        for row in owned.tolist():
            worker = sessions.get(int(self.owner[row]))
            req_id = self._row_req_id[row]
            if worker is None or req_id is None or worker.req_ids.get(req_id) != row:
                raise InvariantViolation(f"row {row} is owned by no live worker's request")
        for worker in self._workers.values():
            listed += len(worker.req_ids)
        if listed != owned.size:
            raise InvariantViolation("a worker lists a request the registry does not own")


def live_rows_reference(lists: tuple[np.ndarray, ...], row_handles: np.ndarray,
                        owner: np.ndarray, session: int) -> tuple[np.ndarray, int, int]:
    """The row each handle of ``lists`` names (every list's, one after another), and the first
    handle that is not a live request of ``session``, as its list and its index there (-1, -1:
    every one is; the rows are then unspecified). ``row_handles`` and ``owner`` are the
    registry's arrays, their last entry the sentinel row."""
    handles = np.concatenate(lists)
    rows = np.minimum(handles & (MAX_ROWS - 1), owner.size - 1)
    live = (row_handles[rows] == handles) & (owner[rows] == session)
    start = 0
    for where, part in enumerate(lists):
        dead = np.flatnonzero(~live[start:start + part.size])
        if dead.size:
            return rows, where, int(dead[0])
        start += part.size
    return rows, -1, -1


def _live_rows_loop(lists, row_handles, owner,  # type: ignore[no-untyped-def]
                    session):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes. The lists come as a tuple
    # of one array type and are read where they lie (no joined copy).
    total = 0
    for where in range(len(lists)):
        total += lists[where].size
    rows = np.empty(total, np.int64)
    sentinel = owner.size - 1
    e = 0
    for where in range(len(lists)):
        handles = lists[where]
        for i in range(handles.size):
            row = min(handles[i] & (MAX_ROWS - 1), sentinel)
            if row_handles[row] != handles[i] or owner[row] != session:
                return rows, where, i
            rows[e] = row
            e += 1
    return rows, -1, -1


live_rows = jit(_live_rows_loop) if numba is not None else live_rows_reference


def take_rows_reference(rows: np.ndarray, row_handles: np.ndarray, owner: np.ndarray,
                        session: int) -> np.ndarray:
    """``session`` takes the free ``rows`` that are >= 0: each gets a new handle (its generation
    one higher), returned per entry (-1 where the row is -1). Updates the registry's
    ``row_handles`` and ``owner`` in place."""
    taken = rows[rows >= 0]
    owner[taken] = session
    row_handles[taken] += 1 << ROW_BITS
    return np.where(rows >= 0, row_handles[rows], -1)


def _take_rows_loop(rows, row_handles, owner,  # type: ignore[no-untyped-def]
                    session):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    handles = np.full(rows.size, -1, np.int64)
    for i in range(rows.size):
        row = rows[i]
        if row >= 0:
            owner[row] = session
            row_handles[row] += 1 << ROW_BITS
            handles[i] = row_handles[row]
    return handles


take_rows = jit(_take_rows_loop) if numba is not None else take_rows_reference
