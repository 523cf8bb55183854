"""`SharedPool`: the service's pool as the workers share it.

Every tensor a worker maps is made here, exported where same-host workers can map it (shared
memory on CPU, CUDA IPC on GPU): each shard's KV pool (`server.service.shards`), its copy of the
block table and its protection of cached blocks; per worker, a staging buffer and (CUDA) a step
fence on every shard. A grouped pool (`ServiceConfig.groups`) is one device whose parts are its
groups (`shards.group_specs`): each group's KV pool over its layers, its own block table (the
`KVCacheGroups` placement's), its committer, and per worker a staging buffer per group; the
step fence and the fence word are one per worker, for every group. It holds the committers
that write the staging into the pools, and closes the exporter, which unlinks everything, when
the service closes. `ServiceCore` decides who is registered; this decides what a registration
maps.

Invariants:
- a worker's staging buffers are exported from its registration until its session ends, under
  names made of its id (a successor of the same id reuses them only after the release);
- a worker's step fences outlive its session (see `_fence`); its fence words (one per device:
  per shard, one for every group; the same slot in each `FenceWords`) are open exactly while
  its session is, and are closed (`end_writes`) before its blocks are freed;
- only a worker that does not commit its own tokens has its staging committed by the service;
- what workers map read-only (the block table's copies, the protection of cached blocks, the
  fence words) is a copy of the service's host state, never the only one: `repair` compares
  and rewrites it from there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch
from kvalloc.allocator import (
    CLOSED,
    BlockTable,
    FenceWords,
    KVCacheGroups,
    KVCacheManager,
    KVStorage,
    TensorAllocator,
    TierCopies,
    WriterFence,
)
from kvalloc.allocator.common.device_io import on_device
from kvalloc.server.contract import wire
from kvalloc.server.contract.sharing import FenceGroup, StepFence, TensorExporter
from kvalloc.server.service.commit import Committer, ShardedCommitter
from kvalloc.server.service.registry import Worker
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.service.shards import PoolShard, ShardSpec, group_specs, shard_specs
from kvalloc.server.service.tier_store import TierStore

log = logging.getLogger("kvalloc.service")

# What an in-process worker uses instead of mapping the handles: the pool, the block table, its
# staging buffer, step fence and fence word, and the protection of cached blocks (prefix caching).
SharedTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepFence | None, torch.Tensor,
                      torch.Tensor | None]
# The same of one shard of a tensor-parallel pool, with the model's KV heads it holds.
ShardTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepFence | None, torch.Tensor,
                     torch.Tensor | None, tuple[int, int]]
# One group of a grouped pool: its pool, its block table and the worker's staging of it, its
# model layers and window, and its protection of cached blocks (the fences are the pool's:
# `SharedTensors`).
GroupTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], int | None,
                     torch.Tensor | None]


class InProcessShare(NamedTuple):
    """What an in-process worker uses instead of mapping the handles: part 0's tensors and its
    own (``pool``), and each shard's of a tensor-parallel pool or each group's of a grouped
    pool, in order (empty otherwise)."""

    pool: SharedTensors
    shards: list[ShardTensors]
    groups: list[GroupTensors]


# What `SharedPool.repair` compares and rewrites, as it names them.
SHARED_STATE = ("block_table", "protected", "fence_words")


class WorkerShare(NamedTuple):
    """What a registration maps and what the service keeps of it: the worker's staging buffers
    and fence words' views (one per part: a shard, or a group, whose views are one), its
    attachment, its step fence, and the slot its words hold."""

    stagings: list[torch.Tensor]
    writers: list[WriterFence]
    attachment: wire.Attachment
    fence: StepFence | FenceGroup | None
    fence_slot: int


class ExportedTensors:
    """The placement hook the pool and the block table are built with: every tensor is made
    where same-host workers can map it (shared memory on CPU, CUDA IPC on GPU), and kept with
    its handle: the handle for the workers' attachments, the tensor for in-process workers."""

    def __init__(self, exporter: TensorExporter) -> None:
        self.exporter = exporter
        self.handles: dict[str, wire.TensorHandle] = {}
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        tensor, self.handles[name] = self.exporter.empty(name, shape, dtype, device)
        self.tensors[name] = tensor
        return tensor


