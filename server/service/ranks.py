"""`RankedService`: data-parallel ranks in one service, each rank an allocator of its own.

With data-parallel attention every rank is an engine of its own: its own requests, its own block
table rows, its own pool on its own devices (one shard per device of its tensor-parallel group),
its own prefix cache. ``kvalloc serve --devices D0,...,D(R*T-1) --tensor-parallel T`` makes R
ranks: rank k's devices are ``D(k*T) .. D(k*T+T-1)``, and rank k is a `ServiceCore` over them,
sharing nothing with the others. What they share is the service: one set of endpoints, one
admission (a worker id is live on one rank at a time; ``max_workers`` is per rank) and one view:
``get_pool`` sums the ranks, metrics carry a ``data_parallel_rank`` label, and each rank
publishes its KV events, tagged with its rank as vLLM's are, on its own endpoints (a TCP port
offset by the rank, as vLLM offsets them, or ``-dp<k>`` after a path).

A worker registers with its ``data_parallel_rank``; every later call of that worker id goes to
that rank, which checks sessions, epochs (each rank has its own) and step ids as any core does.

Invariants:
- a worker id is registered on at most one rank (``register`` holds ``self.lock`` across the
  check and the rank's registration);
- every rank's configuration is checked before any rank is made: a refusal leaves nothing.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import ShardingInvalid, UnknownRank, WorkerIdInUse
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.service.shards import check_devices, shard_specs

_TCP_PORT = re.compile(r"^(tcp://.*:)(\d+)$")


def rank_configs(config: ServiceConfig) -> list[ServiceConfig]:
    """One configuration per data-parallel rank of ``config``, each checked (`shard_specs`);
    `ShardingInvalid` before anything is made."""
    devices, tp = config.devices or [config.pool.device], config.tensor_parallel
    check_devices(devices)
    if len(devices) % tp:
        raise ShardingInvalid(f"devices: {len(devices)} devices are not a multiple of the "
                              f"tensor-parallel degree (--devices {','.join(devices)} "
                              f"--tensor-parallel {tp})")
    ranks = len(devices) // tp
    if ranks == 1:
        shard_specs(config)
        _check_event_endpoints_apart([config])
        return [config]
    if config.data_parallel_rank is not None:
        raise ShardingInvalid(f"data_parallel_rank: names the one rank of a service; these "
                              f"devices make {ranks} ranks, numbered 0..{ranks - 1}")
    configs = [config.model_copy(update={
        "devices": devices[k * tp:(k + 1) * tp], "data_parallel_rank": k,
        "pool": config.pool.model_copy(update={"device": devices[k * tp]}),
        "kv_events": offset_endpoint(config.kv_events, k),
        "kv_events_replay": offset_endpoint(config.kv_events_replay, k)}) for k in range(ranks)]
    for rank_config in configs:
        shard_specs(rank_config)
    _check_event_endpoints_apart(configs)
    return configs


def _check_event_endpoints_apart(configs: list[ServiceConfig]) -> None:
    """Each rank's event and replay endpoints are distinct from every other's: adjacent ports
    for events and replay collide once ranks offset them."""
    seen: dict[str, str] = {}
    for config in configs:
        for name, endpoint in [("kv_events", config.kv_events),
                               ("kv_events_replay", config.kv_events_replay)]:
            if endpoint is None or endpoint.endswith(":*"):
                continue
            who = f"rank {config.data_parallel_rank or 0}'s {name}"
            if endpoint in seen:
                raise ShardingInvalid(
                    f"{name}: {who} and {seen[endpoint]} are both {endpoint}; each rank adds "
                    f"its rank to a TCP port, so keep the event and replay ports at least "
                    f"{len(configs)} apart")
            seen[endpoint] = who


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Rank ``rank``'s copy of a ZeroMQ endpoint: a TCP port plus the rank (any free port stays
    any), else the address with ``-dp<rank>`` after it; rank 0 keeps the endpoint."""
    if endpoint is None or rank == 0 or endpoint.endswith(":*"):
        return endpoint
    tcp = _TCP_PORT.match(endpoint)
    if tcp is not None:
        return f"{tcp.group(1)}{int(tcp.group(2)) + rank}"
    return f"{endpoint}-dp{rank}"


