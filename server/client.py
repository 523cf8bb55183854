"""`Client`: an inference worker's handle on ``kvalloc serve``, over IPC or REST, pool attached.

    from server.client import Client

    kv = Client("ipc:///run/user/1000/kvalloc/kvalloc.ipc", worker_id="rank0")
    kv.register()                                # maps the pool, block table and staging buffer
    reply = kv.step(new=(["r1"], [12]))          # admit a 12-token prompt
    handle = reply.admitted[0]                   # the request's name from now on
    # forward: write layer l's K/V of token i into kv.pool.staging[l, 0 / 1, i]
    reply = kv.step(grants=([handle], [3]))      # commit step 1, grant 1 + 3 tokens (MTP3)
    reply = kv.step(results=([handle], [2]), finished=[handle])   # 2 drafts accepted; done

Columns are sequences or int64 arrays; replies (`server.contract.columns.StepResult`) are int64
arrays. Both transports offer the same methods and raise the same errors, all in
`server.contract.errors`: `RemoteError` and its subclasses, carrying the service's status / code
/ field, `TransportTimeout` and `ServiceUnreachable`. The client numbers steps itself and retries
a call that timed out with the same step id, which the service answers without applying it
twice. On a CUDA pool ``step`` also orders the device work: it records ``forward_done`` on the
current stream before sending (so call it after launching the forward) and makes the current
stream wait for ``commit_done`` before returning.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import msgspec
import numpy as np
import torch
import zmq
from kvalloc.allocator import DeviceCopy, LayerGroup, PoolConfig, WriterFence
from kvalloc.allocator import slot_mapping as table_slot_mapping
from kvalloc.server.contract import wire
from kvalloc.server.contract.addresses import TOKEN_ENV, default_client_address, transport_of
from kvalloc.server.contract.columns import ColumnInput, StepCall, StepResult, TableChanges
from kvalloc.server.contract.errors import (
    AttachError,
    KVAllocServerError,
    MalformedBody,
    ServiceError,
    ServiceUnreachable,
    TransportTimeout,
    describe,
    remote_error,
)
from kvalloc.server.contract.operations import ERROR, OK, OPERATIONS, Operation
from kvalloc.server.contract.sharing import FenceGroup, StepFence, attach
from kvalloc.server.transport import stream
from kvalloc.server.transport.polling import Wait, poll_for
from kvalloc.server.transport.token_files import discover_token

# How long a call waits for a connection before the service counts as absent. The reply timeout
# is separate: a service may take longer to answer than to accept.
CONNECT_TIMEOUT_S = 2.0
# How long an IPC call polls for its reply before sleeping: a batch-256 step takes the service
# well under this, so a reply usually finds the caller awake.
REPLY_SPIN_S = 0.002


@dataclass
class AttachedPool:
    """The service's tensors mapped into this process; no copies.

    A tensor-parallel service's pool has ``shards``: one `AttachedPool` per shard, in shard
    order, each holding the KV heads ``heads`` of the model on its own device; the fields above
    them are shard 0's, and ``fence`` is every shard's (`FenceGroup`), for a worker that drives
    all shards from this process. A worker of one process per shard attaches its own alone
    (`attach_shard`).

    A grouped pool's has ``groups``: one `AttachedPool` per group, in group order, each with
    its own ``kv``, ``block_table``, ``staging`` and ``protected`` over its model ``layers``,
    and its ``window``; a group's ``fence`` and ``writer_fence`` are the pool's (the groups
    share one device), and the fields above are group 0's."""

    kv: torch.Tensor
    block_table: torch.Tensor
    staging: torch.Tensor
    fence: StepFence | FenceGroup | None
    protected: torch.Tensor | None = None  # cached prefix blocks (a prefix-caching service)
    heads: tuple[int, int] | None = None  # a shard's KV heads [start, stop); None: all of them
    shards: list[AttachedPool] = field(default_factory=list)
    # A grouped pool's groups (`wire.GroupAttachment`), in group order; the fields above are
    # group 0's, and so are ``layers`` and ``window`` here. A group's own entry has its model
    # ``layers`` (its layer i is the model's layers[i]) and ``window``; both None for a pool of
    # one group of every layer.
    groups: list[AttachedPool] = field(default_factory=list)
    layers: tuple[int, ...] | None = None
    window: int | None = None
    # What every write of this worker's own commit checks on the device (`WriterFence`).
    writer_fence: WriterFence | None = None

    @classmethod
    def attach(cls, attachment: wire.Attachment, session: int) -> AttachedPool:
        """The pool of the registration ``attachment`` came in, whose session is ``session``."""
        if attachment.groups:
            return cls._map_groups(attachment, session)
        if attachment.shards:
            shards = [cls.attach_shard(attachment, r, session)
                      for r in range(len(attachment.shards))]
            fences = [s.fence for s in shards if isinstance(s.fence, StepFence)]
            first = shards[0]
            return cls(first.kv, first.block_table, first.staging,
                       FenceGroup(fences) if fences else None, first.protected, shards=shards,
                       writer_fence=first.writer_fence)
        return cls._map(attachment, session)

    def with_own_table(self) -> tuple[AttachedPool, OwnTable]:
        """This pool read through a block table of the worker's own, and that table."""
        table = OwnTable.like(self.block_table)
        return replace(self, block_table=table.device.tensor), table

    @classmethod
    def _map_groups(cls, attachment: wire.Attachment, session: int) -> AttachedPool:
        """A grouped pool: group 0 is the attachment's own fields (mapped once), every other
        group's tensors (its protection too) are mapped beside it with the pool's fences."""
        pool = cls._map(attachment, session)
        pool.groups = [replace(
            pool if i == 0 else cls._map(described, session), fence=pool.fence,
            writer_fence=pool.writer_fence, layers=tuple(described.layers),
            window=described.window)
            for i, described in enumerate(attachment.groups)]
        pool.layers, pool.window = pool.groups[0].layers, pool.groups[0].window
        return pool

    @classmethod
    def attach_shard(cls, attachment: wire.Attachment, shard: int,
                     session: int) -> AttachedPool:
        """Shard ``shard`` of a tensor-parallel pool alone, with its own fences."""
        if not attachment.shards:
            raise AttachError("shard: the service has one pool, not tensor-parallel shards")
        if not 0 <= shard < len(attachment.shards):
            raise AttachError(f"shard: {shard} is not a shard of this pool "
                              f"({len(attachment.shards)} shards)")
        described = attachment.shards[shard]
        mapped = cls._map(described, session)
        mapped.heads = (described.head_start, described.head_stop)
        return mapped

    @classmethod
    def _map(cls, handles: wire.Attachment | wire.ShardAttachment | wire.GroupAttachment,
             session: int) -> AttachedPool:
        fence = None
        if handles.forward_done is not None and handles.commit_done is not None:
            fence = StepFence.open(handles.forward_done, handles.commit_done)
        kv = attach(handles.kv)
        # The block table, the protection and the fence word are the service's to write;
        # workers only read them.
        table = attach(handles.block_table, writable=False)
        staging = attach(handles.staging)
        protected = (attach(handles.protected, writable=False)
                     if handles.protected is not None else None)
        writer_fence = (WriterFence.of(attach(handles.writer_fence, writable=False), session)
                        if handles.writer_fence is not None else None)
        return cls(kv, table, staging, fence, protected, writer_fence=writer_fence)

    def slot_mapping(self, reply: StepResult, lead: torch.Tensor | None = None) -> torch.Tensor:
        """int64 slot of every token of ``reply``'s step, computed on the pool's device from the
        shared block table (-1 where a position lies past its row's blocks); ``lead`` as
        `step_slots` takes it."""
        return step_slots(self.block_table, self.kv.shape[3], reply, lead)