class SharedPool:
    def __init__(self, config: ServiceConfig, epoch: int,
                 manager: Callable[[TensorAllocator], KVCacheManager | KVCacheGroups]) -> None:
        """``manager`` makes the host-side manager on the placement it is given (a
        `KVCacheGroups` for a grouped pool): its block tables are exported with the pool, and
        every other shard's table copy mirrors the one table.

        ``shards`` are the pool's parts, each with its own KV pool, table copy and committer: a
        tensor-parallel pool's shards, or a grouped pool's groups (``spec.group`` set)."""
        self.config = config
        # Before anything is made: what does not fit is refused.
        specs = group_specs(config) if config.groups else shard_specs(config)
        # A grouped pool's groups share one device: one fence word and step fence per worker.
        self._devices = specs[:1] if config.groups else specs
        self._exporter = TensorExporter(prefix=f"kvalloc-{epoch:016x}")
        placement = ExportedTensors(self._exporter)
        pool = config.pool
        self.staging_dtype = (torch.bfloat16 if pool.dtype == "fp8_e4m3" else pool.torch_dtype)
        try:  # a segment that cannot be backed (`InsufficientMemory`) leaves none of the others
            self.storage = KVStorage(specs[0].pool, allocate=placement)
            made = manager(placement)
            self.groups = made if isinstance(made, KVCacheGroups) else None
            # What a grouped pool reports one manager's figures of (`get_request`, /metrics).
            self.manager = made.managers[made.specs[0].name] if isinstance(
                made, KVCacheGroups) else made
            self.shards = [self._shard(spec, placement) for spec in specs]
            self.words = [FenceWords(config.max_workers, spec.device, placement,
                                     spec.name("fence_words")) for spec in self._devices]
        except BaseException:
            self._exporter.close()
            raise
        self._word_handles = [placement.handles[spec.name("fence_words")]
                              for spec in self._devices]
        slots = config.host_tier_blocks
        self.tier_stores = [_tier_store(shard, slots) for shard in self.shards] if slots else []
        self.committer = self.shards[0].committer
        self.commits = ShardedCommitter([shard.committer for shard in self.shards],
                                        grouped=self.groups is not None)
        self._fences: dict[tuple[str, int], tuple[StepFence, wire.EventHandle,
                                                  wire.EventHandle]] = {}

    def _shard(self, spec: ShardSpec, placement: ExportedTensors) -> PoolShard:
        """Part ``spec``'s pool, table copy, protection and committer (part 0's pool, and each
        group's table, are the ones `__init__` made)."""
        if spec.index == 0:
            storage = self.storage
        else:
            def named(name: str, *args: Any) -> torch.Tensor:
                return placement(spec.name(name), *args)
            with on_device(spec.device):
                storage = KVStorage(spec.pool, allocate=named)
        if spec.index == 0 or spec.group is not None:
            table = placement.tensors[spec.name("block_table")]
        else:
            table = self.manager.table.mirror(spec.device, placement, spec.name("block_table"))
        protected, protected_handle = None, None
        if self.config.prefix_caching:  # shared: overlap workers' own commits read it too
            protected, protected_handle = self._exporter.empty(
                spec.name("protected"), (spec.pool.total_blocks,), torch.bool, spec.device)
        with on_device(spec.device):
            committer = Committer(storage, max_tokens=self.config.max_step_tokens,
                                  stage_dtype=self.staging_dtype, nwor=self.config.nwor,
                                  protected=protected)
        return PoolShard(spec, storage, table, committer, placement.handles[spec.name("kv")],
                         placement.handles[spec.name("block_table")], protected_handle)

    def attach(self, worker_id: str, session: int, *, overlap: bool,
               fenced: bool = True) -> WorkerShare:
        """``worker_id``'s staging buffers (one per part), its fence words opened for
        ``session``, what it maps, and its step fence unless ``fenced`` is False (the service
        does no device work on its calls, and serves no other worker: `ServiceCore.register`).
        An overlap worker commits its own staging, so the service's commit never reads it."""
        slots = [words.open(session) for words in self.words]
        assert len(set(slots)) == 1, "every shard's table of words moves in lockstep"
        stagings, parts, fences = [], [], []
        try:  # a staging buffer that cannot be backed (`InsufficientMemory`) leaves nothing
            for shard in self.shards:
                staging, handles, fence = self._attach_shard(shard, worker_id, slots[0],
                                                             fenced)
                stagings.append(staging)
                parts.append(handles)
                fences += [fence] if fence is not None and fence not in fences else []
        except BaseException:
            for words in self.words:
                words.close(slots[0])
            self._release_stagings(worker_id)
            raise
        own = [words.fence(slots[0]) for words in self.words]
        writers = [own[self._device_of(shard.spec)] for shard in self.shards]
        if not overlap:
            self.commits.add_staging(stagings, writers)
        # A group's fences are the pool's (the top-level fields), its protection its own; a
        # shard's are all its own.
        groups = [wire.GroupAttachment(
            kv=p["kv"], block_table=p["block_table"], staging=p["staging"],
            protected=p["protected"], name=s.spec.group.name,
            layers=list(s.spec.group.layers), window=s.spec.group.window)
            for p, s in zip(parts, self.shards, strict=True) if s.spec.group is not None]
        shards = [] if groups or len(parts) == 1 else [wire.ShardAttachment(
            **p, device=s.spec.pool.device, head_start=s.spec.heads[0],
            head_stop=s.spec.heads[1]) for p, s in zip(parts, self.shards, strict=True)]
        attachment = wire.Attachment(**parts[0], shards=shards, groups=groups)
        return WorkerShare(stagings, writers, attachment, _one_fence(fences), slots[0])

    def _attach_shard(self, shard: PoolShard, worker_id: str, fence_slot: int,
                      fenced: bool) -> tuple[torch.Tensor, dict[str, Any], StepFence | None]:
        """``worker_id``'s staging buffer and fence on part ``shard``, and the part's handles
        (`wire.PoolHandles`' fields, with the view of its fence word, ``fence_slot``)."""
        pool, spec = shard.spec.pool, shard.spec
        shape = (pool.num_layers, pool.kv_planes, self.config.max_step_tokens, pool.num_kv_heads,
                 pool.head_dim)
        staging, handle = self._exporter.empty(spec.name(f"staging-{worker_id}"), shape,
                                               self.staging_dtype, spec.device)
        fence, fwd, com = self._fence(worker_id, spec) if fenced else (None, None, None)
        return staging, {
            "kv": shard.kv_handle, "block_table": shard.table_handle, "staging": handle,
            "forward_done": fwd, "commit_done": com, "protected": shard.protected_handle,
            "writer_fence": _element(self._word_handles[self._device_of(spec)], fence_slot)}, fence

    def _device_of(self, spec: ShardSpec) -> int:
        """The index of part ``spec``'s device: its fence words' and step fence's."""
        return 0 if spec.group is not None else spec.index

    def _fence(self, worker_id: str, spec: ShardSpec) -> tuple[
            StepFence | None, wire.EventHandle | None, wire.EventHandle | None]:
        """The worker id's interprocess events on part ``spec``'s device (CUDA pools only), made
        once and kept until the service closes: using an imported event after its exporter
        destroyed it is undefined, and a worker whose lease expired may still record its event
        once before it learns so."""
        if spec.device.type != "cuda":
            return None, None, None
        key = (worker_id, self._device_of(spec))
        if key not in self._fences:
            self._fences[key] = StepFence.create(spec.device)
        return self._fences[key]

    def copy_tier(self, onboards: TierCopies, offloads: TierCopies) -> None:
        """Carry out the host tier's copies on every shard (`TierStore.copy`): what the next
        reader of the pool finds there is ordered after them."""
        for store in self.tier_stores:
            with on_device(store.kv.device):
                store.copy(onboards, offloads)

    def end_writes(self, worker: Worker) -> None:
        """Close ``worker``'s fence words on every shard: from now on nothing its session
        launched writes the pool (`allocator.nwor.fence`). Before its blocks are freed."""
        for words in self.words:
            words.close(worker.fence_slot)

    def repair(self, open_words: dict[int, int]) -> dict[str, int]:
        """Put back what another process wrote into the state workers map read-only: every
        shard's copy of the block table from the manager's host table (each group's table from
        its group's) but for the rows workers keep themselves, which nobody reads there, every
        shard's protection of cached blocks from the prefix cache's flags (each group's from its
        group's cache), every shard's fence words from
        ``open_words`` (slot -> the session open in it; every other word closed). Any process of
        the service's user can open those segments read-write; the host state is out of its
        reach. Returns the entries that differed and were rewritten, by what (`SHARED_STATE`).
        The caller has drained the cache's protection flips (`StepPipeline.sync_cache`)."""
        repaired = {"block_table": sum(_rewrite(copy, table.host, table.worker_kept)
                                       for table in self.tables
                                       for copy in table.device_tables)}
        repaired["protected"] = sum(
            _rewrite(shard.committer.protected, manager.cache.protected)
            for shard, manager in zip(self.shards, self._part_managers(), strict=True)
            if shard.committer.protected is not None and manager.cache is not None)
        words = np.full(self.config.max_workers, CLOSED, dtype=np.int64)
        words[list(open_words)] = list(open_words.values())
        repaired["fence_words"] = sum(_rewrite(shard.words, words) for shard in self.words)
        if any(repaired.values()):
            log.warning("shared state another process changed was put back from the service's "
                        "own: %s entries rewritten", repaired)
        return repaired

    @property
    def tables(self) -> list[BlockTable]:
        """The block tables: the manager's, or each group's in group order."""
        if self.groups is None:
            return [self.manager.table]
        return list(self.groups.tables.values())

    def _part_managers(self) -> list[KVCacheManager]:
        """The manager of each part's blocks, in part order: the one manager for every shard, or
        each group's."""
        if self.groups is None:
            return [self.manager] * len(self.shards)
        return list(self.groups.managers.values())

    def check_invariants(self) -> None:
        """The committers' state (each shard's or group's), and every device's fence words
        (read back)."""
        self.commits.check_invariants()
        for words in self.words:
            words.check_invariants()

    def release(self, worker: Worker) -> None:
        """``worker``'s staging buffers, on every part: no longer committed, no longer
        exported."""
        self.commits.release_staging(worker.stagings)
        self._release_stagings(worker.worker_id)

    def _release_stagings(self, worker_id: str) -> None:
        for shard in self.shards:
            self._exporter.release(shard.spec.name(f"staging-{worker_id}"))

    def shared_tensors(self, worker: Worker) -> InProcessShare:
        """Part 0's tensors (shard 0's, group 0's) and ``worker``'s, and every shard's or
        group's, as this process holds them."""
        return InProcessShare((self.storage.kv, self.shards[0].table, worker.stagings[0],
                               worker.fence, worker.writers[0].word, self.committer.protected),
                              self._shared_shards(worker), self._shared_groups(worker))

    def _shared_groups(self, worker: Worker) -> list[GroupTensors]:
        """Each group's tensors and ``worker``'s staging of it, in group order, with the group's
        model layers, window and protection; empty for a pool that is not grouped."""
        return [(shard.storage.kv, shard.table, staging, shard.spec.group.layers,
                 shard.spec.group.window, shard.committer.protected)
                for shard, staging in zip(self.shards, worker.stagings, strict=True)
                if shard.spec.group is not None]

    def _shared_shards(self, worker: Worker) -> list[ShardTensors]:
        """Part 0's tensors of every shard of a tensor-parallel pool, in shard order, each with
        the KV heads it holds; empty for a pool of one shard."""
        if len(self.shards) == 1 or self.groups is not None:
            return []
        fences = worker.fence.fences if isinstance(worker.fence, FenceGroup) else None
        return [(shard.storage.kv, shard.table, staging,
                 fences[shard.spec.index] if fences else None, writer.word,
                 shard.committer.protected, shard.spec.heads)
                for shard, staging, writer in zip(self.shards, worker.stagings, worker.writers,
                                                  strict=True)]

    def close(self) -> None:
        """Unlink every exported tensor."""
        self._exporter.close()


