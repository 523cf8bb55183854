"""A service's shards: the pools of one tensor-parallel group, one per device.

A model run tensor-parallel over N devices splits every layer's KV heads: shard r holds heads
``[r * h, (r + 1) * h)`` with ``h = num_kv_heads / N`` (`allocator.config.shard_span`, the rule
the worker's model sharding splits attention by). A latent pool (MLA) has no heads to split: it is
refused at N > 1 (MLA engines replicate the latent on every rank). The service allocates blocks
once, for all shards: one manager and one block table, whose host mirror has a device copy per
shard (`BlockTable.mirror`), so the same block ids address every shard's pool. A shard has its own
KV pool, and per worker its own staging buffer and fence (CUDA); the service's commit writes the
same slots into every shard (`server.service.commit.ShardedCommitter`).

Invariants:
- shard 0 lives on the pool's own device, and the manager's table is its copy;
- every shard's pool has the pool's blocks, layers, tokens per block, head dim and dtype; only its
  heads and its device differ (``memory_budget_bytes`` sizes all shards together: each holds
  ``1 / N`` of a block's bytes);
- a shard r > 0 exports its tensors as ``shard<r>-<name>``, which collides neither with shard 0's
  names (``kv``, ``block_table``, ``protected``, ``staging-<worker id>``) nor with another shard's.

A grouped pool (`ServiceConfig.groups`) reuses the parts for its groups (`group_specs`): one
device, a part per group with the group's pool over its layers, each exported under the names
`KVCacheGroups` gives its table (group 0's plain, another's ``group-<group>-<tensor>``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvalloc.allocator import (
    KVStorage,
    LayerGroup,
    PoolConfig,
    group_pools,
    group_tensor_name,
    shard_span,
)
from kvalloc.allocator.commands.config_errors import reasons
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import ShardingInvalid
from kvalloc.server.service.commit import Committer
from kvalloc.server.service.settings import ServiceConfig, default_pool
from pydantic import ValidationError


@dataclass(frozen=True)
class ShardSpec:
    """A part of the pool with its own KV tensor and staging: a tensor-parallel shard, or a
    group of a grouped pool (``group``; see `group_specs`)."""

    index: int
    pool: PoolConfig  # this part's pool: its device, its heads, a group's layers and blocks
    heads: tuple[int, int]  # the model's KV heads it holds: [start, stop)
    group: LayerGroup | None = None  # the group it holds, in a grouped pool
    prefix: str = ""  # of its exported names: none for the first part

    @property
    def device(self) -> torch.device:
        return torch.device(self.pool.device)

    def name(self, name: str) -> str:
        """The exported name of this part's tensor ``name``."""
        return self.prefix + name


def shard_specs(config: ServiceConfig) -> list[ShardSpec]:
    """One `ShardSpec` per device of ``config``; `ShardingInvalid` naming what does not fit,
    before anything is allocated."""
    pool, tp = config.pool, config.tensor_parallel
    devices = config.devices or [pool.device]
    flags = f"--devices {','.join(devices)} --tensor-parallel {tp}"
    check_devices(devices)
    if len(devices) % tp:
        raise ShardingInvalid(f"devices: {len(devices)} devices are not a multiple of the "
                              f"tensor-parallel degree ({flags})")
    if len(devices) != tp:
        raise ShardingInvalid(f"devices: {len(devices)} devices at tensor-parallel {tp} make "
                              f"{len(devices) // tp} data-parallel ranks; a core allocates for "
                              f"one, as many devices as the degree (`server.service.ranks` "
                              f"holds a core per rank) ({flags})")
    if pool.kv_layout == "latent" and tp > 1:
        raise ShardingInvalid(f"kv_layout: a latent pool has no KV heads to split over {tp} "
                              f"shards; MLA engines replicate the latent on every rank: serve "
                              f"it at --tensor-parallel 1 ({flags})")
    if pool.num_kv_heads % tp:
        raise ShardingInvalid(f"num_kv_heads: {pool.num_kv_heads} KV heads do not split evenly "
                              f"over {tp} shards ({flags})")
    if not same_device(devices[0], pool.device):
        raise ShardingInvalid(f"devices: the first device {devices[0]!r} is not the pool's "
                              f"device {pool.device!r}")
    return [ShardSpec(r, _shard_pool(pool, device, pool.num_kv_heads // tp),
                      shard_span(pool.num_kv_heads, r, tp), prefix=f"shard{r}-" if r else "")
            for r, device in enumerate(devices)]


def group_specs(config: ServiceConfig) -> list[ShardSpec]:
    """A grouped pool's parts (`ServiceConfig.groups`), one per group on the pool's one device
    (grouped and tensor-parallel is refused by the configuration), each named as the allocator
    places its table (`group_tensor_name`), so its ``kv`` and staging sit beside it."""
    pools = group_pools(config.pool, config.groups)
    heads = (0, config.pool.num_kv_heads)
    return [ShardSpec(i, spec.config, heads, group,
                      group_tensor_name(pools, spec.name, ""))
            for i, (spec, group) in enumerate(zip(pools, config.groups, strict=True))]


def same_device(a: str, b: str) -> bool:
    """Whether two device names are one device (``cuda`` alone is the current GPU)."""
    return _indexed(a) == _indexed(b)


def _indexed(device: str) -> torch.device:
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return where


def _shard_pool(pool: PoolConfig, device: str, heads: int) -> PoolConfig:
    if heads == pool.num_kv_heads and device == pool.device:
        return pool  # a pool of one shard is the pool
    fields = pool.model_dump()
    fields.update(num_blocks=pool.total_blocks, memory_budget_bytes=None, num_kv_heads=heads,
                  device=device)
    return PoolConfig.model_validate(fields)  # its device was checked: nothing else changed


@dataclass(frozen=True)
class PoolShard:
    """A shard as the service holds it: its pool, its copy of the block table, its committer,
    and the handles a worker maps them by."""

    spec: ShardSpec
    storage: KVStorage
    table: torch.Tensor
    committer: Committer
    kv_handle: wire.TensorHandle
    table_handle: wire.TensorHandle
    protected_handle: wire.TensorHandle | None


def check_devices(devices: list[str]) -> None:
    """`ShardingInvalid` naming the first of ``devices`` that is not a device of this host."""
    for device in devices:
        try:
            default_pool(device=device)
        except ValidationError as exc:
            raise ShardingInvalid(f"devices: {reasons(exc)}") from None
