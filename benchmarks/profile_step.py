"""Where the in-process service step spends its time, phase by phase.

    python benchmarks/profile_step.py [--device cpu|cuda] [--batch 256] [--steps 300]
                                      [--layers L] [--kv-heads H] [--head-dim D] [--json]
                                      [--out results.json]

Runs `bench_step`'s decode workload (MTP3, ~0.5 finishes a step) through `ServiceCore.step` in
this process and times, around each call, the phases the step is made of: the registry's handle
checks and admissions, the manager's step (and inside it the block table's upload), the layout,
and the commit with its NWOR window (open, stage, then the slot upload and the fused write, or on
CUDA the graph replay that does both). Each phase called in the timed steps reports its median
there, in microseconds; nested phases are part of their
parents, so the figures do not add up. On a CUDA pool the commit is synchronised, as in
`bench_step`, so the device's time counts in ``commit``; no other phase waits for the device.

The phases are timed by wrapping the methods (a few hundred nanoseconds each): use the figures
to see where a step goes, and `bench_step.py` for the step's own time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
from kvalloc.allocator.nwor.deferred import pool_writes
from kvalloc.allocator.nwor.host_write_graphs import HostWriteGraphs
from kvalloc.server.service import batch, pipeline


class PhaseTimes:
    """Durations of wrapped callables, by phase name."""

    def __init__(self) -> None:
        self.taken: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attr)
        taken = self.taken[phase]

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                taken.append((time.perf_counter_ns() - t0) / 1e3)

        setattr(owner, attr, timed)

    def restart(self) -> None:
        """Forget every duration so far."""
        for taken in self.taken.values():
            taken.clear()

    def medians(self) -> dict[str, float]:
        return {phase: round(statistics.median(t), 1) for phase, t in self.taken.items() if t}


def profile(setup: bench_step.Setup, steps: int) -> dict[str, float]:
    service = bench_step.InProcessService(setup)
    core = service.core
    times = PhaseTimes()
    step_pipeline, writes = core.pipeline, core.pool.committer.writes
    for owner, attr, phase in (
            (core, "step", "step"),
            (step_pipeline.registry, "rows_of_handles", "handles"),
            (step_pipeline.registry, "admit", "admit"),
            (step_pipeline.manager, "step_arrays", "manager"),
            (step_pipeline.manager.table, "sync", "manager.table_upload"),
            (pipeline, "schedule", "layout"),
            (step_pipeline, "_write_previous", "commit"),
            (batch.ScheduledBatch, "owned_slots", "commit.slots"),
            (writes, "begin_window", "commit.open_window"),
            (writes, "stage_from", "commit.stage"),
            (writes, "commit", "commit.window_commit"),
            (writes._staging, "upload_host_slots", "commit.slot_upload"),
            (pool_writes, "write_staged", "commit.write"),
            (HostWriteGraphs, "replay", "commit.graph_replay")):
        times.wrap(owner, attr, phase)

    def one() -> None:
        service.observe(service.run(service.prepare()))

    while not service.workload.full:
        one()
    for _ in range(steps // 10):  # warm-up: one-time work (compiling, capturing) is not timed
        one()
    times.restart()
    for _ in range(steps):
        one()
    service.close()
    return times.medians()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="the service pool's device (default cpu)")
    p.add_argument("--batch", type=int, default=bench_step.REPORTED_BATCH)
    p.add_argument("--steps", type=int, default=300, help="timed steps (default 300)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON object here")
    args = p.parse_args()
    setup = bench_step.Setup(args.batch, 0, args.device, steps=args.steps, layers=args.layers,
                             kv_heads=args.kv_heads, head_dim=args.head_dim)
    medians = profile(setup, args.steps)
    result = {"benchmark": "profile_step", "date": date.today().isoformat(),
              "device": args.device, "batch": args.batch,
              "pool": f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, "
                      "bfloat16", "median_us": medians}
    bench_step.emit(result, {phase: f"{us:9.1f} us" for phase, us in medians.items()},
                    out=args.out, as_json=args.json)


if __name__ == "__main__":
    main()