def _rewrite(shared: torch.Tensor, own: np.ndarray, skip_rows: np.ndarray | None = None) -> int:
    """How many entries of ``shared`` differ from ``own`` (the same shape), after rewriting
    them all from it; rows ``skip_rows`` marks (a bool per row) are neither."""
    expected = torch.from_numpy(own).to(shared.device)
    differ = shared != expected
    if skip_rows is not None and skip_rows.any():
        differ[torch.from_numpy(skip_rows).to(shared.device)] = False
    count = int(differ.sum())
    if count:
        shared[differ] = expected[differ]
    return count


def _tier_store(shard: PoolShard, slots: int) -> TierStore:
    with on_device(shard.spec.device):
        return TierStore(shard.storage.kv, slots)


def _one_fence(fences: list[StepFence]) -> StepFence | FenceGroup | None:
    """A worker's fence: none on CPU, the shard's own for one shard, else all of them."""
    if not fences:
        return None
    return fences[0] if len(fences) == 1 else FenceGroup(fences)


def _element(handle: wire.TensorHandle, index: int) -> wire.TensorHandle:
    """The handle of element ``index`` of the one-dimensional tensor ``handle`` describes."""
    return msgspec.structs.replace(handle, shape=[1], stride=[1],
                                   storage_offset=handle.storage_offset + index)
