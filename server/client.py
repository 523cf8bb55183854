"""`Client`: an inference worker's handle on ``kvalloc serve``, over IPC or REST, pool attached.

    from server.client import Client

    kv = Client("ipc:///run/user/1000/kvalloc/kvalloc.ipc", worker_id="rank0")
    kv.register()                          # maps the pool, block table and staging buffer
    reply = kv.step(new={"r1": 12})        # admit a 12-token prompt; reply.slot_mapping[i] is
                                           # where token i of this step goes
    # forward: write layer l's K/V of token i into kv.pool.staging[l, 0 / 1, i]
    reply = kv.step(results={"r1": 0}, grants={"r1": 3})   # commit step 1, grant 1 + 3 tokens
    reply = kv.step(results={"r1": 2}, finished=["r1"])    # 2 drafts accepted; done

Both transports offer the same methods and raise the same errors (`RemoteError` and its
subclasses, carrying the service's status / code / field). The client numbers steps itself and
retries a call that timed out with the same step id, which the service answers without applying
it twice. On a CUDA pool ``step`` also orders the device work: it records ``forward_done`` on the
current stream before sending (so call it after launching the forward) and makes the current
stream wait for ``commit_done`` before returning.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import msgspec
import torch
import zmq

from . import wire
from .addresses import TOKEN_ENV, default_client_address, transport_of
from .operations import ERROR, OK, OPERATIONS, Operation
from .sharing import StepFence, attach
from .token_files import discover_token


class RemoteError(Exception):
    """The service refused a call; nothing changed there. ``field`` names the input at fault."""

    def __init__(self, body: wire.ErrorBody) -> None:
        super().__init__(f"{body.status} {body.code}: {body.message}")
        self.status, self.code, self.field, self.message = (body.status, body.code, body.field,
                                                            body.message)


class ServiceRestarted(RemoteError):
    """The service's epoch changed: every request is gone. Register again and re-admit."""


class NotRegistered(RemoteError):
    """The worker is unknown to the service (its lease expired): register again."""


class TransportTimeout(TimeoutError):
    """No reply within the timeout, after every retry."""


def _remote(body: wire.ErrorBody) -> RemoteError:
    cls = {"stale_epoch": ServiceRestarted, "unknown_worker": NotRegistered}.get(body.code,
                                                                                 RemoteError)
    return cls(body)


@dataclass
class AttachedPool:
    """The service's tensors mapped into this process; no copies."""

    kv: torch.Tensor
    block_table: torch.Tensor
    staging: torch.Tensor
    fence: StepFence | None

    @classmethod
    def attach(cls, attachment: wire.Attachment) -> AttachedPool:
        fence = None
        if attachment.forward_done is not None and attachment.commit_done is not None:
            fence = StepFence.open(attachment.forward_done, attachment.commit_done)
        # The block table is the service's to write; workers only read it.
        return cls(attach(attachment.kv), attach(attachment.block_table, writable=False),
                   attach(attachment.staging), fence)


class Client:
    def __init__(self, address: str | None = None, *, worker_id: str | None = None,
                 token: str | None = None, timeout_s: float = 10.0, retries: int = 2) -> None:
        self.address = address or default_client_address()
        if token is None:  # KVALLOC_TOKEN, else the token a local service generated for us
            token = os.environ.get(TOKEN_ENV) or discover_token(self.address)
        transport = (_IpcTransport(self.address, token, timeout_s)
                     if transport_of(self.address) == "ipc"
                     else _RestTransport(self.address, token, timeout_s))
        self._init(transport, worker_id, retries)

    @classmethod
    def in_process(cls, core: Any, *, worker_id: str | None = None) -> Client:
        """A client calling ``core`` (a `server.core.ServiceCore`) directly: the same methods and
        errors without a transport, for engines that embed the service, and for tests."""
        client = cls.__new__(cls)
        client.address = "in-process"
        client._init(_LocalTransport(core), worker_id, retries=0)
        return client

    def _init(self, transport: Any, worker_id: str | None, retries: int) -> None:
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._transport = transport
        self.retries = retries
        self.registration: wire.Registration | None = None
        self.pool: AttachedPool | None = None
        self.next_step_id = 0

    # ------------------------------------------------------------------ operations

    def register(self, *, attach: bool = True) -> wire.Registration:
        """Register (a re-registration frees this worker's requests) and, unless ``attach`` is
        False (another host), map the pool, block table and staging buffer."""
        reg = self.call("register", wire.RegisterRequest(worker_id=self.worker_id))
        self.registration, self.next_step_id = reg, reg.next_step_id
        self.pool = AttachedPool.attach(reg.attachment) if attach else None
        return reg

    def step(self, *, results: Mapping[str, int] | Sequence[Any] | None = None,
             reverts: Sequence[str] = (), finished: Sequence[str] = (),
             grants: Mapping[str, int] | Sequence[Any] | None = None,
             padding: Mapping[str, int] | Sequence[Any] | None = None,
             prefill: Mapping[str, int] | Sequence[Any] | None = None,
             new: Mapping[str, int] | Sequence[Any] | None = None) -> wire.StepReply:
        """One scheduler step. Mappings are ``req_id -> number`` (accepted drafts, draft length,
        padded draft length, prefill tokens, prompt length); sequences hold `server.wire`
        structs (e.g. ``wire.NewRequest`` with a ``first_chunk``)."""
        if self.registration is None:
            raise RuntimeError("register() first")
        req = wire.StepRequest(
            worker_id=self.worker_id, epoch=self.registration.epoch, step_id=self.next_step_id,
            results=_entries(results, wire.Result, "num_accepted"),
            reverts=list(reverts), finished=list(finished),
            grants=_entries(grants, wire.Grant, "draft_len"),
            padding=_entries(padding, wire.Padding, "padded_draft_len"),
            prefill=_entries(prefill, wire.PrefillChunk, "num_tokens"),
            new=_entries(new, wire.NewRequest, "prompt_len"),
        )
        fence = self.pool.fence if self.pool is not None else None
        if fence is not None:
            fence.worker_forward_done()
        reply = self.call("step", req)
        self.next_step_id = req.step_id + 1
        if fence is not None:
            fence.worker_before_forward()
        return reply

    def get_request(self, req_id: str) -> wire.RequestState:
        return self.call("get_request", wire.RequestRef(worker_id=self.worker_id, req_id=req_id))

    def get_pool(self, *, verify: bool = False) -> wire.PoolState:
        return self.call("get_pool", wire.PoolQuery(verify=verify))

    def deregister(self) -> wire.Deregistered:
        out = self.call("deregister", wire.WorkerRef(worker_id=self.worker_id))
        self.registration = self.pool = None
        return out

    def call(self, op: str, request: msgspec.Struct) -> Any:
        """Send ``request`` as operation ``op``; a timed-out attempt is retried unchanged."""
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


