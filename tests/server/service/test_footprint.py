"""What the service's memory takes, counted before it is made: the count is what a core really
maps in /dev/shm once every worker slot is taken, and a footprint over what is free is refused
naming the sizes, what is free and the flags."""

from __future__ import annotations

import pytest
import torch
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import PoolTooLarge
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.footprint import (
    check_fits,
    describe_bytes,
    footprint,
    free_memory,
    on_device,
)
from kvalloc.server.service.ranks import RankedService
from kvalloc.server.service.settings import ServiceConfig

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def mapped_by_a_full_core(config: ServiceConfig) -> int:
    """Bytes a core over ``config`` maps in /dev/shm once every worker slot is taken."""
    core = ServiceCore(config)
    try:
        for i in range(config.max_workers):
            core.register(wire.RegisterRequest(worker_id=f"w{i}", attached=False))
        return sum(p.stat().st_size for p in SHM_DIR.glob(f"kvalloc-{core.epoch:016x}-*"))
    finally:
        core.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "fp8_e4m3"])
def test_the_footprint_is_what_a_full_core_maps(make_config, dtype: str) -> None:
    config = ServiceConfig(pool=make_config(dtype=dtype, num_kv_heads=2), max_workers=3,
                           max_step_tokens=64)
    assert mapped_by_a_full_core(config) == footprint(config).total


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_a_latent_pools_footprint_is_what_its_core_maps_one_plane_of_it(make_config,
                                                                         dtype: str) -> None:
    latent = make_config(dtype=dtype, kv_layout="latent", num_kv_heads=1, head_dim=72)
    config = ServiceConfig(pool=latent, max_workers=2, max_step_tokens=64)
    assert mapped_by_a_full_core(config) == footprint(config).total
    as_kv = footprint(config.model_copy(update={"pool": make_config(dtype=dtype,
                                                                    head_dim=72)}))
    assert 2 * footprint(config).pool == as_kv.pool
    assert 2 * footprint(config).staging == as_kv.staging


@pytest.mark.parametrize("devices, tp", [(["cpu", "cpu"], 2), (["cpu"] * 4, 2)])
def test_the_footprint_of_shards_and_ranks_is_what_their_cores_map(make_config, devices,
                                                                    tp) -> None:
    config = ServiceConfig(pool=make_config(num_kv_heads=2), max_workers=2, max_step_tokens=64,
                           devices=devices, tensor_parallel=tp)
    service = RankedService(config)
    try:
        for rank in range(len(service.ranks)):
            for i in range(config.max_workers):
                service.register(wire.RegisterRequest(worker_id=f"w{rank}-{i}", attached=False,
                                                      data_parallel_rank=rank))
        mapped = sum(p.stat().st_size for core in service.ranks
                     for p in SHM_DIR.glob(f"kvalloc-{core.epoch:016x}-*"))
        assert mapped == footprint(config).total
        assert sum(on_device(config, footprint(config)).values()) == mapped
    finally:
        service.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_pool_larger_than_the_free_memory_is_refused_naming_sizes_free_and_flags(
        make_config, device: str) -> None:
    """On CPU the least of /dev/shm's free space and the RAM available bounds it; on CUDA the
    device's free memory."""
    where = "free on cuda:" if device == "cuda" else "free in /dev/shm"
    free = min(n for _, n in free_memory(torch.device(device)))
    block = make_config().bytes_per_block
    config = ServiceConfig(pool=make_config(device=device, num_blocks=2 * free // block),
                           max_step_tokens=64)
    with pytest.raises(PoolTooLarge) as info:
        check_fits(config)
    message = str(info.value)
    assert f"--num-blocks {config.pool.total_blocks}" in message and where in message
    assert describe_bytes(footprint(config).pool) in message
    assert "--max-workers 16" in message
    small = ServiceConfig(pool=make_config(device=device), max_step_tokens=64)
    assert check_fits(small) == footprint(small)


def test_sizes_read_in_the_largest_unit_that_keeps_them_whole() -> None:
    assert [describe_bytes(n) for n in (512, 64 << 10, 3 << 29, 5 << 40)] == [
        "512 B", "64.0 KiB", "1.5 GiB", "5.0 TiB"]
