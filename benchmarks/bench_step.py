"""Per-step cost of the scheduler step path, side by side in one run.

    python benchmarks/bench_step.py [--quick] [--json] [--batches 64 256 1024] [--steps N]
                                    [--device cpu|cuda] [--out results.json]

The workload is an overlap scheduler's steady decode: ``batch`` requests, MTP3 (D=3), each step
settles every request's previous grant with a random accepted count (0..D) and grants the next
step; about 0.5 requests per step finish and are replaced by new 1000-token prompts (admitted in
the same step, granted from the next). Pool: tokens_per_block 16, max_seq_len 32768, 200k
blocks; the block table's device copy lives on ``--device``. `DecodeWorkload` yields each step
as integer arrays of handles (a manager's handles are its rows); every measurement runs its own
copy of the same workload.

Measurements (`MEASUREMENTS`, name -> factory) alternate step by step, so all of them see the
same machine state; each reports the median and p99 of its timed part in microseconds. With
``--json`` the script prints one JSON object: ``<name>_us`` (median at batch 256) for every
measurement, and the full results under ``"batches"``. ``--quick`` runs batch 256 only, with
fewer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Protocol

import numpy as np

from allocator import KVCacheManager, PoolConfig, StepOutcome, StepPlan

DRAFT_LEN = 3
PROMPT_LEN = 1000
FINISH_RATE = 0.5  # finished (and replaced) requests per step
TOKENS_PER_BLOCK = 16
MAX_SEQ_LEN = 32768
NUM_BLOCKS = 200_000
REPORTED_BATCH = 256


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

    def next_step(self) -> StepArrays:
        rng = self.rng
        if self._step is None and not self.pending.size and not self.waiting.size:
            new = self.batch  # the first step admits the whole batch
        else:
            new = 0
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


@dataclass(frozen=True)
class Setup:
    """What every measurement of one run shares."""

    batch: int
    seed: int
    device: str

    def pool_config(self) -> PoolConfig:
        return PoolConfig(num_blocks=NUM_BLOCKS, tokens_per_block=TOKENS_PER_BLOCK,
                          num_layers=1, num_kv_heads=1, head_dim=8, device=self.device,
                          max_batch_size=self.batch, max_seq_len=MAX_SEQ_LEN,
                          max_draft_len=DRAFT_LEN)


class Measurement(Protocol):
    """One way of running a step. ``prepare`` and ``observe`` are not timed; ``run`` is."""

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


MEASUREMENTS: dict[str, Callable[[Setup], Measurement]] = {
    "manager_numpy": lambda setup: ManagerStep(setup, compiled=False),
    "manager": lambda setup: ManagerStep(setup, compiled=True),
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
    for _ in range(steps):
        for name, m in runs.items():
            prepared = m.prepare()
            t0 = time.perf_counter_ns()
            result = m.run(prepared)
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
            m.observe(result)
    out = {}
    for name, m in runs.items():
        m.close()
        warm = samples[name][max(2, steps // 10):]  # past admission and warm-up
        out[name] = {"median_us": statistics.median(warm),
                     "p99_us": float(np.percentile(warm, 99))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--quick", action="store_true", help=f"batch {REPORTED_BATCH} only, 400 steps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--only", nargs="+", choices=list(MEASUREMENTS), default=list(MEASUREMENTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the block table's device copy lives")
    p.add_argument("--out", help="also write the JSON results here")
    args = p.parse_args()
    batches, steps = ([REPORTED_BATCH], 400) if args.quick else (args.batches, args.steps)
    first_call = first_call_seconds(args.device)
    per_batch = {str(b): measure(Setup(b, args.seed, args.device), steps, args.only)
                 for b in batches}
    results: dict[str, object] = {
        "benchmark": "bench_step",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "device": args.device,
        "steps": steps,
        "compiled_first_call_s": first_call,
        "batches": per_batch,
    }
    if str(REPORTED_BATCH) in per_batch:
        for name, r in per_batch[str(REPORTED_BATCH)].items():
            results[f"{name}_us"] = r["median_us"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    if args.json:
        json.dump(results, sys.stdout)
        print()
        return
    print(f"compiled step, first call: {first_call:.2f} s")
    print("| requests | " + " | ".join(f"{n} median (us) | p99" for n in args.only) + " |")
    print("|---|" + "---|---|" * len(args.only))
    for b, r in per_batch.items():
        cells = " | ".join(f"{r[n]['median_us']:.1f} | {r[n]['p99_us']:.1f}" for n in args.only)
        print(f"| {b} | {cells} |")


if __name__ == "__main__":
    main()
