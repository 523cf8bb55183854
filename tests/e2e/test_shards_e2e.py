"""A real ``kvalloc serve --devices cpu,cpu --tensor-parallel 2``: a worker process maps both
shards from the registration's handles (shared memory), stages each shard, and every shard holds
exactly the committed tokens; a second worker process maps its one shard alone and finds the same
table. A command line whose shards do not fit exits 2 at once, naming what does not fit, and
leaves nothing in /dev/shm. The service of one data-parallel rank serves that rank's workers
alone; a service of two ranks serves a worker process of each, each rank's shards holding
exactly its worker's tokens, its metrics labelled by rank, and leaves nothing behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import RemoteError
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command
from service_harness import nwor_scenario
from test_pool_fit_e2e import owner_files_of

SHARDED_POOL = ("--devices", "cpu,cpu", "--tensor-parallel", "2", "--num-blocks", "128",
                "--tokens-per-block", "4", "--num-layers", "2", "--num-kv-heads", "4",
                "--head-dim", "8", "--max-batch-size", "16", "--max-seq-len", "64",
                "--max-step-tokens", "128")
WORKER_TIMEOUT_S = 120  # a worker process starts and runs the scenario in about 2 s here
START_TIMEOUT_S = 120  # imports and the check, on a loaded 2-core machine; nothing is compiled
SPAWN = mp.get_context("spawn")
METRICS_TIMEOUT_S = 30  # the state is copied at least once a second; thirty looks is room


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("shards"), *SHARDED_POOL) as svc:
        yield svc


def both_shards_worker(addr: str) -> tuple[list[str], list[tuple[int, int]]]:
    torch.set_num_threads(1)
    with Client(addr, worker_id="both") as client:
        client.register()
        assert client.pool is not None
        heads = [s.heads for s in client.pool.shards]
        outcome = nwor_scenario(client)
        client.deregister()
    return outcome.mismatches, heads


def one_shard_worker(addr: str) -> tuple[tuple[int, int] | None, list[int]]:
    """Map shard 1 alone; admit a request and read its row from that shard's table."""
    torch.set_num_threads(1)
    with Client(addr, worker_id="rank1") as client:
        client.register(shard=1)
        shard = client.pool
        assert shard is not None
        reply = client.step(new=(["a"], [9]))
        row = shard.block_table[int(reply.scheduled.rows[0])].tolist()
        client.deregister()
    return shard.heads, row


def test_a_worker_process_maps_both_shards_and_each_holds_the_committed_tokens(service):
    with SPAWN.Pool(1) as pool:
        mismatches, heads = pool.apply_async(both_shards_worker,
                                             (service.stream,)).get(WORKER_TIMEOUT_S)
    assert heads == [(0, 2), (2, 4)]
    assert mismatches == []


def test_a_rank_maps_its_own_shard_alone(service):
    with SPAWN.Pool(1) as pool:
        heads, row = pool.apply_async(one_shard_worker, (service.stream,)).get(
            WORKER_TIMEOUT_S)
    assert heads == (2, 4)
    assert [b for b in row if b >= 0] and row[3:] == [-1] * (len(row) - 3)  # 9 tokens, 3 blocks


@pytest.mark.parametrize("flags, message", [
    (("--devices", "cpu,cpu,cpu", "--tensor-parallel", "2"),
     "devices: 3 devices are not a multiple of the tensor-parallel degree"),
    (("--devices", "cpu,cpu", "--tensor-parallel", "2", "--num-kv-heads", "3"),
     "num_kv_heads: 3 KV heads do not split evenly over 2 shards"),
    (("--devices", f"cpu,cuda:{torch.cuda.device_count()}", "--tensor-parallel", "2"),
     f"devices: device: 'cuda:{torch.cuda.device_count()}'"),
    (("--device", "cuda:0", "--devices", "cpu,cpu", "--tensor-parallel", "2"),
     "devices: --device cuda:0 is not the first of --devices cpu,cpu"),
    (("--data-parallel-rank", "-1"),
     "--data-parallel-rank -1: Input should be greater than or equal to 0"),
])
def test_shards_that_do_not_fit_exit_2_naming_what(tmp_path: Path, flags, message):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with subprocess.Popen([*kvalloc_command(), "serve", "--port", "0", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(run)}) as proc:
        out, err = proc.communicate(timeout=START_TIMEOUT_S)
    assert proc.returncode == 2, out + err
    assert message in err and "Traceback" not in err
    assert owner_files_of(proc.pid) == []  # it made no segment: it never claimed an owner file


def test_the_service_of_a_data_parallel_rank_serves_that_ranks_workers(tmp_path: Path) -> None:
    service = ServiceProcess(tmp_path, *SHARDED_POOL, "--data-parallel-rank", "1", tcp=False)
    with service as svc, Client(svc.stream, worker_id="rank0") as other, Client(
            svc.stream, worker_id="rank1") as own:
        with pytest.raises(RemoteError, match="409 wrong_rank: data_parallel_rank: the worker "
                                              "is of rank 0, this service allocates for rank 1"):
            other.register(data_parallel_rank=0)
        reg = own.register(data_parallel_rank=1)
        assert reg.layout.data_parallel_rank == 1 and len(reg.attachment.shards) == 2
        own.deregister()
    assert "tensor-parallel 2 data-parallel rank 1" in service.log()


def rank_worker(addr: str, rank: int) -> tuple[list[str], int]:
    """The NWOR scenario's mismatches on rank ``rank``, and that rank's epoch."""
    torch.set_num_threads(1)
    with Client(addr, worker_id=f"rank{rank}") as client:
        reg = client.register(data_parallel_rank=rank)
        outcome = nwor_scenario(client)
        client.deregister()
    return outcome.mismatches, reg.epoch


def scraped(svc: ServiceProcess, line: str) -> bool:
    """Whether ``/metrics`` shows ``line`` within `METRICS_TIMEOUT_S`: scrapes serve the state as
    the service last copied it, after a step or on the lease reaper's look (every second)."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{svc.rest_tcp}/metrics", timeout=10) as reply:
            if line in reply.read().decode().splitlines():
                return True
        time.sleep(0.1)
    return False


def test_a_service_of_two_ranks_serves_a_worker_process_of_each(tmp_path: Path) -> None:
    ranks = ["--devices", "cpu,cpu,cpu,cpu", *SHARDED_POOL[2:]]
    service = ServiceProcess(tmp_path, *ranks)
    with service as svc, SPAWN.Pool(2) as pool:
        runs = [pool.apply_async(rank_worker, (svc.stream, rank)) for rank in (0, 1)]
        results = [run.get(WORKER_TIMEOUT_S) for run in runs]
        assert scraped(svc, 'kvalloc_requests_added_total{data_parallel_rank="1"} 4.0')
    assert [mismatches for mismatches, _ in results] == [[], []]
    epochs = {epoch for _, epoch in results}
    assert len(epochs) == 2  # each rank is an allocator of its own
    assert service.proc is not None and service.proc.returncode == 0
    assert "tensor-parallel 2, 2 data-parallel ranks" in service.log()
    assert [p for e in epochs for p in SHM_DIR.glob(f"kvalloc-{e:016x}*")] == []
