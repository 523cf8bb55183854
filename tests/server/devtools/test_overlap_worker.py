"""`kvalloc loadgen --overlap`: the simulated worker one step ahead reports each forward two calls
after its grant (a skipped one's revert one call after), grants requests behind their unsettled
step, keeps a real service core consistent under block pressure and gives every block back; the
command against a real `kvalloc serve` runs, reports its figures and leaves the pool empty.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kvalloc.allocator import PoolConfig
from kvalloc.server.client import Client
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command
from kvalloc.server.devtools.loadgen import _human, drive
from kvalloc.server.devtools.overlap_worker import OverlapSimulatedWorker
from kvalloc.server.devtools.simulated_worker import Workload
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

ROOT = Path(__file__).resolve().parents[3]
D = 3


@pytest.fixture
def core():
    pool = PoolConfig(num_blocks=96, tokens_per_block=16, max_batch_size=16, max_seq_len=1024,
                      max_draft_len=D + 1, num_layers=1, num_kv_heads=1, head_dim=8,
                      device="cpu")
    # The lease must outlast the first call's compile in this process.
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=256, lease_ttl_s=3600))
    yield core
    core.close()


def overlap_worker(core: ServiceCore, **workload: object) -> OverlapSimulatedWorker:
    return OverlapSimulatedWorker(Workload(draft_len=D, **workload), max_draft_len=D + 1,
                                  max_step_tokens=core.config.max_step_tokens, seed=3)


def test_results_come_two_calls_after_their_grant_and_reverts_one(core):
    """Call n reports only forwards granted by call n-2 and reverts only those of call n-1;
    every forward of call n-2 that was neither reverted nor finished is reported by call n;
    and requests are granted again while their previous step is unsettled."""
    worker = overlap_worker(core, arrival_rate=1.0, output_len=(8, 64), skip_rate=0.1)
    client = Client.in_process(core, worker_id="overlap")
    client.register(attach=False, overlap=True)
    granted: list[set[int]] = []  # per call: the grants the service took
    finished: set[int] = set()
    previous_reverts: set[int] = set()
    behind = 0
    for n in range(300):
        step = worker.next_step()
        results, reverts = set(step["results"][0]), set(step["reverts"])
        finished |= set(step["finished"])
        two_back = granted[n - 2] if n >= 2 else set()
        one_back = granted[n - 1] if n >= 1 else set()
        assert results <= two_back and reverts <= one_back
        assert two_back - previous_reverts - finished <= results
        behind += len(set(step["grants"][0]) & (one_back - reverts))
        reply = client.step(**step)
        worker.take_reply(reply)
        refused = set(reply.refused.of_kind("grant").tolist())
        granted.append({h for i, h in enumerate(step["grants"][0]) if i not in refused})
        previous_reverts = reverts
    assert behind > 0 and worker.stats["grants_behind"] > 0
    assert worker.stats["reverts"] > 0 and worker.stats["finished"] > 0


def test_drives_a_real_service_core_under_block_pressure_and_gives_every_block_back(core):
    worker = overlap_worker(core, arrival_rate=1.0, output_len=(8, 64))
    client = Client.in_process(core, worker_id="overlap")

    def register() -> object:
        return client.register(attach=False, overlap=True)

    register()
    report = drive(client, worker, steps=400, duration_s=None, step_interval_s=0,
                   progress=False, register=register)
    assert report.errors == {}
    assert worker.stats["grants_refused"] > 0, "the pool was under pressure"
    assert worker.stats["preempted"] > 0 and worker.stats["grants_behind"] > 0
    core.manager.check_invariants()
    text = _human({**report.summary(), "overlap": True})  # what the command prints
    assert text.splitlines()[0].endswith("one step ahead (lag 2)")
    assert f"grants behind an unsettled step {worker.stats['grants_behind']}" in text

    # Drain: no arrivals; every request finishes or is preempted and every block comes back.
    worker.w = Workload(draft_len=D, arrival_rate=0.0, output_len=(8, 64))
    drive(client, worker, steps=200, duration_s=None, step_interval_s=0, progress=False,
          register=register)
    assert not worker.live and not worker.forwards
    assert core.manager.free_blocks == core.manager.pool.num_blocks


def test_the_command_runs_one_step_ahead_against_kvalloc_serve_and_leaves_nothing(tmp_path):
    """A real `kvalloc serve` (lag 2 needs no flag of its own: any service takes overlap
    workers) and a real `kvalloc loadgen --overlap` process: exit 0, steps and no error, and
    the pool verifies with no request and no block left once it deregistered."""
    with ServiceProcess(tmp_path, "--num-blocks", "512", "--max-draft-len", "4") as svc:
        r = subprocess.run([*kvalloc_command(), "loadgen", "--overlap", "--no-progress",
                            "--json", "--address", svc.stream, "--duration", "3",
                            "--step-interval", "0", "--skip-rate", "0.1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        summary = json.loads(r.stdout)
        assert summary["overlap"] is True and summary["steps"] > 0 and summary["errors"] == {}
        assert summary["admitted"] > 0 and summary["grants_behind"] > 0
        assert summary["reverts"] > 0 and summary["latency_ms"]["p50"] > 0
        with Client(svc.stream, worker_id="observer") as client:
            pool = client.get_pool(verify=True)
        assert pool.invariants == "ok" and pool.workers == []
        assert pool.num_requests == 0 and pool.used_blocks == 0