@dataclass
class OwnTable:
    """A worker's own copy of the block table (``Client.register(own_table=...)``): the host
    mirror each reply's `TableChanges` update, and the device copy the pool is read through,
    which only the changed cells travel to: at once (on CUDA one graph replay on the current
    stream, behind the forward still reading the table), or, once a launcher said it will
    carry them (`fold`), in that launcher's next step (`take`)."""

    host: np.ndarray
    device: DeviceCopy
    # Cells changed on the host since the last `take`, while folded: the launcher's to carry.
    _pending: list[np.ndarray] = field(default_factory=list, init=False, repr=False)
    _folded: bool = field(default=False, init=False)

    @classmethod
    def like(cls, shared: torch.Tensor) -> OwnTable:
        """A table of ``shared``'s shape on its device, empty (-1) as every row a new session
        will hold is."""
        host = np.full(tuple(shared.shape), -1, dtype=np.int32)
        tensor = torch.full(tuple(shared.shape), -1, dtype=torch.int32, device=shared.device)
        return cls(host, DeviceCopy(tensor, host.reshape(-1), upload_graphs=True))

    def apply(self, changes: TableChanges) -> None:
        """Bring the host mirror up to date with one reply's changes, and the device copy, or
        leave its part to the next `take` where folded."""
        cells = changes.apply(self.host)
        if not cells.size:
            return
        if self._folded:
            self._pending.append(cells)
        else:
            self.device.write(cells, self.host.reshape(-1))

    def fold(self) -> None:
        """From now on the changes wait for a launcher's `take`: it scatters them into the
        device copy inside its own step, ahead of everything that reads the table there, which
        spares each step one upload and its replay. It must `flush` when it stops launching."""
        self._folded = True

    def take(self, cells: np.ndarray, values: np.ndarray) -> None:
        """Write the pending changes into ``cells`` (flat indices, int64) and ``values`` (the
        host's, now; integers), two arrays of one length, padded with the first pair (cell 0
        and its value when none is pending: writing a cell's own value changes nothing); the
        caller scatters all of them into the device copy behind everything queued on the
        stream. More pending changes than they hold are uploaded now, the usual way, and only
        padding is taken."""
        changed = self._drain()
        if changed.size > cells.size:
            self.device.write(changed, self.host.reshape(-1))
            changed = changed[:0]
        cells[:changed.size] = changed
        cells[changed.size:] = changed[0] if changed.size else 0
        values[:] = self.host.reshape(-1)[cells]

    def flush(self) -> None:
        """Upload the pending changes now (on the current stream)."""
        changed = self._drain()
        if changed.size:
            self.device.write(changed, self.host.reshape(-1))

    def _drain(self) -> np.ndarray:
        changed = (np.concatenate(self._pending) if self._pending
                   else np.empty(0, dtype=np.int64))
        self._pending.clear()
        return changed


