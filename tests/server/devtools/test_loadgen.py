"""`kvalloc loadgen`: a simulated overlap-scheduler worker that never breaks the step protocol,
keeps a real service core consistent under block pressure, and reports latency and errors.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.commands.simulated_acceptance import Acceptance
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import NO_VALUES, Refused
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command
from kvalloc.server.devtools.loadgen import SimulatedWorker, Workload, drive
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from sigint import interrupt_once_progressing

ROOT = Path(__file__).resolve().parents[3]
D = 3
METRICS_TIMEOUT_S = 30  # the service copies its state at least once a second


@pytest.fixture
def core():
    pool = PoolConfig(num_blocks=96, tokens_per_block=16, max_batch_size=16, max_seq_len=1024,
                      max_draft_len=D + 1, num_layers=1, num_kv_heads=1, head_dim=8,
                      device="cpu")
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=256))
    yield core
    core.close()


def fake_reply(refused: dict[str, list[int]], admitted: list[int]) -> SimpleNamespace:
    """What `SimulatedWorker.apply` reads of a reply: refusals (indices per kind), handles and
    cached prefixes (none here)."""
    kinds = {"grant": 0, "prefill": 1, "new": 2}
    pairs = [(kinds[k], i) for k, ids in refused.items() for i in ids]
    return SimpleNamespace(
        refused=Refused(np.array([k for k, _ in pairs], dtype=np.int64),
                        np.array([i for _, i in pairs], dtype=np.int64),
                        np.ones(len(pairs), dtype=np.int64)) if pairs else
        Refused(NO_VALUES, NO_VALUES, NO_VALUES),
        admitted=np.array(admitted, dtype=np.int64),
        cached_tokens=np.zeros(len(admitted), dtype=np.int64))


def test_every_step_settles_each_scheduled_request_exactly_once():
    """Each request granted in step n is in exactly one of results / reverts / finished in step
    n + 1; grants go only to requests whose prompt was scheduled in earlier steps; accepted <=
    granted; padding >= granted; a step schedules at most max_step_tokens."""
    worker = SimulatedWorker(Workload(draft_len=D, arrival_rate=2.0, skip_rate=0.2,
                                      pad_rate=0.5), max_draft_len=D + 1, max_step_tokens=300,
                             seed=1)
    rng = np.random.default_rng(2)
    handles = iter(range(1 << 20, 1 << 30))
    granted: dict[int, int] = {}
    prompt_left: dict[int, int] = {}  # of admitted requests, after the previous step
    for _ in range(300):
        prefilled = {r for r, left in prompt_left.items() if left == 0}
        step = worker.next_step()
        (result_handles, accepted) = step["results"]
        settled = [*result_handles, *step["reverts"], *step["finished"]]
        assert len(settled) == len(set(settled))
        assert set(granted) <= set(settled)
        for h, n in zip(result_handles, accepted, strict=True):
            assert n <= granted[h]
        for h in step["finished"]:
            prompt_left.pop(h)
        grants = dict(zip(*step["grants"], strict=True))
        assert set(grants) <= prefilled
        padded = dict(zip(*step["padding"], strict=True))
        assert all(padded[r] >= grants[r] for r in padded)
        new_ids, prompts, chunks = step["new"]
        tokens = (sum(1 + padded.get(r, d) for r, d in grants.items())
                  + sum(step["prefill"][1]) + sum(chunks))
        assert tokens <= 300
        # the "service" refuses a random fifth of everything it can refuse
        refused = {kind: [i for i in range(n) if rng.random() < 0.2] for kind, n in (
            ("grant", len(grants)), ("prefill", len(step["prefill"][0])), ("new", len(new_ids)))}
        admitted = [-1 if i in refused["new"] else next(handles) for i in range(len(new_ids))]
        worker.take_reply(fake_reply(refused, admitted))
        out_grants = {step["grants"][0][i] for i in refused["grant"]}
        granted = {g: d for g, d in grants.items() if g not in out_grants}
        for h, n in zip(*step["prefill"], strict=True):
            prompt_left[h] -= n
        for h, prompt, chunk in zip(admitted, prompts, chunks, strict=True):
            if h >= 0:
                prompt_left[h] = prompt - chunk
    assert worker.stats["preempted"] > 0 and worker.stats["finished"] > 0
    assert worker.stats["prefills_refused"] > 0


def test_drives_a_real_service_core_under_block_pressure_without_a_protocol_error(core):
    worker = SimulatedWorker(Workload(draft_len=D, arrival_rate=1.0, prompt_len=(16, 512),
                                      output_len=(8, 64)), max_draft_len=D + 1,
                             max_step_tokens=core.config.max_step_tokens)
    client = Client.in_process(core, worker_id="loadgen")
    client.register(attach=False)
    report = drive(client, worker, steps=400, duration_s=None, step_interval_s=0,
                   progress=False)
    assert report.errors == {}
    assert report.steps == len(report.latencies_s) == 400
    assert worker.stats["grants_refused"] > 0, "the pool was under pressure"
    assert worker.stats["finished"] > 0 and worker.stats["preempted"] > 0
    core.manager.check_invariants()
    assert core.manager.counters.padding_topups > 0

    # Drain: no arrivals; every request finishes or is preempted and every block comes back.
    worker.w = Workload(draft_len=D, arrival_rate=0.0, output_len=(8, 64))
    drive(client, worker, steps=200, duration_s=None, step_interval_s=0, progress=False)
    assert not worker.live
    assert core.manager.free_blocks == core.manager.pool.num_blocks


def test_a_refused_call_is_counted_and_the_worker_starts_over(core):
    worker = SimulatedWorker(Workload(arrival_rate=2.0), max_draft_len=D + 1,
                             max_step_tokens=core.config.max_step_tokens)
    client = Client.in_process(core, worker_id="loadgen")
    client.register(attach=False)
    drive(client, worker, steps=5, duration_s=None, step_interval_s=0, progress=False)
    # The service restarted in all but name: this session is gone, and the id is free.
    core.deregister(wire.WorkerRef(worker_id="loadgen", session=client.registration.session))
    report = drive(client, worker, steps=20, duration_s=None, step_interval_s=0,
                   progress=False)
    assert report.errors == {"unknown_worker": 1}
    assert len(report.latencies_s) == 19, "every other step went through"


@pytest.mark.parametrize("replace", [False, True])
def test_a_worker_whose_id_was_taken_over_takes_it_back_only_when_told(core, replace):
    """A zombie run and its successor under one id: without ``replace`` the zombie stops at its
    first refused call and the successor keeps its session; with it, the zombie takes the id
    back (and the successor would in turn: the fencing undone, as asked)."""
    zombie = Client.in_process(core, worker_id="loadgen")
    zombie.register(attach=False)
    successor = Client.in_process(core, worker_id="loadgen")
    successor.register(attach=False, replace=True)
    worker = SimulatedWorker(Workload(), max_draft_len=D + 1,
                             max_step_tokens=core.config.max_step_tokens)
    report = drive(zombie, worker, steps=20, duration_s=None, step_interval_s=0,
                   progress=False, register=lambda: zombie.register(attach=False,
                                                                    replace=replace))
    assert len(core.registry) == 1
    live = core.registry.get("loadgen")
    assert live is not None
    if replace:
        assert report.errors == {"stale_session": 1} and report.steps == 20
        assert live.session == zombie.registration.session
    else:
        assert report.errors == {"stale_session": 1, "register: RemoteError": 1}
        assert report.steps == 0 and live.session == successor.registration.session


def test_accepted_counts_follow_the_acceptance_model():
    worker = SimulatedWorker(Workload(acceptance=Acceptance("fixed", 2), arrival_rate=1.0,
                                      skip_rate=0.0), max_draft_len=D, max_step_tokens=4096)
    handles = iter(range(1 << 20, 1 << 30))
    for _ in range(50):
        step = worker.next_step()
        assert all(n == min(2, worker.w.draft_len) for n in step["results"][1])
        worker.take_reply(fake_reply({}, [next(handles) for _ in step["new"][0]]))


# ---------------------------------------------------------------- the CLI against `kvalloc serve`


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with ServiceProcess(tmp_path_factory.mktemp("serve"), "--num-blocks", "512",
                        "--max-draft-len", "4") as svc:
        yield svc


def loadgen(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*kvalloc_command(), "loadgen", "--no-progress",
                           "--json", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.mark.parametrize("transport", ["ipc", "rest"])
def test_cli_runs_its_steps_over_either_transport_and_reports_latency(service, transport):
    address = service.ipc if transport == "ipc" else service.rest_tcp
    r = loadgen("--address", address, "--steps", "150", "--step-interval", "0",
                "--worker-id", f"test-{transport}")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert summary["steps"] == 150 and summary["errors"] == {}
    assert 0 < summary["latency_ms"]["p50"] <= summary["latency_ms"]["p99"]
    assert summary["admitted"] > 0 and summary["output_tokens"] > 0


@pytest.mark.parametrize("steps", [["--steps", "1000000"], []])
def test_cli_stops_at_its_duration(service, steps):
    """With --steps, whichever comes first; alone, --duration means "for this long", not the
    1000 steps of a run with neither flag (at 0 s between calls those take well under 3 s)."""
    r = loadgen("--address", service.ipc, *steps, "--duration", "3", "--step-interval", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert 3.0 <= summary["seconds"] < 6.0  # one step past the deadline at most, on a busy CPU
    assert summary["steps"] != 1000


def test_cli_prints_a_human_summary(service):
    r = subprocess.run([*kvalloc_command(), "loadgen", "--no-progress",
                        "--address", service.rest_tcp, "--steps", "20", "--step-interval", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("kvalloc loadgen: 20 steps in ") and service.rest_tcp in lines[0]
    assert "step call latency: p50" in r.stdout and "errors: none" in r.stdout


@pytest.mark.parametrize("address", ["http://127.0.0.1:9", "ipc:///nonexistent/kvalloc.ipc"])
def test_cli_exits_2_with_a_message_when_no_service_answers(address):
    r = loadgen("--address", address, "--steps", "3")
    assert r.returncode == 2
    assert f"cannot register at {address}" in r.stderr
    assert f"is kvalloc serve running at {address}?" in r.stderr
    assert "Traceback" not in r.stderr


def test_ctrl_c_prints_a_partial_summary_deregisters_and_exits_130(service):
    """SIGINT to a real loadgen mid-run: the step in flight completes, it deregisters (its blocks
    are free at once, not after its lease), prints what it ran and exits 130, no traceback."""
    r = interrupt_once_progressing(
        [*kvalloc_command(), "loadgen", "--json", "--address", service.stream,
         "--worker-id", "interrupted", "--duration", "600", "--step-interval", "0.01"],
        r"[1-9]\d*step", timeout_s=120)
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    summary = json.loads(r.stdout)
    assert summary["interrupted"] is True and summary["steps"] > 0
    assert summary["errors"] == {} and summary["admitted"] > 0
    with Client(service.stream, worker_id="observer") as client:
        pool = client.get_pool()
    assert [w.worker_id for w in pool.workers] == []
    assert pool.used_blocks == 0 and pool.num_requests == 0


def rank_counter(svc: ServiceProcess, rank: int) -> float:
    """``kvalloc_requests_added_total`` of data-parallel rank ``rank`` on ``/metrics``."""
    prefix = f'kvalloc_requests_added_total{{data_parallel_rank="{rank}"}} '
    with urllib.request.urlopen(f"{svc.rest_tcp}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return next((float(line[len(prefix):]) for line in lines if line.startswith(prefix)), 0.0)


def test_cli_loads_the_data_parallel_rank_it_names(tmp_path: Path):
    """Against a service of two ranks a run must name its rank (the service refuses one that
    does not, and loadgen exits 2 saying why); a run of rank 1 admits requests on rank 1 alone."""
    ranks = ("--devices", "cpu,cpu", "--tensor-parallel", "1", "--num-blocks", "512",
             "--max-draft-len", "4")
    with ServiceProcess(tmp_path, *ranks) as svc:
        unnamed = loadgen("--address", svc.stream, "--steps", "5")
        assert unnamed.returncode == 2 and "unknown_rank" in unnamed.stderr, unnamed.stderr
        r = loadgen("--address", svc.stream, "--steps", "60", "--step-interval", "0",
                    "--data-parallel-rank", "1", "--worker-id", "rank-1")
        assert r.returncode == 0, r.stdout + r.stderr
        admitted = json.loads(r.stdout)["admitted"]
        assert admitted > 0
        # Scrapes serve the state as last copied: after a step, or within a second.
        deadline = time.monotonic() + METRICS_TIMEOUT_S
        while rank_counter(svc, 1) < admitted and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rank_counter(svc, 1) >= admitted and rank_counter(svc, 0) == 0.0


def test_cli_says_when_it_drafts_less_than_asked(service):
    """A --draft-len beyond the service's max_draft_len (4 here) drafts that many, and says so
    on stderr; one within it says nothing."""
    r = loadgen("--address", service.stream, "--steps", "20", "--step-interval", "0",
                "--draft-len", "9", "--worker-id", "clamped")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("kvalloc loadgen: --draft-len 9 is more than the service's max_draft_len 4: "
            "drafting 4") in r.stderr
    r = loadgen("--address", service.stream, "--steps", "5", "--step-interval", "0",
                "--draft-len", "4", "--worker-id", "unclamped")
    assert r.returncode == 0 and "--draft-len" not in r.stderr, r.stderr
