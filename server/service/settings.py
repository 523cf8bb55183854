"""`ServiceConfig`: one service's pool and the limits that keep it safe under many workers.

``kvalloc serve`` with no arguments runs `default_pool()`: the small model shape of `PoolConfig`
on CUDA when present, else on CPU.
"""

from __future__ import annotations

import os

from kvalloc.allocator import LayerGroup, PoolConfig, WireShape, group_pools
from kvalloc.server.contract.addresses import TOKEN_ENV
from kvalloc.server.service.events.access import EventAccess
from kvalloc.server.service.events.streams import WORKER_FIELD, per_worker
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

HASH_SEED_ENV = "KVALLOC_HASH_SEED"
EVENTS_SECRET_ENV = "KVALLOC_EVENTS_SECRET"

# Request handles carry a block-table row in their low 20 bits (see `server.service.registry`).
MAX_ROWS = 1 << 20
DEFAULT_NUM_BLOCKS = 4096


def default_pool(**overrides: object) -> PoolConfig:
    """The embedded default: PoolConfig's small model shape and `DEFAULT_NUM_BLOCKS` blocks."""
    return PoolConfig(**{"num_blocks": DEFAULT_NUM_BLOCKS, **overrides})


def token_from_env() -> SecretStr | None:
    """``KVALLOC_TOKEN`` when set and non-empty (never a command-line flag: ps would show it)."""
    value = os.environ.get(TOKEN_ENV, "")
    return SecretStr(value) if value else None


def secret_from_env(name: str) -> SecretStr | None:
    """The environment variable ``name`` when set and non-empty (a secret: never a flag)."""
    value = os.environ.get(name, "")
    return SecretStr(value) if value else None


class ServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: PoolConfig = Field(default_factory=default_pool)
    lease_ttl_s: float = Field(default=30.0, gt=0,
                               description="A worker that makes no call for this long loses its "
                                           "requests; their blocks go back to the pool.")
    verify_interval_s: float = Field(
        default=1.0, gt=0, le=3600,
        description="How often the service compares what workers map read-only (the block "
                    "table, the protection of cached blocks, the fence words) with its own state "
                    "and puts back what another process changed, as a verify query does.")
    max_workers: int = Field(default=16, gt=0, description="Registered workers at once; each "
                                                           "holds one staging buffer.")
    max_step_tokens: int = Field(default=4096, gt=0,
                                 description="Tokens one step may schedule (staging capacity).")
    max_body_bytes: int = Field(default=8 << 20, gt=0, description="Largest request body/message.")
    ipc_spin_s: float = Field(
        default=0.002, ge=0, le=60,
        description="After answering, an IPC connection polls for the next call without "
                    "sleeping for up to this long, from just before the call is due (learnt "
                    "from the last gaps between calls), which saves waking a sleeping thread per "
                    "call; 0 blocks at once. A poll gives up when its core is busy with other "
                    "work")
    token: SecretStr | None = Field(default=None, description="Bearer token both transports check.")
    nwor: bool = Field(default=True,
                       description="No-Write-On-Reject: commit only accepted drafts. False writes "
                                   "every staged token, as an engine without NWOR does.")
    prefix_caching: bool = Field(default=False, description="Share the cached full blocks of "
                                                            "prompts sent with token ids.")
    host_tier_bytes: int = Field(
        default=0, ge=0, description="Host memory of a tier below the pool that every cached "
                                     "block is copied to as it registers, and that prompts "
                                     "whose prefix the pool evicted are served from "
                                     "(`allocator.capacity.host_tier`); 0: none.")
    host_tier_onboard_bytes: int = Field(
        default=256 << 20, ge=0,
        description="The most bytes one step copies back from the host tier (0: no bound): "
                    "the worker's next forward waits for them, its whole batch with it. A "
                    "prompt whose prefix needs more is refused as onboarding and finds the "
                    "rest in the pool when asked again.")
    kv_events: str | None = Field(
        default=None, description="ZeroMQ endpoint to publish KV events on (vLLM's format); "
                                  "with {worker} in it, one stream per worker "
                                  "(`server.service.events.streams`).")
    kv_events_replay: str | None = Field(default=None, description="ZeroMQ endpoint of the KV "
                                                                   "events replay socket.")
    kv_events_shape: WireShape = Field(
        default=WireShape.MAPS, description="The events' wire shape: maps (vLLM after 0.23) or "
                                            "arrays (vLLM 0.23 and earlier).")
    kv_events_secret: SecretStr | None = Field(
        default=None, description="Events-only secret: TCP streams admit subscribers holding it "
                                  "alone (CURVE keys from it, `server.contract.routing`).")
    kv_events_plaintext: bool = Field(
        default=False, description="Serve TCP streams without a secret: whoever reaches them "
                                   "reads every prompt's token ids.")
    kv_events_group: str | None = Field(
        default=None, description="Event socket files 0660 with this group; none: 0600.")
    hash_seed: SecretStr | None = Field(
        default=None, description="Secret the block hashes are keyed with "
                                  "(`server.contract.routing.hash_seed`); none: random per start.")
    cache_groups: dict[str, list[str]] = Field(
        default_factory=dict, description="Prefix-cache namespaces that several workers share: "
                                          "name -> worker ids; every other worker has its own.")
    devices: list[str] = Field(
        default_factory=list, description="One pool per device, in shard order (a device may "
                                          "repeat); none: the pool's device alone. The first is "
                                          "the pool's device (`server.service.shards`).")
    tensor_parallel: int = Field(
        default=1, gt=0, description="Shards of one pool: each device holds num_kv_heads / "
                                     "tensor_parallel KV heads of every layer.")
    groups: list[LayerGroup] = Field(
        default_factory=list, description="KV cache groups whose layers partition the pool's, "
                                          "each with its own window and blocks "
                                          "(`allocator.capacity.windows.layers`); none: one "
                                          "group of every layer, the pool.")
    data_parallel_rank: int | None = Field(
        default=None, ge=0, description="The data-parallel rank this service allocates for, "
                                        "when it serves one rank of several (a service of "
                                        "several ranks numbers its own): its KV events carry "
                                        "it, and a worker registering for another is refused.")

    @property
    def event_access(self) -> EventAccess:
        """Who may read the KV event streams, as this configuration says."""
        return EventAccess(secret=self.kv_events_secret, plaintext=self.kv_events_plaintext,
                           group=self.kv_events_group)

    @property
    def host_tier_blocks(self) -> int:
        """Slots of the host tier: whole blocks (every shard's heads) in ``host_tier_bytes``."""
        return self.host_tier_bytes // self.pool.bytes_per_block

    @property
    def onboard_blocks_per_step(self) -> int | None:
        """`host_tier_onboard_bytes` in whole blocks, at least one (None: no bound)."""
        if not self.host_tier_onboard_bytes:
            return None
        return max(1, self.host_tier_onboard_bytes // self.pool.bytes_per_block)

    @model_validator(mode="after")
    def _tier_needs_caching(self) -> ServiceConfig:
        if self.host_tier_bytes and not self.prefix_caching:
            raise ValueError("host_tier_bytes: a host tier needs prefix_caching")
        if self.host_tier_bytes and self.host_tier_blocks == 0:
            raise ValueError(f"host_tier_bytes: {self.host_tier_bytes} holds no block (one "
                             f"block is {self.pool.bytes_per_block} bytes)")
        return self

    @model_validator(mode="after")
    def _window_keeps_no_tier(self) -> ServiceConfig:
        # A windowed group's cache hits need only a window's blocks, but the host tier looks a
        # prompt up from its first block (`allocator.capacity.host_tier`), so it refuses one.
        if self.pool.window is not None and self.host_tier_bytes:
            raise ValueError("host_tier_bytes: a windowed pool (pool.window) keeps no host "
                             "tier")
        return self

    @model_validator(mode="after")
    def _groups_partition_the_pool(self) -> ServiceConfig:
        if not self.groups:
            return self
        for name, refused in (("tensor_parallel", self.tensor_parallel > 1),
                              ("devices", len(self.devices) > 1)):
            if refused:
                raise ValueError(f"{name}: not with groups (a grouped pool is one shard)")
        # Each group caches under its own block size, so its own hashes: which group's blocks
        # a router or the host tier should see is not defined yet.
        for name, refused in (("kv_events", self.kv_events is not None),
                              ("kv_events_replay", self.kv_events_replay is not None),
                              ("host_tier_bytes", self.host_tier_bytes > 0)):
            if refused:
                raise ValueError(f"{name}: not with groups (each group caches its own blocks "
                                 "under its own hashes; which group's a router or the host "
                                 "tier would see is not defined)")
        group_pools(self.pool, self.groups)
        return self

    @model_validator(mode="after")
    def _events_need_caching(self) -> ServiceConfig:
        if (self.kv_events is not None or self.kv_events_replay is not None) and not (
                self.prefix_caching and self.kv_events is not None):
            raise ValueError("kv_events: KV events need prefix_caching and a kv_events endpoint")
        if self.kv_events is None:
            return self
        if self.kv_events_replay is not None and (per_worker(self.kv_events)
                                                  != per_worker(self.kv_events_replay)):
            raise ValueError(f"kv_events_replay: {WORKER_FIELD} must be in both event endpoints "
                             "or in neither")
        if per_worker(self.kv_events) and not self.kv_events.startswith("ipc://"):
            raise ValueError(f"kv_events: a stream per worker ({WORKER_FIELD}) needs an ipc:// "
                             "endpoint; over TCP publish one stream per service")
        return self

    @model_validator(mode="after")
    def _groups_are_disjoint(self) -> ServiceConfig:
        seen: dict[str, str] = {}
        for name, ids in self.cache_groups.items():
            if not name or not ids or "" in ids:
                raise ValueError(f"cache_groups: group {name!r} needs a name and worker ids")
            for worker_id in ids:
                if seen.setdefault(worker_id, name) != name:
                    raise ValueError(f"cache_groups: worker {worker_id!r} is in groups "
                                     f"{seen[worker_id]!r} and {name!r}")
        return self

    @model_validator(mode="after")
    def _staging_fits_a_batch(self) -> ServiceConfig:
        # A full batch of decode steps must fit, or max_batch_size is a lie.
        if self.pool.max_batch_size > MAX_ROWS:
            raise ValueError(f"pool.max_batch_size: {self.pool.max_batch_size} rows do not fit a "
                             f"request handle (at most {MAX_ROWS})")
        need = self.pool.max_batch_size * (1 + self.pool.max_draft_len)
        if self.max_step_tokens < need:
            raise ValueError(f"max_step_tokens: {self.max_step_tokens} cannot hold a full decode "
                             f"batch ({need} = max_batch_size * (1 + max_draft_len))")
        return self