def step_slots(table: torch.Tensor, tokens_per_block: int, reply: StepResult,
               lead: torch.Tensor | None = None) -> torch.Tensor:
    """int64 slot of every token of ``reply``'s step in ``table`` (the shared block table, or
    the copy a worker that did not attach keeps from ``reply.tables``), on the table's device.

    ``lead``: an overlap worker's offset per scheduled request, on that device: the drafts that
    the request's unsettled step accepted, which its grant starts after (the reply's
    ``start_positions`` count only settled tokens); 0 where nothing is unsettled. The device
    knows the count before the service does, so the slots never wait for the host."""
    scheduled = reply.scheduled
    device = table.device
    request, positions = scheduled.positions()
    at = torch.from_numpy(positions).to(device)
    if lead is not None:
        at = at + lead.to(device=device, dtype=torch.int64)[torch.from_numpy(request).to(device)]
    rows = torch.from_numpy(scheduled.rows[request]).to(device)
    return table_slot_mapping(table, rows, at, tokens_per_block)


class Client:
    def __init__(self, address: str | None = None, *, worker_id: str | None = None,
                 token: str | None = None, timeout_s: float = 10.0, retries: int = 2,
                 reply_spin_s: float = REPLY_SPIN_S) -> None:
        """``reply_spin_s``: on the IPC carriers, how long a call polls for its reply without
        sleeping before it blocks (0: block at once). Polling keeps the calling thread awake
        through the service's step, so the reply costs no wake-up (tens of microseconds where
        waking an idle thread is slow); the thread holds a core meanwhile, and releases the GIL
        at every poll."""
        self.address = address or default_client_address()
        if token is None:  # KVALLOC_TOKEN, else the token a local service generated for us
            token = os.environ.get(TOKEN_ENV) or discover_token(self.address)
        carrier = transport_of(self.address)
        transport: Any
        if carrier == "rest":
            transport = _RestTransport(self.address, token, timeout_s)
        else:
            transport = {"ipc": _IpcTransport, "stream": _StreamTransport}[carrier](
                self.address, token, timeout_s, reply_spin_s)
        self._init(transport, worker_id, retries)

    @classmethod
    def in_process(cls, core: Any, *, worker_id: str | None = None) -> Client:
        """A client calling ``core`` (a `server.service.core.ServiceCore`) directly: the same
        methods and errors without a transport, for engines that embed the service, and for
        tests."""
        client = cls.__new__(cls)
        client.address = "in-process"
        client._init(_LocalTransport(core), worker_id, retries=0)
        return client

    def _init(self, transport: Any, worker_id: str | None, retries: int) -> None:
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._transport = transport
        self.retries = retries
        self.registration: wire.Registration | None = None
        self.overlap = False  # the registration's: steps at lag 2, the worker commits
        self.pool: AttachedPool | None = None
        # This worker's own copy of the block table, where it keeps one (`register`).
        self.own_table: OwnTable | None = None
        self.next_step_id = 0
        # Runs after the forward's fence is recorded and before the step is sent: where the
        # ranks of a tensor-parallel worker meet.
        self.before_step: Callable[[], None] | None = None

    # ------------------------------------------------------------------ operations

    def register(self, *, attach: bool = True, replace: bool = False,
                 overlap: bool = False, shard: int | None = None,
                 data_parallel_rank: int | None = None,
                 own_table: bool | None = None) -> wire.Registration:
        """Open a session and, unless ``attach`` is False (another host: replies then carry table
        deltas and slot mappings), map the pool, block table and staging buffer. ``replace``
        takes the worker id over from a live session (a restarted worker), freeing its requests.
        ``overlap``: steps run at lag 2 and the worker commits its own tokens (docs/protocol.md,
        "Overlap workers"). ``shard``: of a tensor-parallel pool, map that shard alone (a rank
        of a worker with one process per shard). ``data_parallel_rank``: the worker's rank, which
        a service allocating for another refuses. ``own_table`` (default: ``overlap``, attached):
        keep this worker's own device copy of the block table from every reply's table changes,
        and read the pool through it (``pool.block_table``), where the service grants it (one
        table on one CUDA device: ``registration.own_table``); then an overlap worker's calls
        cost the device nothing on the service's side."""
        if own_table is None:
            own_table = overlap and attach
        # A retry after a timeout resends the nonce: the service answers it with the session
        # the first attempt opened, instead of refusing the id that session now holds.
        reg = self.call("register", wire.RegisterRequest(worker_id=self.worker_id,
                                                         attached=attach, replace=replace,
                                                         overlap=overlap,
                                                         own_table=own_table and attach,
                                                         data_parallel_rank=data_parallel_rank,
                                                         nonce=secrets.randbits(63)))
        self.registration, self.next_step_id = reg, reg.next_step_id
        self.overlap = overlap
        try:
            self.pool = self._transport.attach(reg, shard) if attach else None
        except AttachError:  # nothing to work with: the session it opened ends with it
            with contextlib.suppress(KVAllocServerError):  # else its lease runs out
                self.deregister()
            self.registration = self.pool = None
            raise
        self.own_table = None
        if self.pool is not None and reg.own_table:
            self.pool, self.own_table = self.pool.with_own_table()
        return reg

    def step(self, *, results: tuple[ColumnInput, ColumnInput] | None = None,
             reverts: ColumnInput = (), finished: ColumnInput = (),
             grants: tuple[ColumnInput, ColumnInput] | None = None,
             padding: tuple[ColumnInput, ColumnInput] | None = None,
             prefill: tuple[ColumnInput, ColumnInput] | None = None,
             new: tuple[Sequence[str], ColumnInput] | tuple[Sequence[str], ColumnInput,
                                                            ColumnInput] | None = None,
             prompt_token_ids: ColumnInput = (),
             ) -> StepResult:
        """One scheduler step. ``results`` is (handles, accepted drafts), ``grants`` (handles,
        draft lengths), ``padding`` (handles, padded draft lengths), ``prefill`` (handles, chunk
        tokens), ``new`` (request ids, prompt lengths[, first chunks, 0 = whole prompt]);
        ``reverts`` and ``finished`` are handles. ``prompt_token_ids``: the new prompts' token
        ids, concatenated, to share cached prefixes (``reply.cached_tokens`` per new request)."""
        if self.registration is None:
            raise RuntimeError("register() first")
        columns: dict[str, ColumnInput] = {"revert_handles": reverts,
                                           "finished_handles": finished,
                                           "prompt_token_ids": prompt_token_ids}
        for pair, names in ((results, ("result_handles", "num_accepted")),
                            (grants, ("grant_handles", "draft_lens")),
                            (padding, ("padding_handles", "padded_draft_lens")),
                            (prefill, ("prefill_handles", "prefill_tokens"))):
            if pair is not None:
                columns.update(zip(names, pair, strict=True))
        new_ids: Sequence[str] = ()
        if new is not None:
            new_ids, columns["prompt_lens"], *chunks = new
            if chunks:
                columns["first_chunks"] = chunks[0]
        reg = self.registration
        try:
            call = StepCall.build(self.worker_id, reg.session, reg.epoch, self.next_step_id,
                                  new_req_ids=new_ids, **columns)
        except ServiceError as exc:  # the same error the service would answer
            raise remote_error(describe(exc)) from None
        return self.send_step(call)

    def send_step(self, call: StepCall) -> StepResult:
        """Send a prepared `StepCall` (its step id must be ``next_step_id``)."""
        fence = self.pool.fence if self.pool is not None else None
        if fence is not None:
            fence.worker_forward_done()
        if self.before_step is not None:
            self.before_step()
        reply = self.call("step", call)
        self.next_step_id = call.step_id + 1
        if self.own_table is not None:
            # On the current stream, behind the forward still reading the table.
            assert reply.tables is not None  # the service sends them to such a worker
            self.own_table.apply(reply.tables)
        if fence is not None:
            fence.worker_before_forward()
        return reply

    def get_request(self, req_id: str) -> wire.RequestState:
        """One of this session's requests (another session's are not readable)."""
        if self.registration is None:
            raise RuntimeError("register() first")
        return self.call("get_request", wire.RequestRef(
            worker_id=self.worker_id, session=self.registration.session, req_id=req_id))

    def get_pool(self, *, verify: bool = False) -> wire.PoolState:
        return self.call("get_pool", wire.PoolQuery(verify=verify))

    def deregister(self) -> wire.Deregistered:
        if self.registration is None:
            raise RuntimeError("register() first")
        out = self.call("deregister", wire.WorkerRef(worker_id=self.worker_id,
                                                     session=self.registration.session))
        self.registration = self.pool = self.own_table = None
        return out

    def call(self, op: str, request: Any) -> Any:
        """Send ``request`` (a `server.contract.wire` struct; a `StepCall` for the step) as
        operation ``op``; a timed-out attempt is retried unchanged."""
        operation = OPERATIONS[op]
        for attempt in range(self.retries + 1):
            try:
                return self._transport.call(operation, request)
            except TransportTimeout:
                if attempt == self.retries:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def in_process_client(pool: PoolConfig, *, max_step_tokens: int, worker_id: str | None = None,
                      groups: Sequence[LayerGroup] = ()) -> Iterator[Client]:
    """A client of a service core made in this process for ``pool`` (in ``groups``, when a
    model mixes layer kinds: `ServiceConfig.groups`), not yet registered; the core closes (its
    shared memory unlinked) when the block ends. What a worker that embeds the service uses
    instead of ``kvalloc serve``."""
    # Imported here: a client of a service in another process never loads the service.
    from kvalloc.server.service.core import ServiceCore
    from kvalloc.server.service.settings import ServiceConfig

    # The service lives and dies with this process, so a lease guards against nothing here but
    # would expire while the first steps compile their kernels (a cold Triton cache).
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=max_step_tokens,
                                     lease_ttl_s=3600.0, groups=list(groups)))
    try:
        yield Client.in_process(core, worker_id=worker_id)
    finally:
        core.close()


