"""On the GPU (run on the device: benchmarks/gpu_check.sh): a worker process attaches the pool, the
block table and its staging buffer through CUDA IPC handles, and interprocess CUDA events order
its forward before the service's commit and the commit before its next forward.

The forward is made slow on purpose (a device sleep before the staging writes, while the host
sends the step at once), so a commit that did not wait for ``forward_done`` would read stale
staging; the control test shows that it would.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.devtools.launch import ServiceProcess
from service_harness import nwor_scenario

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_POOL = ("--device", "cuda", "--num-blocks", "256", "--tokens-per-block", "16",
            "--num-layers", "4", "--num-kv-heads", "8", "--head-dim", "128",
            "--max-batch-size", "16", "--max-seq-len", "512", "--max-step-tokens", "256")
SLOW_FORWARD_CYCLES = 400_000_000  # a few hundred ms of device time before the staging writes
TIMEOUT_S = 180
SPAWN = mp.get_context("spawn")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("gpu"), *GPU_POOL, tcp=False) as svc:
        yield svc


def slow_forward() -> None:
    torch.cuda._sleep(SLOW_FORWARD_CYCLES)


def cuda_worker(addr: str, worker_id: str, fenced: bool) -> dict[str, object]:
    """Attach through CUDA IPC and run the NWOR scenario with a slow forward."""
    with Client(addr, worker_id=worker_id) as client:
        reg = client.register()
        assert client.pool is not None
        handles = reg.attachment
        attached = {
            "cuda_handles": all(h.cuda is not None and h.shm is None
                                for h in (handles.kv, handles.block_table, handles.staging)),
            "events": handles.forward_done is not None and handles.commit_done is not None,
            "on_device": client.pool.kv.is_cuda and client.pool.staging.is_cuda,
        }
        if not fenced:
            client.pool.fence = None  # the control: no event ordering at all
        outcome = nwor_scenario(client, slow_forward)
        torch.cuda.synchronize()
        client.deregister()
    return {**attached, "mismatches": outcome.mismatches, "written": outcome.commit.written}


def run_worker(svc: ServiceProcess, worker_id: str, fenced: bool) -> dict[str, object]:
    with SPAWN.Pool(1) as pool:
        return pool.apply_async(cuda_worker, (svc.ipc, worker_id, fenced)).get(TIMEOUT_S)


def test_a_cuda_ipc_worker_commits_exactly_the_accepted_tokens(service: ServiceProcess) -> None:
    result = run_worker(service, "gpu-fenced", fenced=True)
    assert result["cuda_handles"] and result["events"] and result["on_device"]
    assert result["mismatches"] == []
    assert result["written"] == 5


def test_without_the_fence_the_commit_would_race_the_forward(service: ServiceProcess) -> None:
    """Control: the scenario above can fail. Without events the service commits staging the slow
    forward has not written yet, so the pool ends up wrong."""
    result = run_worker(service, "gpu-unfenced", fenced=False)
    assert result["mismatches"], "the slow forward did not expose the missing ordering"


def test_a_cuda_pool_is_shared_without_shared_memory_files(service: ServiceProcess) -> None:
    """The handles name the service's own device allocations: nothing goes through /dev/shm."""
    assert not list(Path("/dev/shm").glob(f"kvalloc-{service.epoch:016x}-*"))


def test_an_in_process_worker_on_a_cuda_pool_commits_exactly_the_accepted_tokens() -> None:
    """An engine that embeds the core uses its tensors directly (a process cannot open its own
    CUDA IPC handles), with the same result as a worker process."""
    from kvalloc.allocator import PoolConfig
    from kvalloc.server.service.core import ServiceCore
    from kvalloc.server.service.settings import ServiceConfig

    core = ServiceCore(ServiceConfig(pool=PoolConfig(
        device="cuda", num_blocks=256, tokens_per_block=16, num_layers=4, num_kv_heads=8,
        head_dim=128, max_batch_size=16, max_seq_len=512), max_step_tokens=256))
    try:
        client = Client.in_process(core, worker_id="embedded")
        client.register()
        assert client.pool is not None
        assert client.pool.kv.data_ptr() == core.pool.storage.kv.data_ptr()
        outcome = nwor_scenario(client, slow_forward)
        torch.cuda.synchronize()
        assert outcome.mismatches == [] and outcome.commit.written == 5
        core.check_invariants()
    finally:
        core.close()
