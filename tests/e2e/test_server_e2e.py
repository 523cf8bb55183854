"""End to end with real processes: ``kvalloc serve`` as a subprocess and workers as separate
processes that attach the pool, stage K/V and drive steps over IPC and REST; several workers at
once; overlap (lag-2) workers over every carrier, each checking its own model of capacity; a
worker killed mid-run, with two steps in flight too; the service restarted under its workers."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.contract.errors import ServiceRestarted
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.devtools.launch import ServiceProcess
from lag2_worker import Lag2Worker
from named_worker import NamedWorker
from service_harness import nwor_scenario

SMALL_POOL = ("--device", "cpu", "--num-blocks", "128", "--tokens-per-block", "4",
              "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8",
              "--max-batch-size", "16", "--max-seq-len", "64", "--max-step-tokens", "128")
WORKER_TIMEOUT_S = 120
# A lag-2 worker process took 2 s to start and run 40 calls on a loaded 2-core machine;
# WORKER_TIMEOUT_S is 60 times that.
LAG2_CALLS = 40
SPAWN = mp.get_context("spawn")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("e2e"), *SMALL_POOL) as svc:
        yield svc


def address(svc: ServiceProcess, transport: str) -> str:
    return {"ipc": svc.ipc, "rest": svc.rest_tcp, "rest-unix": svc.rest_unix}[transport]


def pool_state(svc: ServiceProcess) -> wire.PoolState:
    with Client(svc.ipc, worker_id="observer") as client:
        return client.get_pool(verify=True)


# ---------------------------------------------------------------- what runs in worker processes


def nwor_worker(addr: str, worker_id: str) -> list[str]:
    """Attach the pool over ``addr``, run the NWOR scenario, return the pool's mismatches."""
    torch.set_num_threads(1)
    with Client(addr, worker_id=worker_id) as client:
        client.register()
        outcome = nwor_scenario(client)
        client.deregister()
    return outcome.mismatches