class _LocalTransport:
    """Calls the core directly with the core's own types (a `StepCall` for the step: no
    encoding at all); its errors become the `RemoteError` a transport would raise. Other
    requests pass msgspec's validation first, as they would on a wire."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def call(self, op: Operation, request: Any) -> Any:
        try:
            if not isinstance(request, StepCall):
                request = msgspec.convert(msgspec.structs.asdict(request), type(request))
            return getattr(self._core, op.name)(request)
        except Exception as exc:
            raise remote_error(describe(exc)) from exc

    def attach(self, reg: wire.Registration, shard: int | None = None) -> AttachedPool:
        """The core's own tensors: a process cannot open its own CUDA IPC handles, and in one
        process there is nothing to map."""
        share = self._core.shared_tensors(reg.worker_id)
        shards = [AttachedPool(kv, table, staging, fence, protected, heads,
                               writer_fence=WriterFence.of(word, reg.session))
                  for kv, table, staging, fence, word, protected, heads
                  in share.shards]
        if shard is not None:
            if not shards:
                raise AttachError("shard: the service has one pool, not tensor-parallel shards")
            if not 0 <= shard < len(shards):
                raise AttachError(f"shard: {shard} is not a shard of this pool "
                                  f"({len(shards)} shards)")
            return shards[shard]
        kv, table, staging, fence, word, protected = share.pool
        writer = WriterFence.of(word, reg.session)
        groups = [AttachedPool(kv, table, staging, fence, group_protected, layers=tuple(layers),
                               window=window, writer_fence=writer)
                  for kv, table, staging, layers, window, group_protected in share.groups]
        return AttachedPool(kv, table, staging, fence, protected, shards=shards, groups=groups,
                            layers=groups[0].layers if groups else None,
                            window=groups[0].window if groups else None, writer_fence=writer)

    def close(self) -> None:
        pass


class _Remote:
    """A transport to another process: the pool is mapped from the registration's handles."""

    def attach(self, reg: wire.Registration, shard: int | None = None) -> AttachedPool:
        if shard is not None:
            return AttachedPool.attach_shard(reg.attachment, shard, reg.session)
        return AttachedPool.attach(reg.attachment, reg.session)