class RankedService:
    """The ranks of ``config`` behind the methods of one `ServiceCore`, for the transports."""

    def __init__(self, config: ServiceConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        configs = rank_configs(config)
        self.config = config.model_copy(update={"max_workers": config.max_workers * len(configs)})
        self.ranks: list[ServiceCore] = []
        try:
            for rank_config in configs:
                self.ranks.append(ServiceCore(rank_config, clock=clock))
        except BaseException:
            self.close()
            raise
        self.lock = threading.Lock()
        self._rank_of: dict[str, int] = {}

    @property
    def epoch(self) -> int:
        return self.ranks[0].epoch

    @property
    def ready(self) -> bool:
        return all(rank.ready for rank in self.ranks)

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()

    def _of(self, worker_id: str) -> ServiceCore:
        """The rank ``worker_id`` registered with (rank 0, which refuses it, if none)."""
        return self.ranks[self._rank_of.get(worker_id, 0)]

    def register(self, req: wire.RegisterRequest) -> wire.Registration:
        rank = req.data_parallel_rank
        if rank is None or not 0 <= rank < len(self.ranks):
            raise UnknownRank(f"data_parallel_rank: {rank} is not a rank of this service "
                              f"(ranks 0..{len(self.ranks) - 1}); register with yours")
        with self.lock:
            held = self._rank_of.get(req.worker_id)
            if held is not None and held != rank and self.ranks[held].holds(req.worker_id):
                if not req.replace:
                    raise WorkerIdInUse(f"worker_id: {req.worker_id!r} is registered on rank "
                                        f"{held}; replace takes it over")
                self.ranks[held].drop_worker(req.worker_id)
            registration = self.ranks[rank].register(req)
            self._rank_of[req.worker_id] = rank
            return registration

    def deregister(self, req: wire.WorkerRef) -> wire.Deregistered:
        return self._of(req.worker_id).deregister(req)

    def step(self, call: Any) -> Any:
        return self._of(call.worker_id).step(call)

    def get_request(self, req: wire.RequestRef) -> wire.RequestState:
        return self._of(req.worker_id).get_request(req)

    def shared_tensors(self, worker_id: str) -> Any:
        return self._of(worker_id).shared_tensors(worker_id)


    def get_pool(self, req: wire.PoolQuery) -> wire.PoolState:
        """The ranks' states summed (workers listed together, counters added); the layout and
        epoch are rank 0's."""
        states = [rank.get_pool(req) for rank in self.ranks]
        first = states[0]
        summed = {name: sum(getattr(s, name) for s in states)
                  for name in ("free_blocks", "used_blocks", "parked_blocks", "num_requests",
                               "capacity_tokens", "history_tokens", "pending_slack_tokens",
                               "leases_expired")}
        counters = {name: sum(s.counters.get(name, 0) for s in states) for name in first.counters}
        return wire.PoolState(epoch=first.epoch, layout=first.layout, counters=counters,
                              workers=[w for s in states for w in s.workers],
                              invariants=next((s.invariants for s in states
                                               if s.invariants == "repaired"), first.invariants),
                              **summed)

    def repair_shared_state(self) -> dict[str, int]:
        """Every rank's `ServiceCore.repair_shared_state`, summed by what."""
        repaired: dict[str, int] = {}
        for rank in self.ranks:
            for what, n in rank.repair_shared_state().items():
                repaired[what] = repaired.get(what, 0) + n
        return repaired

    def expire_leases(self) -> int:
        return sum(rank.expire_leases() for rank in self.ranks)

    def watch_pauses(self, longest_quiet_s: float) -> None:
        for rank in self.ranks:
            rank.watch_pauses(longest_quiet_s)

    def observe_step(self, transport: str, seconds: float) -> None:
        self.ranks[0].observe_step(transport, seconds)

    def check_invariants(self) -> None:
        for rank in self.ranks:
            rank.check_invariants()
