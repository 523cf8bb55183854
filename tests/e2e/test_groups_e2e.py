"""A real ``kvalloc serve --layer-group ...``: its start line names the groups, a worker process
maps every group from the registration's handles (shared memory) and each group's pool holds
exactly the committed tokens at its own table's slots; a worker that does not attach is refused
naming ``attached``; groups that do not partition the layers exit 2 naming the flag."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import RemoteError
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command
from service_harness import nwor_scenario

GROUPED_POOL = ("--device", "cpu", "--num-blocks", "128", "--tokens-per-block", "4",
                "--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "8",
                "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "128",
                "--layer-group", "full:0,2:128", "--layer-group", "sliding:1:32:8")
WORKER_TIMEOUT_S = 120  # a worker process starts and runs the scenario in seconds
START_TIMEOUT_S = 120  # imports and the check, on a loaded machine
SPAWN = mp.get_context("spawn")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("groups"), *GROUPED_POOL,
                        ready_timeout_s=START_TIMEOUT_S) as svc:
        yield svc


def grouped_worker(addr: str) -> tuple[list[str], list[tuple[tuple[int, ...] | None, int | None,
                                                             list[int]]]]:
    """The NWOR scenario's mismatches, and each mapped group's layers, window and pool shape."""
    torch.set_num_threads(1)
    with Client(addr, worker_id="grouped") as client:
        client.register()
        assert client.pool is not None
        groups = [(g.layers, g.window, list(g.kv.shape)) for g in client.pool.groups]
        outcome = nwor_scenario(client)
        client.deregister()
    return outcome.mismatches, groups


def test_the_start_line_names_the_groups(service: ServiceProcess) -> None:
    assert ("groups full (layers 0,2, 128 blocks), sliding (layers 1, 32 blocks, window 8)"
            in service.log())


def test_a_worker_process_maps_every_group_and_each_holds_the_committed_tokens(
        service: ServiceProcess) -> None:
    with SPAWN.Pool(1) as pool:
        mismatches, groups = pool.apply_async(grouped_worker, (service.stream,)).get(
            WORKER_TIMEOUT_S)
    assert groups == [((0, 2), None, [2, 2, 128, 4, 2, 8]), ((1,), 8, [1, 2, 32, 4, 2, 8])]
    assert mismatches == []


def test_a_worker_that_does_not_attach_is_refused(service: ServiceProcess) -> None:
    with Client(service.ipc, worker_id="remote") as client, pytest.raises(
            RemoteError, match="422 attach_required: attached: a grouped pool"):
        client.register(attach=False)


@pytest.mark.parametrize(("flags", "message"), [
    (("--num-layers", "3", "--layer-group", "full:0-1:64"),
     "--layer-group: groups: the groups' layers [0, 1] do not partition the pool's 3 layers"),
    (("--layer-group", "full:0-1"), "argument --layer-group: 'full:0-1' is not "
                                    "NAME:LAYERS:BLOCKS[:WINDOW]"),
])
def test_groups_that_do_not_make_a_pool_exit_2_naming_the_flag(tmp_path: Path, flags: tuple,
                                                               message: str) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with subprocess.Popen([*kvalloc_command(), "serve", "--port", "0", "--device", "cpu",
                           *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(run)}) as proc:
        out, err = proc.communicate(timeout=START_TIMEOUT_S)
    assert proc.returncode == 2, out + err
    assert message in err and "Traceback" not in err
