"""A tensor-parallel worker of two processes against a real ``kvalloc serve --devices cpu,cpu
--tensor-parallel 2``: each rank holds its shard of the tiny Llama (half its KV heads) and maps
its own shard of the pool; rank 0 alone calls the service and hands every reply to the other.
Each rank poisons its shard of the pool with NaN first, so a read of anything not committed shows
in the tokens. The tokens equal ``model.generate``'s, synchronously and one step ahead, with
drafts from the device oracle (about half accepted), on both ranks, with no block-table entry
read that holds no block. On one GPU both shards and both ranks share ``cuda:0`` (gloo carries
the model's sums); on two, rank r and shard r are on ``cuda:r`` and NCCL carries them.
A worker whose ranks are not the service's shards is refused on every rank, and leaves no
session behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.devtools.launch import ServiceProcess
from kvalloc.worker.errors import EngineError
from kvalloc.worker.parallel.local_ranks import run_local_ranks
from kvalloc.worker.shard_client import ShardClient
from shard_ranks import generate, refused
from worker_oracle import MAX_DRAFT_LEN, TOKENS_PER_BLOCK, Oracle, assert_acceptance

WORLD = 2
POOL = ("--dtype", "float32", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
        "--num-blocks", "256", "--tokens-per-block", str(TOKENS_PER_BLOCK), "--max-seq-len",
        "96", "--max-draft-len", str(MAX_DRAFT_LEN), "--max-batch-size", "8",
        "--max-step-tokens", "48")
DEVICES = [("cpu", "cpu"), pytest.param(("cuda:0", "cuda:0"), marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param(("cuda:0", "cuda:1"), marks=[pytest.mark.gpu, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two GPUs")])]
# Two ranks importing torch and transformers and running the 8 prompts took about 40 s on the
# loaded two-core machine; the limit is several times that.
RUN_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT_S)
pytest_plugins = ["worker_fixtures"]


@pytest.fixture(scope="module", params=DEVICES, ids=",".join)
def sharded_service(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[ServiceProcess, tuple[str, str]]]:
    """A service of two shards on the devices (shard r on the r-th), and the devices."""
    devices = request.param
    sharded = ("--devices", ",".join(devices), "--tensor-parallel", str(WORLD))
    with ServiceProcess(tmp_path_factory.mktemp("tp"), *POOL, *sharded, tcp=False) as svc:
        yield svc, devices


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_two_ranks_give_generates_tokens(llama_oracle: Oracle,
                                         sharded_service: tuple[ServiceProcess, tuple[str, str]],
                                         overlap: bool) -> None:
    service, devices = sharded_service
    two_gpus = devices[0] != devices[1]
    ranks = run_local_ranks(generate, WORLD, service.stream, llama_oracle.prompts,
                            llama_oracle.expected, overlap, MAX_DRAFT_LEN, 0.5, devices,
                            backend="nccl" if two_gpus else "gloo", timeout_s=RUN_TIMEOUT_S)
    assert [heads for _, _, heads in ranks] == [(0, 1), (1, 2)]
    for outputs, stats, _ in ranks:
        assert outputs == llama_oracle.expected
        assert stats["table_violations"] == 0
    stats = ranks[0][1]
    assert_acceptance(_Stats(stats), 0.5)
    if overlap:
        assert stats["forwards_ahead"] > stats["steps"] // 2
    with Client(service.stream, worker_id="observer") as client:
        pool = client.get_pool(verify=True)
    assert pool.num_requests == 0 and pool.used_blocks == 0


def test_ranks_that_are_not_the_services_shards_are_refused_on_every_rank(
        tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, *POOL, "--device", "cpu", tcp=False) as plain:
        errors = run_local_ranks(refused, WORLD, plain.stream, timeout_s=RUN_TIMEOUT_S)
        with Client(plain.stream, worker_id="observer") as client:
            assert client.get_pool().workers == []
    assert errors == ["EngineError: tensor_parallel: a worker of 2 ranks: shard: the service "
                      "has one pool, not tensor-parallel shards"] * WORLD


class _Stats:
    """`assert_acceptance` reads attributes."""

    def __init__(self, figures: dict[str, float]) -> None:
        self.__dict__.update(figures)


def test_only_rank_0_holds_the_client() -> None:
    with pytest.raises(EngineError, match="rank 0, and only rank 0"):
        ShardClient(1, WORLD, Client.__new__(Client))
    with pytest.raises(EngineError, match="rank 0, and only rank 0"):
        ShardClient(0, WORLD, None)
