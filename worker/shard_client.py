"""`ShardClient`: one rank of a tensor-parallel worker, as the engine sees its client.

A tensor-parallel worker is N processes of one process group, rank r driving shard r of a
tensor-parallel service's pool (`kvalloc serve --devices ... --tensor-parallel N`): rank r holds
KV heads `shard_kv_heads(num_kv_heads, r, N)` of its model shard (`worker.parallel.sharding`),
and the service's shard r holds the same heads. Every rank runs the engine's whole host loop:
the same prompts and the same replies give every rank the same plan, and the model's all-reduces
give every rank the same tokens. So only the scheduling rank (rank 0) calls the service; the
others get each reply from it over the group.

Per step, on every rank: the forward's fence is recorded on the rank's own device (CUDA), the
group meets (the service waits on the last record it finds, so no rank may record late), rank 0
sends the step, and its reply (or its error) goes to every rank as the bytes the stream socket
carries it in; then each rank's next forward waits on its own shard's commit. A refused step is
raised on every rank as the same `RemoteError`. Rank 0 alone decides to stop (its ``stop``, a
Ctrl-C, say): instead of a step it hands out a stop, and every rank raises `RunStopped` at that
same step boundary, where each can deregister in turn.

"Rank" here is a process's rank in the worker's process group (torch.distributed's word), each
driving one shard; the service's data-parallel ranks are another thing (`server.service.ranks`).

Invariant: every rank's engine sees the same registration and the same sequence of replies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from kvalloc.server.client import AttachedPool, Client, OwnTable
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepResult
from kvalloc.server.contract.errors import describe, remote_error
from kvalloc.worker.errors import EngineError, RunStopped
from kvalloc.worker.parallel.split import shard_kv_heads
from torch.distributed import ProcessGroup

_REPLY, _ERROR, _STOP = 0, 1, 2  # the first byte of what rank 0 hands out


class ShardClient:
    """Rank ``rank`` of ``world``; rank 0 passes the `Client` that calls the service, and may
    pass ``stop``, read before each step."""

    def __init__(self, rank: int, world: int, client: Client | None = None, *,
                 stop: Callable[[], bool] | None = None) -> None:
        """Every rank of the process group constructs one, at the same point."""
        if (rank == 0) != (client is not None):
            raise EngineError("client: rank 0, and only rank 0, calls the service")
        if stop is not None and rank != 0:
            raise EngineError("stop: only rank 0 decides where the ranks stop")
        self.rank, self.world = rank, world
        self._client, self._stop = client, stop
        # The replies are host bytes: under NCCL (GPU tensors only) they need a gloo group.
        self.group: ProcessGroup | None = (dist.new_group(backend="gloo")
                                           if dist.get_backend() == "nccl" else None)
        self._source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.registration: wire.Registration | None = None
        self.pool: AttachedPool | None = None
        self.own_table: OwnTable | None = None  # each rank reads its shard's table
        self.overlap = False
        self._met = False  # whether this step's ranks met yet

    def register(self, *, overlap: bool = False, data_parallel_rank: int | None = None,
                 replace: bool = False) -> wire.Registration:
        """Rank 0 registers and maps shard 0; every other rank gets that registration and maps
        its own shard. ``data_parallel_rank``: the group's rank in a service of several;
        ``replace``: end a live session of the same worker id first.
        `EngineError` on every rank, with rank 0's reason, if the service's shards are not this
        group's (rank 0 then ends the session it opened)."""
        data = None
        if self._client is not None:
            try:
                self._client.register(overlap=overlap, shard=0, replace=replace,
                                      data_parallel_rank=data_parallel_rank)
                self._check_shards(self._client.registration)
            except Exception as exc:
                if self._client.registration is not None:
                    self._client.deregister()
                reason = f"tensor_parallel: a worker of {self.world} ranks: {exc}"
                self._share(bytes([_ERROR]) + reason.encode())
                raise EngineError(reason) from exc
            self._client.before_step = self._meet
            data = bytes([_REPLY]) + wire.encode_msgpack(self._client.registration)
        shared = self._share(data)
        if shared[0] == _ERROR:
            raise EngineError(shared[1:].decode())
        reg = wire.decode(shared[1:], wire.Registration)
        self._check_shards(reg)
        self.registration, self.overlap = reg, overlap
        self.pool = (self._client.pool if self._client is not None
                     else AttachedPool.attach_shard(reg.attachment, self.rank, reg.session))
        return reg

    def _check_shards(self, reg: wire.Registration | None) -> None:
        assert reg is not None
        shards = reg.attachment.shards
        want = shard_kv_heads(reg.layout.num_kv_heads, self.rank, self.world)
        if len(shards) != self.world or (shards[self.rank].head_start,
                                         shards[self.rank].head_stop) != want:
            raise EngineError(f"the service has {len(shards)} shards (rank {self.rank} holds "
                              f"KV heads {want[0]}..{want[1]})")

    def step(self, **columns: Any) -> StepResult:
        """`Client.step` on rank 0; the same reply on every rank (`RunStopped` on every rank
        instead, where rank 0's ``stop`` reads true)."""
        data, self._met = None, False
        if self._stop is not None and self._stop():
            self._meet()
            self._share(bytes([_STOP]))
            raise RunStopped("stopped by rank 0 before this step")
        if self._client is not None:
            try:
                data = bytes([_REPLY]) + wire.encode_msgpack(
                    self._client.step(**columns).to_wire(binary=True))
            except Exception as exc:
                if not self._met:  # refused before it was sent: the others wait to meet
                    self._meet()
                self._share(bytes([_ERROR]) + wire.encode_msgpack(describe(exc)))
                raise
        else:
            fence = self.pool.fence if self.pool is not None else None
            if fence is not None:
                fence.worker_forward_done()
            self._meet()
        return self._reply(self._share(data))

    def _reply(self, data: bytes) -> StepResult:
        if data[0] == _STOP:
            raise RunStopped("stopped by rank 0 before this step")
        if data[0] == _ERROR:
            raise remote_error(wire.decode(data[1:], wire.ErrorBody))
        reply = StepResult.from_wire(wire.decode(data[1:], wire.StepReplyBinary))
        fence = self.pool.fence if self.pool is not None and self._client is None else None
        if fence is not None:  # rank 0's client waited on its own
            fence.worker_before_forward()
        return reply

    def deregister(self) -> None:
        if self._client is not None:
            self._client.deregister()
        dist.barrier(group=self.group)
        self.registration = self.pool = None

    def _meet(self) -> None:
        dist.barrier(group=self.group)
        self._met = True

    def _share(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (a broadcast of its length, then of its bytes)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=self._source, group=self.group)
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None
                  else torch.empty(int(size), dtype=torch.uint8))
        dist.broadcast(buffer, src=self._source, group=self.group)
        return buffer.numpy().tobytes()
