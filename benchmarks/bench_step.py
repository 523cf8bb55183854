"""Per-step cost of the scheduler step path, side by side in one run.

    python benchmarks/bench_step.py [--quick] [--json] [--batches 64 256 1024] [--steps N]
                                    [--device cpu|cuda] [--layers L] [--out results.json]
                                    [--devices cpu,cpu]

The workload is an overlap scheduler's steady decode: ``batch`` requests, MTP3 (D=3), each step
settles every request's previous grant with a random accepted count (0..D) and grants the next
step; about 0.5 requests per step finish and are replaced by new 1000-token prompts (admitted in
the same step, granted from the next). Pool: tokens_per_block 16, max_seq_len 32768, 200k
blocks; the block table's device copy lives on ``--device``. `DecodeWorkload` yields each step
as integer arrays of handles (a manager's handles are its rows); every measurement runs its own
copy of the same workload.

Measurements (`MEASUREMENTS`, name -> factory) alternate step by step, so all of them see the
same machine state; each reports the median and p99 of its timed part in microseconds:

- ``manager_numpy``, ``manager``: `KVCacheManager.step`, the numpy reference and the compiled
  step (host-only: no KV memory);
- ``manager_cached``: the compiled step with prefix caching on, every new prompt sent with its
  token ids: a shared 512-token system prompt, then its own 488 tokens. Its block hashes are
  computed when it arrives (``KVCacheManager.prompt``, untimed, as an engine hashes a request
  once when it is created); the lookup, the reuse and the registration count in the step;
- ``service_inproc``: `ServiceCore.step` in this process through `Client.in_process`, for an
  attached worker, so it includes the NWOR commit of the previous step; ``commit`` is that
  commit's own time inside it (a host memory copy on a CPU pool; on a CUDA pool the kernels,
  synchronised so their device time counts);
- ``service_inproc_shards`` (with ``--devices``, beside ``service_inproc``): the same step for a
  tensor-parallel service of one shard per device (``cpu,cpu``; ``cuda:0,cuda:0`` or
  ``cuda:0,cuda:1`` on a GPU host), the same batch and the same model, each shard holding its
  share of the KV heads; ``commit_shards`` is its commit on every shard. What a second device
  should add is a table sync and a fence, never anything per layer: the target
  ``shards_over_one`` (its step over the one-pool step) is <= 1.2;
- ``service_inproc_overlap``: the same for a worker registered with ``overlap=True``, stepping at
  lag 2 (`OverlapWorkload`: results one call late, every running request granted behind its
  unsettled step); such a worker commits its own tokens, so the step holds no commit;
- ``ipc``, ``stream``, ``rest_tcp``: the round trip to a real ``kvalloc serve`` subprocess over
  ZeroMQ, over its plain Unix stream socket and over HTTP on TCP, attached too: encoding,
  transport, the service's step, decoding. ``ipc_service``, ``stream_service`` and
  ``rest_tcp_service`` are the service's own mean time for those calls (from
  its step-latency histogram: decoding, the step, encoding), which splits a round trip into the
  service's part and the transport's.

The service's pool has the model shape ``--layers`` x ``--kv-heads`` x ``--head-dim`` (bf16; by
default the embedded 2 x 2 x 64) and as many blocks as the run's steps can fill, so its memory
stays bounded; the manager alone keeps 200k blocks. With ``--json`` the script prints one JSON
object: ``<name>_us`` (median at batch 256) for every measurement, and the full results under
``"batches"``. ``--quick`` runs batch 256 only, with fewer steps. Beside the steps:
``admit_hit_us`` / ``admit_miss_us``, the step that admits one 1000-token prompt whose blocks are
all cached / none of them (median), and ``prefix_hit_rate``, the share of prompt tokens
``manager_cached`` found cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvalloc.allocator import KVCacheManager, PoolConfig, StepOutcome, StepPlan
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepCall, StepResult
from kvalloc.server.devtools.launch import ServiceProcess
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

SPIN_DEFAULT_S = ServiceConfig.model_fields["ipc_spin_s"].default

DRAFT_LEN = 3
PROMPT_LEN = 1000
FINISH_RATE = 0.5  # finished (and replaced) requests per step
TOKENS_PER_BLOCK = 16
MAX_SEQ_LEN = 32768
NUM_BLOCKS = 200_000
REPORTED_BATCH = 256
ADMIT_PER_STEP = 16  # new prompts per step while the batch fills
SYSTEM_PROMPT = np.random.default_rng(12345).integers(0, 32000, 512)


@dataclass(frozen=True)
class StepArrays:
    """One step of the workload, by handle."""

    result_handles: np.ndarray
    num_accepted: np.ndarray
    finished_handles: np.ndarray
    grant_handles: np.ndarray
    draft_lens: np.ndarray
    prompt_lens: np.ndarray  # new requests


class DecodeWorkload:
    """The steady decode workload as a sequence of `StepArrays`.

    ``next_step()`` gives the next step; ``observe(admitted, granted)`` tells the workload which
    handles the new requests got (-1: refused) and which grants were made, so the next step
    settles exactly those.
    """

    def __init__(self, batch: int, seed: int) -> None:
        self.batch = batch
        self.rng = np.random.default_rng(seed)
        self.pending = np.zeros(0, dtype=np.int64)  # handles holding a grant
        self.waiting = np.zeros(0, dtype=np.int64)  # admitted, not granted yet
        self._step: StepArrays | None = None

    @property
    def full(self) -> bool:
        """Every one of the batch's requests runs (the admissions are behind it)."""
        return self.pending.size + self.waiting.size >= self.batch

    def next_step(self) -> StepArrays:
        rng = self.rng
        # Admissions fill the batch a few prompts a step, as a chunked-prefill scheduler would:
        # a step's staging must hold its tokens, and a real model's rows are large.
        new = min(ADMIT_PER_STEP, self.batch - self.pending.size - self.waiting.size)
        results = self.pending
        accepted = rng.integers(0, DRAFT_LEN + 1, size=results.size)
        finished = np.zeros(0, dtype=np.int64)
        if results.size and rng.random() < FINISH_RATE:
            finished = results[rng.integers(0, results.size, size=1)]
            new += 1
        running = np.concatenate([results, self.waiting])
        grants = running[~np.isin(running, finished)] if finished.size else running
        self._step = StepArrays(results, accepted, finished, grants,
                                np.full(grants.size, DRAFT_LEN, dtype=np.int64),
                                np.full(new, PROMPT_LEN, dtype=np.int64))
        return self._step

    def observe(self, admitted: np.ndarray, granted: np.ndarray) -> None:
        assert self._step is not None
        self.pending = self._step.grant_handles[granted]
        self.waiting = admitted[admitted >= 0]