def traffic_worker(addr: str, worker_id: str, steps: int, seed: int) -> int:
    """Random admissions, grants, acceptances and completions; every reply is checked against
    the shared block table. Returns the number of steps applied."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    with Client(addr, worker_id=worker_id) as client:
        reg = client.register()
        assert client.pool is not None
        table, tpb = client.pool.block_table, reg.layout.tokens_per_block
        named = NamedWorker(client)
        age: dict[str, int] = {}
        ran: set[str] = set()
        for step in range(steps):
            done = [r for r, a in age.items() if a > 6 or rng.random() < 0.15]
            keep = [r for r in age if r not in done]
            new = {f"{worker_id}-{step}": int(rng.integers(1, 9))} if len(keep) < 4 else {}
            reply = named.step(results={r: int(rng.integers(0, 3)) for r in ran if r in keep},
                               finished=done, grants={r: 2 for r in keep}, new=new)
            slots = client.pool.slot_mapping(reply).numpy()
            request, _ = reply.scheduled.positions()
            rows = reply.scheduled.rows[request]
            assert (slots >= 0).all()
            for token, row in enumerate(rows.tolist()):
                assert slots[token] // tpb in set(table[row].tolist())
            ran = {name for name, *_ in named.scheduled(reply)} & set(keep)  # granted ones
            admitted = {named.name(h) for h in reply.admitted.tolist() if h >= 0}
            age = {r: age[r] + 1 for r in keep} | {r: 0 for r in new if r in admitted}
        client.deregister()
    return steps


def lag2_worker(addr: str, worker_id: str, seed: int) -> dict[str, int]:
    """Register with overlap, run random lag-2 calls checking every reply against the worker's
    own model (`Lag2Worker`), finish what is left; returns what the schedule exercised."""
    torch.set_num_threads(1)
    with Client(addr, worker_id=worker_id) as client:
        client.register(overlap=True)
        worker = Lag2Worker(client, seed)
        done = worker.run(LAG2_CALLS)
        worker.finish_all()
        client.deregister()
    return dataclasses.asdict(done)


def holding_worker(addr: str, ready: Any, overlap: bool, probe: bool = False) -> None:
    """Admit requests, take a grant (an overlap worker: two, the second behind the first),
    report readiness, then hang (until killed). As a ``probe``: report the longest time between
    two of those calls instead, and deregister."""
    torch.set_num_threads(1)
    client = Client(addr, worker_id="probe" if probe else "doomed")
    gaps, last = [], time.monotonic()

    def timed(reply: Any) -> Any:
        nonlocal last
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        return reply

    timed(client.register(overlap=overlap))
    handles = timed(client.step(new=(["a", "b"], [20, 12]))).admitted
    for _ in range(1 + overlap):
        timed(client.step(grants=(handles, [3, 3])))
    if probe:
        client.deregister()
        ready.put(max(gaps[1:]))
        return
    ready.put(client.get_pool().used_blocks)
    time.sleep(600)


# ---------------------------------------------------------------- specifications


@pytest.mark.parametrize("transport", ["ipc", "rest"])
def test_a_worker_process_commits_exactly_the_accepted_tokens(service: ServiceProcess,
                                                              transport: str) -> None:
    with SPAWN.Pool(1) as pool:
        mismatches = pool.apply_async(
            nwor_worker, (address(service, transport), f"nwor-{transport}")).get(WORKER_TIMEOUT_S)
    assert mismatches == []
    state = pool_state(service)
    assert state.num_requests == 0 and state.invariants == "ok"


def test_a_latent_pool_served_by_the_command_commits_exactly_the_accepted_latents(
        tmp_path: Path) -> None:
    """``kvalloc serve --kv-layout latent``: its start line names the layout, and a worker
    process attaches the one-plane pool and commits its accepted tokens only."""
    latent = ("--device", "cpu", "--num-blocks", "128", "--tokens-per-block", "4",
              "--num-layers", "2", "--kv-layout", "latent", "--num-kv-heads", "1",
              "--head-dim", "72", "--max-batch-size", "16", "--max-seq-len", "64",
              "--max-step-tokens", "128")
    with ServiceProcess(tmp_path, *latent) as svc:
        assert "2 layers x a latent of 72 (latent layout)" in svc.log()
        with SPAWN.Pool(1) as pool:
            mismatches = pool.apply_async(nwor_worker, (svc.ipc, "latent")).get(
                WORKER_TIMEOUT_S)
        assert mismatches == []
        assert pool_state(svc).invariants == "ok"


def test_concurrent_worker_processes_leave_a_consistent_pool(service: ServiceProcess) -> None:
    jobs = [(service.ipc, "w0", 30, 0), (service.ipc, "w1", 30, 1),
            (service.rest_unix, "w2", 20, 2)]
    with SPAWN.Pool(len(jobs)) as pool:
        applied = pool.starmap_async(traffic_worker, jobs).get(WORKER_TIMEOUT_S)
    assert applied == [30, 30, 20]
    state = pool_state(service)
    assert state.invariants == "ok"
    assert (state.num_requests, state.used_blocks, state.workers) == (0, 0, [])
    assert state.counters["requests_added"] == state.counters["requests_freed"] > 0


@pytest.mark.parametrize("transport", ["ipc", "rest"])
def test_a_retried_step_is_answered_again_not_applied_again(service: ServiceProcess,
                                                            transport: str) -> None:
    with Client(address(service, transport), worker_id=f"retry-{transport}") as client:
        reg = client.register(attach=False)
        handle = client.step(new=(["a"], [4])).admitted[0]
        call = StepCall.build(client.worker_id, reg.session, reg.epoch, client.next_step_id,
                              grant_handles=[handle], draft_lens=[3])
        first = client.call("step", call)
        capacity, free = client.get_request("a").capacity, pool_state(service).free_blocks
        assert client.call("step", call) == first
        assert (client.get_request("a").capacity, pool_state(service).free_blocks) == (
            capacity, free)
        client.deregister()


def test_out_of_blocks_is_a_clean_refusal_over_the_wire(service: ServiceProcess) -> None:
    with Client(service.ipc, worker_id="greedy") as client:
        client.register(attach=False)
        named = NamedWorker(client)
        for pair in range(pool_state(service).free_blocks // 32):  # 16 blocks per request
            assert not len(named.step(new={f"h{2 * pair}": 64, f"h{2 * pair + 1}": 64}).refused)
        before = client.get_request("h0")
        reply = named.step(grants={"h0": 3}, new={"late": 4})
        assert named.refused(reply, {"grant": ["h0"], "new": ["late"]}) == [
            ("h0", "grant", "out_of_blocks"), ("late", "new", "out_of_blocks")]
        assert client.get_request("h0") == before and not len(reply.scheduled)
        client.deregister()
    assert pool_state(service).invariants == "ok"


@pytest.mark.parametrize("transport", ["stream", "ipc", "rest"])
def test_a_lag_2_worker_process_keeps_its_model_of_capacity(service: ServiceProcess,
                                                            transport: str) -> None:
    addr = {"stream": service.stream, "ipc": service.ipc, "rest": service.rest_tcp}[transport]
    with SPAWN.Pool(1) as pool:
        done = pool.apply_async(lag2_worker, (addr, f"lag2-{transport}", 7)).get(
            WORKER_TIMEOUT_S)
    assert done["calls"] == LAG2_CALLS and done["behind"] > 10
    state = pool_state(service)
    assert state.invariants == "ok"
    assert (state.num_requests, state.used_blocks, state.workers) == (0, 0, [])


def lease_for_the_holding_worker(svc: ServiceProcess, overlap: bool) -> float:
    """A lease that the holding worker's calls cannot outlast on this machine as it is now: ten
    times the longest gap between two of them, measured in a worker process like it (against
    ``svc``, whose lease is long), and 1 s at least (the reaper looks about once a second)."""
    measured = SPAWN.Queue()
    probe = SPAWN.Process(target=holding_worker, args=(svc.ipc, measured, overlap, True),
                          daemon=True)
    probe.start()
    try:
        return max(1.0, 10 * measured.get(timeout=WORKER_TIMEOUT_S))
    finally:
        probe.join(WORKER_TIMEOUT_S)


@pytest.mark.parametrize("overlap", [False, True], ids=["lag1", "overlap"])
def test_a_killed_worker_loses_its_lease_and_its_blocks_return(service: ServiceProcess,
                                                              tmp_path: Path,
                                                              overlap: bool) -> None:
    lease_s = lease_for_the_holding_worker(service, overlap)
    with ServiceProcess(tmp_path, *SMALL_POOL, "--lease-ttl-s", f"{lease_s:.2f}") as svc:
        ready = SPAWN.Queue()
        doomed = SPAWN.Process(target=holding_worker, args=(svc.ipc, ready, overlap),
                               daemon=True)
        doomed.start()
        try:
            assert ready.get(timeout=WORKER_TIMEOUT_S) > 0  # it holds blocks
            assert svc.epoch is not None
            staging = list(SHM_DIR.glob(f"kvalloc-{svc.epoch:016x}-staging-doomed"))
            assert staging  # its staging segment, while its session lives
        finally:
            doomed.kill()  # SIGKILL: no deregistration, no cleanup in the worker
            doomed.join(10)
        # The lease, the reaper's next look (1 s at most), and as long again for a busy machine
        # ten times over (the lease itself is ten times the worker's slowest call).
        deadline = time.monotonic() + 10 * (lease_s + 1.0)
        while (state := pool_state(svc)).num_requests and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (state.num_requests, state.used_blocks, state.leases_expired) == (0, 0, 1)
        assert state.workers == [] and state.invariants == "ok"
        assert not any(p.exists() for p in staging)
        assert "lease of worker 'doomed' expired" in svc.log()


@pytest.mark.parametrize("transport", ["ipc", "rest"])
def test_a_restarted_service_is_noticed_and_workers_register_again(tmp_path: Path,
                                                                   transport: str) -> None:
    svc = ServiceProcess(tmp_path, *SMALL_POOL).start()
    try:
        with Client(address(svc, transport), worker_id="survivor") as client:
            old = client.register()
            handle = client.step(new=(["a"], [4])).admitted[0]
            old_epoch = svc.epoch
            assert svc.stop() == 0  # SIGTERM: graceful, exit status 0, nothing left behind
            assert not list(SHM_DIR.glob(f"kvalloc-{old_epoch:016x}-*"))
            assert not svc.uds.exists() and not Path(svc.ipc.removeprefix("ipc://")).exists()
            svc.start()  # same addresses, new process
            with pytest.raises(ServiceRestarted):
                client.step(grants=([handle], [1]))
            new = client.register()
            assert new.epoch == svc.epoch != old.epoch
            assert client.pool is not None and client.pool.kv.shape == (2, 2, 128, 4, 1, 8)
            reply = client.step(new=(["a"], [4]))
            assert reply.epoch == new.epoch and client.get_request("a").handle == \
                reply.scheduled.handles[0] == reply.admitted[0]
    finally:
        svc.stop()


def test_a_paused_service_extends_leases_instead_of_expiring_its_workers(tmp_path: Path) -> None:
    """SIGSTOP the service for twice its lease, then SIGCONT: the time it did not run is no
    worker's silence, so the worker steps on with its requests and blocks; a lease still ends
    when the worker, not the service, goes silent (test_a_killed_worker_loses_its_lease...)."""
    with ServiceProcess(tmp_path, *SMALL_POOL, "--lease-ttl-s", "300") as probe, \
            Client(probe.ipc, worker_id="probe") as client:
        started = time.monotonic()
        client.register()
        client.step(new=(["a"], [20]))
        pool_state(probe)
        calls_s = time.monotonic() - started
    # The calls below take calls_s on this machine as it is now: the lease is ten times that, so
    # only the pause can outlast it.
    lease_s = max(2.0, 10 * calls_s)
    with ServiceProcess(tmp_path, *SMALL_POOL, "--lease-ttl-s", f"{lease_s:.1f}") as svc, \
            Client(svc.ipc, worker_id="paused", timeout_s=WORKER_TIMEOUT_S) as client:
        assert svc.proc is not None
        client.register()
        handle = client.step(new=(["a"], [20])).admitted[0]
        used = pool_state(svc).used_blocks
        svc.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2 * lease_s)
        finally:
            svc.proc.send_signal(signal.SIGCONT)
        reply = client.step(grants=([handle], [1]))
        state = pool_state(svc)
        assert np.asarray(reply.scheduled.handles).tolist() == [handle]
        assert (state.leases_expired, [w.worker_id for w in state.workers]) == (0, ["paused"])
        assert state.used_blocks >= used and state.num_requests == 1
        assert "did not run for" in svc.log()