def _entries(value: Mapping[str, int] | Sequence[Any] | None, struct: type[msgspec.Struct],
             number: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [struct(req_id=k, **{number: v}) for k, v in value.items()]
    return list(value)


class _LocalTransport:
    """Calls the core directly; its errors become the `RemoteError` a transport would raise."""

    def __init__(self, core: Any) -> None:
        from .errors import describe  # the service's error table; only in-process clients

        self._core = core
        self._describe = describe

    def call(self, op: Operation, request: msgspec.Struct) -> Any:
        try:
            return getattr(self._core, op.name)(request)
        except Exception as exc:
            raise _remote(self._describe(exc)) from exc

    def close(self) -> None:
        pass


class _IpcTransport:
    """A DEALER socket: ``[seq, token, op, payload]`` out, ``[seq, status, payload]`` back."""

    def __init__(self, address: str, token: str | None, timeout_s: float) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._token = (token or "").encode()
        self._timeout_ms = int(timeout_s * 1000)
        self._seq = 0

    def call(self, op: Operation, request: msgspec.Struct) -> Any:
        self._seq += 1
        seq = self._seq.to_bytes(8, "big")
        self._sock.send_multipart([seq, self._token, op.name.encode(),
                                   wire.encode_msgpack(request)])
        while True:
            if not self._sock.poll(self._timeout_ms):
                raise TransportTimeout(f"{op.name}: no reply within {self._timeout_ms} ms")
            reply_seq, status, payload = self._sock.recv_multipart()
            if reply_seq != seq:
                continue  # a late reply to an attempt that already timed out
            if status == OK:
                return wire.decode(payload, op.reply)
            assert status == ERROR
            raise _remote(wire.decode(payload, wire.ErrorBody))

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class _RestTransport:
    """httpx over TCP (``http://``) or a Unix socket (``unix:///path``)."""

    def __init__(self, address: str, token: str | None, timeout_s: float) -> None:
        import httpx  # REST clients only: IPC workers never need it

        self._httpx = httpx
        base = address
        if address.startswith("unix://"):
            transport = httpx.HTTPTransport(uds=address.removeprefix("unix://"))
            base = "http://kvalloc"
        else:
            # Headers and body leave in two writes: without NODELAY, Nagle holds the body back
            # until the server's delayed ACK (~40 ms per call).
            transport = httpx.HTTPTransport(
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base, transport=transport, timeout=timeout_s,
                                  headers=headers)

    def call(self, op: Operation, request: msgspec.Struct) -> Any:
        fields = msgspec.structs.asdict(request)
        path = op.path.format(**{k: quote(str(fields.pop(k)), safe="") for k in op.path_fields})
        try:
            if op.method == "POST":
                resp = self._http.post(path, content=wire.encode_json(request),
                                       headers={"content-type": "application/json"})
            else:
                resp = self._http.request(op.method, path, params=fields)
        except self._httpx.TimeoutException as exc:
            raise TransportTimeout(f"{op.name}: {exc}") from None
        if resp.status_code == 200:
            return wire.decode(resp.content, op.reply, "json")
        raise _remote(wire.decode(resp.content, wire.ErrorBody, "json"))

    def close(self) -> None:
        self._http.close()
