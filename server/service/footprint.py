"""What a service's memory takes, and whether it fits where it lives, checked before any of it
is made.

The pool (``[num_layers, kv_planes, num_blocks, tokens_per_block, num_kv_heads, head_dim]``: two
planes, K and V, or one MLA latent), the block
table and one staging buffer per worker (up to ``max_workers``) are made at start and at
registration. On CPU they are POSIX shared memory: files in ``/dev/shm``, a tmpfs whose pages are
RAM, which the service zero-fills; on CUDA they are device memory. A pool larger than what is
free there does not fail cleanly: on CPU it fills ``/dev/shm`` and RAM, stalls every process of
the host and is OOM-killed with its segments left behind. `check_fits` refuses it instead, naming
the sizes, what is free and the flags that set them.

The check counts; it reserves nothing (two services may count the same free bytes). Each segment
is backed by pages when it is made (`server.contract.sharing`), which is where a shortage after
the check is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from kvalloc.allocator import group_pools
from kvalloc.server.contract.errors import PoolTooLarge
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.service.settings import ServiceConfig

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Footprint:
    pool: int  # bytes of K/V (or latents)
    block_table: int
    staging: int  # of all max_workers buffers
    fence_words: int = 0  # one int64 a worker slot, on every device

    @property
    def total(self) -> int:
        return self.pool + self.block_table + self.staging + self.fence_words


def footprint(config: ServiceConfig) -> Footprint:
    pool = config.pool
    staging_dtype = torch.bfloat16 if pool.dtype == "fp8_e4m3" else pool.torch_dtype
    staging_itemsize = torch.empty((), dtype=staging_dtype).element_size()
    per_worker = (pool.num_layers * pool.kv_planes * config.max_step_tokens * pool.num_kv_heads
                  * pool.head_dim * staging_itemsize)
    devices = len(config.devices or [pool.device])
    ranks = max(1, devices // config.tensor_parallel)  # a pool and its workers' staging each
    # A grouped pool is a pool and a table per group (whose layers partition the pool's: the
    # staging is the same).
    pools = [g.config for g in group_pools(pool, config.groups)] if config.groups else [pool]
    return Footprint(pool=ranks * sum(p.bytes_per_block * p.total_blocks for p in pools),
                     block_table=4 * pool.max_batch_size * pool.max_blocks_per_seq * devices
                     * len(pools),
                     staging=ranks * config.max_workers * per_worker,
                     fence_words=8 * config.max_workers * devices)


def on_device(config: ServiceConfig, need: Footprint) -> dict[torch.device, int]:
    """Bytes of ``need`` on each device of ``config``: each shard holds its share of its rank's
    pool and staging, and a whole copy of its rank's block table and fence words
    (`server.service.shards`)."""
    devices = [torch.device(d) for d in config.devices or [config.pool.device]]
    per_shard = ((need.pool + need.staging) // len(devices)
                 + (need.block_table + need.fence_words) // len(devices))
    return {device: devices.count(device) * per_shard for device in dict.fromkeys(devices)}


def free_memory(device: torch.device) -> list[tuple[str, int]]:
    """Where memory on ``device`` comes from, and how many bytes of it are free: the device's
    free memory for CUDA; for CPU, /dev/shm's free space and the RAM the kernel can give."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [(f"free on cuda:{index}", torch.cuda.mem_get_info(index)[0])]
    shm = os.statvfs(SHM_DIR)
    return [(f"free in {SHM_DIR}", shm.f_bavail * shm.f_frsize),
            ("RAM available", _mem_available())]


def _mem_available() -> int:
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{MEMINFO} states no MemAvailable")


def check_fits(config: ServiceConfig) -> Footprint:
    """The footprint of ``config``; `PoolTooLarge` if it is more than any of the memory free
    where it lives."""
    need = footprint(config)
    for device, total in on_device(config, need).items():
        _check_device_fits(config, need, device, total)
    _check_tier_fits(config, need)
    return need


def _check_tier_fits(config: ServiceConfig, need: Footprint) -> None:
    """The host tier (every rank's, pinned on a GPU host) and, on a CPU pool, the pool itself
    come out of the RAM the kernel can give."""
    ranks = max(1, len(config.devices or [config.pool.device]) // config.tensor_parallel)
    tier = ranks * config.host_tier_blocks * config.pool.bytes_per_block
    if not tier:
        return
    host = tier + (need.total if config.pool.device == "cpu" else 0)
    available = _mem_available()
    if host > available:
        raise PoolTooLarge(
            f"host_tier: {describe_bytes(tier)} of host tier"
            + (f" and the {describe_bytes(need.total)} CPU pool" if host > tier else "")
            + f" need more than the {describe_bytes(available)} RAM available; lower --host-tier")


def _check_device_fits(config: ServiceConfig, need: Footprint, device: torch.device,
                       total: int) -> None:
    short = [(what, free) for what, free in free_memory(device) if total > free]
    if short:
        pool = config.pool
        raise PoolTooLarge(
            f"pool: {describe_bytes(need.pool)} of K/V (--num-blocks {pool.total_blocks} x "
            f"{describe_bytes(pool.bytes_per_block)} a block) and "
            f"{describe_bytes(need.staging)} of staging (--max-workers {config.max_workers} x "
            f"--max-step-tokens {config.max_step_tokens}) on {pool.device} need "
            f"{describe_bytes(need.total)}"
            + (f", {describe_bytes(total)} of it on {device}" if total != need.total else "")
            + ", more than the "
            + " and ".join(f"{describe_bytes(free)} {what}" for what, free in short)
            + "; lower --num-blocks (or --max-workers, --max-step-tokens)")


def describe_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (1.5 GiB, 64 KiB)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