class _KeptConnection:
    """One connection kept between calls: made on first use, dropped after a failure (whatever
    it still carries, a late reply included, goes with it) and made afresh on the next call."""

    _conn: Any = None

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        self._drop()


class _Frames(_Remote):
    """The IPC messages both carriers move: ``[seq, token, op, payload]`` out, ``[seq, status,
    payload]`` back, ``seq`` counting this client's messages."""

    def __init__(self, token: str | None) -> None:
        self._token = (token or "").encode()
        self._seq = 0

    def frames(self, op: Operation, request: Any) -> list[bytes]:
        self._seq += 1
        return [self._seq.to_bytes(8, "big"), self._token, op.name.encode(),
                wire.encode_msgpack(op.encode_call(request, binary=True))]

    def answer(self, op: Operation, status: stream.Frame, payload: stream.Frame) -> Any:
        if status == OK:
            return op.decode_reply(wire.decode(payload, op.reply_struct(binary=True)))
        assert status == ERROR
        raise remote_error(wire.decode(payload, wire.ErrorBody), token_sent=bool(self._token))


class _IpcTransport(_Frames):
    """A ZeroMQ DEALER socket carrying the frames."""

    def __init__(self, address: str, token: str | None, timeout_s: float,
                 reply_spin_s: float) -> None:
        super().__init__(token)
        self._address = address
        self._spin_s = reply_spin_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a peer that is not connected: a send then waits up to SNDTIMEO for a
        # connection and fails, instead of waiting out every reply timeout against nothing.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, int(CONNECT_TIMEOUT_S * 1000))
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise ServiceUnreachable(address, str(exc)) from None
        self._timeout_ms = int(timeout_s * 1000)

    def call(self, op: Operation, request: Any) -> Any:
        frames = self.frames(op, request)
        try:
            self._sock.send_multipart(frames)
        except zmq.Again:
            raise ServiceUnreachable(
                self._address, f"no connection within {CONNECT_TIMEOUT_S:g} s") from None
        while True:
            if not self._replied():
                raise TransportTimeout(f"{op.name}: no reply within {self._timeout_ms} ms")
            reply_seq, status, payload = self._sock.recv_multipart()
            if reply_seq == frames[0]:
                return self.answer(op, status, payload)
            # else: a late reply to an attempt that already timed out

    def _replied(self) -> bool:
        """Whether a reply arrived: polled for the spin, then waited for up to the timeout."""
        return (poll_for(lambda: bool(self._sock.poll(0)), self._spin_s)
                or bool(self._sock.poll(self._timeout_ms)))

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class _StreamTransport(_Frames, _KeptConnection):
    """The frames on one Unix stream socket (`server.transport.stream`): one wake-up per direction,
    none for the reply when it comes within the spin. A call that timed out leaves its connection
    (and any late reply on it) behind: the next call connects afresh."""

    def __init__(self, address: str, token: str | None, timeout_s: float,
                 reply_spin_s: float) -> None:
        super().__init__(token)
        self._address = address
        self._path = address.removeprefix("stream://")
        self._timeout_s = timeout_s
        self._reply_wait = Wait(spin_s=reply_spin_s)
        self._conn: stream.Inbox | None = None  # the kept connection, read through its inbox
        self._outbox: stream.Outbox | None = None  # and written through this one

    def call(self, op: Operation, request: Any) -> Any:
        frames = self.frames(op, request)
        reused = self._conn is not None
        inbox, outbox = self._connect()
        try:
            outbox.send(frames)
            while True:
                reply = inbox.next_message(wait=self._reply_wait)
                if reply is None:
                    raise ConnectionResetError("the service closed the connection")
                reply_seq, status, payload = reply
                if reply_seq == frames[0]:
                    return self.answer(op, status, payload)
        except (TimeoutError, BlockingIOError):  # the kernel's timeouts
            self._drop()
            raise TransportTimeout(f"{op.name}: no reply within {self._timeout_s:g} s") from None
        except (ConnectionError, MalformedBody) as exc:
            self._drop()
            if reused and isinstance(exc, BrokenPipeError | ConnectionResetError):
                return self.call(op, request)  # a connection the service dropped while idle
            raise ServiceUnreachable(self._address, str(exc) or type(exc).__name__) from None

    def _connect(self) -> tuple[stream.Inbox, stream.Outbox]:
        if self._conn is None or self._outbox is None:
            sock = _connected(self._address, self._path, self._timeout_s)
            stream.set_timeouts(sock, self._timeout_s)
            self._conn, self._outbox = stream.Inbox(sock), stream.Outbox(sock)
        return self._conn, self._outbox