class OverlapWorkload(DecodeWorkload):
    """The same decode at lag 2, as an overlap scheduler steps it: a call's results are for the
    grants of the call before the last, and every running request is granted again while its
    previous step is still unsettled."""

    def __init__(self, batch: int, seed: int) -> None:
        super().__init__(batch, seed)
        self.in_flight: list[np.ndarray] = []  # each recent call's grants, oldest first

    def next_step(self) -> StepArrays:
        rng, empty = self.rng, np.zeros(0, dtype=np.int64)
        newest = self.in_flight[-1] if self.in_flight else empty
        new = min(ADMIT_PER_STEP, self.batch - newest.size - self.waiting.size)
        results = self.in_flight.pop(0) if len(self.in_flight) == 2 else empty
        accepted = rng.integers(0, DRAFT_LEN + 1, size=results.size)
        finished = empty
        if results.size and rng.random() < FINISH_RATE:
            finished = results[rng.integers(0, results.size, size=1)]
            new += 1
        running = np.concatenate([newest, self.waiting])
        grants = running[~np.isin(running, finished)] if finished.size else running
        if finished.size:  # a finish drops its newer step too
            self.in_flight = [f[~np.isin(f, finished)] for f in self.in_flight]
        self._step = StepArrays(results, accepted, finished, grants,
                                np.full(grants.size, DRAFT_LEN, dtype=np.int64),
                                np.full(new, PROMPT_LEN, dtype=np.int64))
        return self._step

    @property
    def full(self) -> bool:
        newest = self.in_flight[-1].size if self.in_flight else 0
        return newest + self.waiting.size >= self.batch

    def observe(self, admitted: np.ndarray, granted: np.ndarray) -> None:
        assert self._step is not None
        self.in_flight.append(self._step.grant_handles[granted])
        self.waiting = admitted[admitted >= 0]