class _RestTransport(_Remote, _KeptConnection):
    """HTTP/1.1 on one kept-alive connection, over TCP (``http://``) or a Unix socket
    (``unix:///path``). A request leaves in one write, its head built from bytes prepared once,
    and its response is read as the service writes every one (`_read_response`): a
    general-purpose HTTP client costs several times the service's own step per call."""

    def __init__(self, address: str, token: str | None, timeout_s: float) -> None:
        self._address = address
        self._timeout_s = timeout_s
        self._token_sent = bool(token)
        self._uds = address.removeprefix("unix://") if address.startswith("unix://") else None
        url = urlsplit("http://kvalloc" if self._uds else address)
        self._host, self._port = url.hostname or "localhost", url.port or 80
        # Every request's headers but its length.
        host = url.netloc if self._uds is None else "kvalloc"
        auth = f"authorization: Bearer {token}\r\n" if token else ""
        self._headers = f"host: {host}\r\n{auth}".encode()
        self._conn: socket.socket | None = None

    def call(self, op: Operation, request: Any) -> Any:
        request = op.encode_call(request, binary=False)
        path, body = op.path, b""
        if op.method == "POST":
            body = wire.encode_json(request)
        if op.method != "POST" or op.path_fields:
            fields = msgspec.structs.asdict(request)
            path = op.path.format(**{k: quote(str(fields.pop(k)), safe="")
                                     for k in op.path_fields})
            if op.method != "POST" and fields:
                path += "?" + urlencode({k: _query_value(v) for k, v in fields.items()})
        kind = b"content-type: application/json\r\n" if body else b""
        message = b"%s %s HTTP/1.1\r\n%s%scontent-length: %d\r\n\r\n%s" % (
            op.method.encode(), path.encode(), self._headers, kind, len(body), body)
        status, payload = self._exchange(op, message)
        if status == 200:
            return op.decode_reply(wire.decode(payload, op.reply, "json"))
        raise remote_error(wire.decode(payload, wire.ErrorBody, "json"),
                           token_sent=self._token_sent)

    def _exchange(self, op: Operation, message: bytes) -> tuple[int, bytes]:
        """One request and its response. A kept-alive connection the service closed while idle
        fails before any reply: that request is sent once more on a fresh connection."""
        reused = self._conn is not None
        sock = self._connect()
        try:
            try:
                sock.sendall(message)
            except (BrokenPipeError, ConnectionResetError):
                if reused:
                    raise
                # The service answers some calls before reading their body (a refused token, a
                # body over its limit) and closes: its answer is there to read.
            status, payload, closing = _read_response(sock)
            if closing:
                self._drop()
            return status, payload
        except TimeoutError:
            self._drop()
            raise TransportTimeout(f"{op.name}: no reply within {self._timeout_s:g} s") from None
        except (ConnectionError, http.client.HTTPException) as exc:
            self._drop()
            if reused and isinstance(exc, http.client.RemoteDisconnected | BrokenPipeError
                                     | ConnectionResetError):
                return self._exchange(op, message)
            raise ServiceUnreachable(self._address, str(exc) or type(exc).__name__) from None

    def _connect(self) -> socket.socket:
        if self._conn is None:
            self._conn = _connected(self._address, self._uds or (self._host, self._port),
                                    self._timeout_s)
        return self._conn


def _connected(address: str, target: str | tuple[str, int], timeout_s: float) -> socket.socket:
    """A socket connected to ``target``, a Unix socket's path or a TCP host and port, within
    `CONNECT_TIMEOUT_S`, its calls then bounded by ``timeout_s``; `ServiceUnreachable` naming
    ``address`` when nothing accepts."""
    timeout = min(timeout_s, CONNECT_TIMEOUT_S)
    try:
        if isinstance(target, tuple):
            sock = socket.create_connection(target, timeout=timeout)
            # A request leaves in one write, but a large one in several segments: without
            # NODELAY, Nagle holds its last one back until the service's delayed ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                _connect_unix(sock, target, time.monotonic() + timeout)
            except OSError:
                sock.close()
                raise
    except OSError as exc:  # refused, no such socket file, no answer in time
        raise ServiceUnreachable(address, str(exc) or type(exc).__name__) from None
    sock.settimeout(timeout_s)
    return sock


def _connect_unix(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect ``sock`` to the Unix socket at ``path`` by ``deadline``. A full listen backlog
    refuses at once (EAGAIN) instead of waiting as TCP does; the service drains it as it
    accepts (shedding connections that never send a message), so try again until the deadline."""
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def _read_response(sock: socket.socket) -> tuple[int, bytes, bool]:
    """The status, body and "connection: close" of the HTTP/1.1 response on ``sock``. The
    service declares every body's length (no chunked encoding); anything else raises an
    `http.client.HTTPException`."""
    data = bytearray()
    while (end := data.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise http.client.RemoteDisconnected("the service closed the connection")
        data += chunk
    status_line, *lines = bytes(data[:end]).split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    status = rest[:3]
    if not version.startswith(b"HTTP/1.") or not status.isdigit():
        raise http.client.BadStatusLine(status_line.decode("latin-1"))
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    length = headers.get(b"content-length", b"")
    if not length.isdigit():
        raise http.client.HTTPException("the response does not declare its length")
    size = int(length)
    body, missing = data[end + 4:end + 4 + size], size - (len(data) - end - 4)
    while missing > 0:
        chunk = sock.recv(missing)
        if not chunk:
            raise http.client.IncompleteRead(bytes(body), missing)
        body += chunk
        missing -= len(chunk)
    return int(status), bytes(body), headers.get(b"connection", b"").lower() == b"close"


def _query_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