@dataclass(frozen=True)
class Setup:
    """What every measurement of one run shares."""

    batch: int
    seed: int
    device: str
    steps: int = 400
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    remote_workers: int = 1  # transports measured against one kvalloc serve
    ipc_spin_s: float = SPIN_DEFAULT_S  # kvalloc serve --ipc-spin-s
    devices: tuple[str, ...] = ()  # service_inproc_shards: one shard per device

    def pool_config(self) -> PoolConfig:
        return PoolConfig(num_blocks=NUM_BLOCKS, tokens_per_block=TOKENS_PER_BLOCK,
                          num_layers=1, num_kv_heads=1, head_dim=8, device=self.device,
                          max_batch_size=self.batch, max_seq_len=MAX_SEQ_LEN,
                          max_draft_len=DRAFT_LEN)

    def service_config(self, workers: int = 1, devices: tuple[str, ...] = ()) -> ServiceConfig:
        """A pool of the model shape with room for what ``steps`` steps can grow: every
        request of the batch, plus its replacements, to its prompt and 1 + D tokens a step,
        for each of ``workers`` workers (the transports that share one service); with
        ``devices``, split into one tensor-parallel shard per device."""
        steps = self.steps + self.batch // ADMIT_PER_STEP + 1  # timed, and while filling
        requests = self.batch + int(FINISH_RATE * steps) + 1
        tokens = requests * PROMPT_LEN + self.batch * (1 + DRAFT_LEN) * steps
        blocks = workers * (tokens // TOKENS_PER_BLOCK + requests) + 1024
        pool = PoolConfig(num_blocks=blocks, tokens_per_block=TOKENS_PER_BLOCK,
                          num_layers=self.layers, num_kv_heads=self.kv_heads,
                          head_dim=self.head_dim, device=self.device,
                          max_batch_size=workers * (self.batch + 8), max_seq_len=MAX_SEQ_LEN,
                          max_draft_len=DRAFT_LEN)
        return ServiceConfig(pool=pool, max_step_tokens=(self.batch + 8) * (1 + DRAFT_LEN)
                             + (ADMIT_PER_STEP + 1) * PROMPT_LEN,
                             devices=list(devices), tensor_parallel=max(1, len(devices)))

    def serve_flags(self, workers: int) -> list[str]:
        config = self.service_config(workers)
        pool = config.pool
        return [f"--num-blocks={pool.num_blocks}", f"--tokens-per-block={TOKENS_PER_BLOCK}",
                f"--max-seq-len={MAX_SEQ_LEN}", f"--max-batch-size={pool.max_batch_size}",
                f"--max-draft-len={DRAFT_LEN}", f"--num-layers={self.layers}",
                f"--num-kv-heads={self.kv_heads}", f"--head-dim={self.head_dim}",
                f"--device={self.device}", f"--max-step-tokens={config.max_step_tokens}",
                f"--ipc-spin-s={self.ipc_spin_s}",
                # Staging for the workers it serves, not the default's 16: the service refuses a
                # pool and staging larger than the memory free beside this run's own pools.
                f"--max-workers={workers}"]


class Measurement(Protocol):
    """One way of running a step. ``prepare`` and ``observe`` are not timed; ``run`` is."""

    workload: DecodeWorkload

    def prepare(self) -> object: ...

    def run(self, prepared: object) -> object: ...

    def observe(self, result: object) -> None: ...

    def close(self) -> None: ...


class ManagerStep:
    """`KVCacheManager.step` on a row plan (handles are rows)."""

    def __init__(self, setup: Setup, *, compiled: bool) -> None:
        self.manager = KVCacheManager(setup.pool_config(), compiled=compiled)
        self.workload = DecodeWorkload(setup.batch, setup.seed)

    def prepare(self) -> StepPlan:
        s = self.workload.next_step()
        return StepPlan(result_rows=s.result_handles, num_accepted=s.num_accepted,
                        finished_rows=s.finished_handles, grant_rows=s.grant_handles,
                        draft_lens=s.draft_lens, prompt_lens=s.prompt_lens)

    def run(self, prepared: object) -> StepOutcome:
        assert isinstance(prepared, StepPlan)
        return self.manager.step(prepared)

    def observe(self, result: object) -> None:
        assert isinstance(result, StepOutcome)
        self.workload.observe(result.admitted_rows, result.granted)

    def close(self) -> None:
        self.manager.check_invariants()


class ServiceStep:
    """One step call of an attached worker through ``client`` (handles are the service's)."""

    def __init__(self, setup: Setup, client: Client, *, overlap: bool = False) -> None:
        self.client = client
        self.registration = client.register(overlap=overlap)
        self.workload = (OverlapWorkload if overlap else DecodeWorkload)(setup.batch, setup.seed)

    def prepare(self) -> StepCall:
        s = self.workload.next_step()
        reg, client = self.registration, self.client
        return StepCall.build(
            client.worker_id, reg.session, reg.epoch, client.next_step_id,
            result_handles=s.result_handles, num_accepted=s.num_accepted,
            finished_handles=s.finished_handles, grant_handles=s.grant_handles,
            draft_lens=s.draft_lens, prompt_lens=s.prompt_lens,
            new_req_ids=[f"r{client.next_step_id}-{i}" for i in range(s.prompt_lens.size)])

    def run(self, prepared: object) -> StepResult:
        assert isinstance(prepared, StepCall)
        return self.client.send_step(prepared)

    def observe(self, result: object) -> None:
        assert isinstance(result, StepResult)
        step = self.workload._step
        assert step is not None
        granted = np.ones(step.grant_handles.size, dtype=bool)
        granted[result.refused.of_kind("grant")] = False
        self.workload.observe(result.admitted, granted)

    def close(self) -> None:
        self.client.deregister()
        self.client.close()


class InProcessService(ServiceStep):
    """`ServiceCore.step` in this process; also times the commit inside it (``commit``, or
    ``commit_shards`` for the service of one shard per device of ``setup.devices``)."""

    def __init__(self, setup: Setup, *, overlap: bool = False, sharded: bool = False) -> None:
        if sharded and not setup.devices:
            raise SystemExit("service_inproc_shards needs --devices")
        self.core = ServiceCore(setup.service_config(devices=setup.devices if sharded else ()))
        self.commit_name = "commit_shards" if sharded else "commit"
        self.commit_us: list[float] = []
        commit = self.core.pool.commits.write_batch
        synchronize = torch.cuda.synchronize if self.core.device.type == "cuda" else None

        def timed_commit(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            out = commit(*args, **kwargs)
            if synchronize is not None:
                synchronize()
            self.commit_us.append((time.perf_counter_ns() - t0) / 1e3)
            return out

        self.core.pool.commits.write_batch = timed_commit  # type: ignore[method-assign]
        super().__init__(setup, Client.in_process(self.core, worker_id="bench"), overlap=overlap)

    def close(self) -> None:
        super().close()
        self.core.close()


class RemoteService(ServiceStep):
    """The round trip to a real ``kvalloc serve`` process over ``transport``. The transports of
    one run share one process (and so one pool: a GPU holds one of a real model's shape)."""

    _shared: ClassVar[dict[Setup, tuple[ServiceProcess, tempfile.TemporaryDirectory[str],
                                        list[str]]]] = {}

    def __init__(self, setup: Setup, transport: str, *, overlap: bool = False) -> None:
        if setup not in self._shared:
            workdir = tempfile.TemporaryDirectory(prefix="kvbench-")
            flags = setup.serve_flags(setup.remote_workers)
            service = ServiceProcess(Path(workdir.name), *flags).start()
            self._shared[setup] = (service, workdir, [])
        self.setup = setup
        service, _, users = self._shared[setup]
        users.append(f"{transport}_overlap" if overlap else transport)
        address = {"ipc": service.ipc, "stream": service.stream,
                   "rest_tcp": service.rest_tcp}[transport]
        name = f"{transport}_overlap" if overlap else transport
        super().__init__(setup, Client(address, worker_id=f"bench-{name}"), overlap=overlap)
        self.transport = transport
        self.name = name

    def service_time(self) -> tuple[float, int]:
        """The service's own time for this transport's step calls so far (seconds) and their
        count, from its ``kvalloc_step_latency_seconds`` histogram."""
        service = self._shared[self.setup][0]
        with urllib.request.urlopen(f"{service.rest_tcp}/metrics", timeout=10) as response:
            text = response.read().decode()
        label = {"ipc": "ipc", "stream": "stream", "rest_tcp": "rest"}[self.transport]
        found = {}
        for line in text.splitlines():
            for part in ("sum", "count"):
                if line.startswith(f'kvalloc_step_latency_seconds_{part}{{transport="{label}"}}'):
                    found[part] = float(line.split()[-1])
        return found.get("sum", 0.0), int(found.get("count", 0))

    def close(self) -> None:
        super().close()
        service, workdir, users = self._shared[self.setup]
        users.remove(self.name)
        if not users:
            service.stop()
            workdir.cleanup()
            del self._shared[self.setup]


class CachedManagerStep(ManagerStep):
    """The compiled step with prefix caching, new prompts sharing a system prompt."""

    def __init__(self, setup: Setup) -> None:
        self.manager = KVCacheManager(setup.pool_config(), compiled=True, prefix_caching=True)
        self.workload = DecodeWorkload(setup.batch, setup.seed)
        self.rng = np.random.default_rng(setup.seed + 1)

    def prepare(self) -> StepPlan:
        plan = super().prepare()
        own = PROMPT_LEN - SYSTEM_PROMPT.size
        tokens = [self.manager.prompt(np.concatenate([SYSTEM_PROMPT,
                                                      self.rng.integers(0, 32000, own)]))
                  for _ in range(len(plan.prompt_lens))]
        return dataclasses.replace(plan, prompt_tokens=tokens)

    @property
    def hit_rate(self) -> float:
        c = self.manager.counters
        return c.prefix_hit_tokens / max(1, c.prefix_queried_tokens)


def admission_us(steps: int) -> dict[str, float]:
    """Median time of the step that admits one 1000-token prompt, all of its blocks cached
    (the same prompt again) or none (a new one), with the request freed after each."""
    config = Setup(8, 0, "cpu").pool_config()
    manager = KVCacheManager(config, compiled=True, prefix_caching=True)
    rng = np.random.default_rng(0)
    cached = rng.integers(0, 32000, PROMPT_LEN)
    manager.step(StepPlan(finished_rows=manager.step(StepPlan(
        prompt_lens=[PROMPT_LEN], prompt_tokens=[cached])).admitted_rows))
    out = {}
    for name in ("hit", "miss"):
        taken = []
        for _ in range(steps):
            tokens = cached if name == "hit" else rng.integers(0, 32000, PROMPT_LEN)
            plan = StepPlan(prompt_lens=[PROMPT_LEN], prompt_tokens=[tokens])
            t0 = time.perf_counter_ns()
            rows = manager.step(plan).admitted_rows
            taken.append((time.perf_counter_ns() - t0) / 1e3)
            manager.step(StepPlan(finished_rows=rows))
        out[f"admit_{name}_us"] = round(statistics.median(taken[2:]), 1)
    return out


REMOTE = ("ipc", "stream", "stream_overlap", "rest_tcp")  # the measurements of a kvalloc serve
MEASUREMENTS: dict[str, Callable[[Setup], Measurement]] = {
    "manager_numpy": lambda setup: ManagerStep(setup, compiled=False),
    "manager": lambda setup: ManagerStep(setup, compiled=True),
    "manager_cached": CachedManagerStep,
    "service_inproc": InProcessService,
    "service_inproc_overlap": lambda setup: InProcessService(setup, overlap=True),
    "service_inproc_shards": lambda setup: InProcessService(setup, sharded=True),
    "ipc": lambda setup: RemoteService(setup, "ipc"),
    "stream": lambda setup: RemoteService(setup, "stream"),
    "stream_overlap": lambda setup: RemoteService(setup, "stream", overlap=True),
    "rest_tcp": lambda setup: RemoteService(setup, "rest_tcp"),
}


def first_call_seconds(device: str) -> float:
    """Seconds from a fresh compiled manager to its first step's return: numba loading its
    cached code (or compiling it, on a machine's first run)."""
    t0 = time.perf_counter()
    ManagerStep(Setup(8, 0, device), compiled=True).manager.step(
        StepPlan(prompt_lens=[PROMPT_LEN]))
    return time.perf_counter() - t0


def measure(setup: Setup, steps: int, names: list[str]) -> dict[str, dict[str, float]]:
    runs = {name: MEASUREMENTS[name](setup) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    while not all(m.workload.full for m in runs.values()):  # admissions: not timed
        for m in runs.values():
            m.observe(m.run(m.prepare()))
    for m in runs.values():
        if isinstance(m, InProcessService):
            m.commit_us.clear()
    # The service's histogram is by transport: a time per measurement only where its transport
    # serves no other measurement of the run.
    remote = [m.transport for m in runs.values() if isinstance(m, RemoteService)]
    served_before = {name: m.service_time() for name, m in runs.items()
                     if isinstance(m, RemoteService) and remote.count(m.transport) == 1}
    for _ in range(steps):
        for name, m in runs.items():
            prepared = m.prepare()
            t0 = time.perf_counter_ns()
            result = m.run(prepared)
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
            m.observe(result)
    served = {}
    for name, (seconds, count) in served_before.items():
        after_seconds, after_count = runs[name].service_time()  # type: ignore[attr-defined]
        served[f"{name}_service"] = {"mean_us": round(
            (after_seconds - seconds) / max(1, after_count - count) * 1e6, 1)}
    hit_rate = None
    for m in runs.values():
        if isinstance(m, InProcessService) and m.commit_us:  # an overlap worker commits itself
            samples[m.commit_name] = m.commit_us
        if isinstance(m, CachedManagerStep):
            hit_rate = m.hit_rate
        m.close()
    out = {}
    for name, taken in samples.items():
        warm = taken[max(2, len(taken) // 10):]  # past warm-up
        out[name] = {"median_us": round(statistics.median(warm), 1),
                     "p99_us": round(float(np.percentile(warm, 99)), 1)}
    if hit_rate is not None:
        out["prefix_hit_rate"] = {"ratio": round(hit_rate, 3)}
    return out | served


def targets(r: dict[str, float]) -> dict[str, float]:
    """The step path's targets as numbers, each met when <= 1 (or <= the stated microseconds)."""
    out = {}
    if "manager_us" in r and "manager_numpy_us" in r:
        out["compiled_over_numpy"] = r["manager_us"] / r["manager_numpy_us"]
    if "manager_cached_us" in r and "manager_us" in r:
        out["caching_on_over_off"] = r["manager_cached_us"] / r["manager_us"]
    if "service_inproc_us" in r and "commit_us" in r and "manager_us" in r:
        out["service_over_2x_manager_plus_commit"] = (
            r["service_inproc_us"] / (2 * r["manager_us"] + r["commit_us"]))
    if "service_inproc_overlap_us" in r and "manager_us" in r:
        out["overlap_service_over_2x_manager"] = r["service_inproc_overlap_us"] / (
            2 * r["manager_us"])
    if "service_inproc_shards_us" in r and "service_inproc_us" in r:
        out["shards_over_one"] = r["service_inproc_shards_us"] / r["service_inproc_us"]
    for key in ("ipc_us", "stream_us", "rest_tcp_us"):
        if key in r and "service_inproc_us" in r:
            out[f"{key.removesuffix('_us')}_minus_inproc_us"] = r[key] - r["service_inproc_us"]
    if "stream_overlap_us" in r and "service_inproc_overlap_us" in r:
        out["stream_overlap_minus_inproc_overlap_us"] = (r["stream_overlap_us"]
                                                         - r["service_inproc_overlap_us"])
    return {k: round(v, 3) for k, v in out.items()}


def emit(result: dict[str, Any], rows: dict[str, Any], *, out: str | None,
         as_json: bool) -> None:
    """A benchmark's result: written as JSON to ``out`` if given, and printed as JSON or as
    ``rows``, one ``name value`` line each."""
    text = json.dumps(result)
    if out:
        Path(out).write_text(text + "\n")
    if as_json:
        print(text)
        return
    for name, value in rows.items():
        print(f"{name:28s} {value}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024],
                   help="requests per step (default: 64 256 1024)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per batch (default 400, 200 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"batch {REPORTED_BATCH} only (and 200 steps unless --steps says)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--only", nargs="+", choices=list(MEASUREMENTS), default=None,
                   help="run these measurements only (default: all; service_inproc_shards "
                        "only with --devices)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--device", default="cpu",
                   help="where the block table's device copy and the service's pool live")
    p.add_argument("--layers", type=int, default=2, help="the service pool's layers (default 2)")
    p.add_argument("--kv-heads", type=int, default=2, help="its KV heads (default 2)")
    p.add_argument("--head-dim", type=int, default=64, help="its head dim (default 64)")
    p.add_argument("--ipc-spin-s", type=float, default=SPIN_DEFAULT_S,
                   help="the service's kvalloc serve --ipc-spin-s (default: the service's, "
                        f"{SPIN_DEFAULT_S}; 0: it sleeps between calls)")
    p.add_argument("--devices", type=lambda text: tuple(text.split(",")), default=(),
                   help="also measure service_inproc_shards: one tensor-parallel shard per "
                        "device, e.g. cpu,cpu or cuda:0,cuda:1 (--kv-heads must split evenly)")
    p.add_argument("--out", help="also write the JSON results here")
    args = p.parse_args()
    if args.only is None:
        args.only = [name for name in MEASUREMENTS
                     if args.devices or name != "service_inproc_shards"]
    torch.set_num_threads(1)
    batches = [REPORTED_BATCH] if args.quick else args.batches
    steps = args.steps or (200 if args.quick else 400)
    first_call = first_call_seconds(args.device)
    remote = max(1, sum(name in REMOTE for name in args.only))
    per_batch = {str(b): measure(Setup(b, args.seed, args.device, steps, args.layers,
                                       args.kv_heads, args.head_dim, remote, args.ipc_spin_s,
                                       args.devices),
                                 steps, args.only)
                 for b in batches}
    results: dict[str, object] = {
        "benchmark": "bench_step",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, "
                   f"load average {os.getloadavg()[0]:.1f} at the end",
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "service_pool": f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, "
                        "bfloat16",
        "service_ipc_spin_s": args.ipc_spin_s,
        "service_shard_devices": list(args.devices),
        "steps": steps,
        "compiled_first_call_s": round(first_call, 3),
        "batches": per_batch,
        **admission_us(steps),
    }
    if str(REPORTED_BATCH) in per_batch:
        for name, r in per_batch[str(REPORTED_BATCH)].items():
            if name == "prefix_hit_rate":
                results[name] = r["ratio"]
            elif name.endswith("_service"):
                results[f"{name}_mean_us"] = r["mean_us"]
            else:
                results[f"{name}_us"] = r["median_us"]
    results["targets"] = {b: targets({f"{n}_us": v["median_us"] for n, v in r.items()
                                      if "median_us" in v})
                          for b, r in per_batch.items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    if args.json:
        json.dump(results, sys.stdout)
        print()
        return
    names = [n for n, v in next(iter(per_batch.values())).items() if "median_us" in v]
    print(f"compiled step, first call: {first_call:.2f} s")
    print(f"admitting a 1000-token prompt: {results['admit_hit_us']} us all cached, "
          f"{results['admit_miss_us']} us none cached")
    for b, r in per_batch.items():
        if "prefix_hit_rate" in r:
            print(f"batch {b}: shared-prefix hit rate {r['prefix_hit_rate']['ratio']:.1%}")
    print("| requests | " + " | ".join(f"{n} median (us) | p99" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for b, r in per_batch.items():
        cells = " | ".join(f"{r[n]['median_us']:.1f} | {r[n]['p99_us']:.1f}" for n in names)
        print(f"| {b} | {cells} |")
    for b, r in per_batch.items():
        own = {n.removesuffix("_service"): v["mean_us"] for n, v in r.items()
               if n.endswith("_service")}
        if own:
            print(f"batch {b}: the service's own mean time per call (us): {own}")
    for b, t in results["targets"].items():  # type: ignore[union-attr]
        print(f"batch {b}: {t}")


if __name__ == "__main__":
    main()
