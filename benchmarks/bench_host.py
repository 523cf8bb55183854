"""Host time of one scheduler step: the batched `KVCacheManager.step` vs the same work through
the per-request methods, side by side in one run (MTP3, overlap, random acceptance).

    python benchmarks/bench_host.py [--out results.json] [--device cpu|cuda]

The step is the steady-state decode step of an overlap scheduler: settle every request's
previous grant with its accepted count, then grant the next step. Reported: median and p99 in
microseconds over many steps, and the per-request / batched ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date

import numpy as np
import torch

from allocator import KVCacheManager, PoolConfig, StepPlan

DRAFT_LEN = 3
PROMPT_LEN = 512


def make_manager(batch: int, device: str, steps: int) -> tuple[KVCacheManager, list[str]]:
    # Long enough that no request reaches max_seq_len within the run (at most 1 + D per step).
    max_seq_len = PROMPT_LEN + (steps + 1) * (1 + DRAFT_LEN)
    blocks_per_seq = -(-(max_seq_len + 1 + 2 * DRAFT_LEN) // 16)
    cfg = PoolConfig(num_blocks=batch * blocks_per_seq, tokens_per_block=16, num_layers=1,
                     num_kv_heads=1, head_dim=8, device=device, max_batch_size=batch,
                     max_seq_len=max_seq_len, max_draft_len=DRAFT_LEN)
    m = KVCacheManager(cfg, allocate_storage=False)
    ids = [f"req-{i}" for i in range(batch)]
    m.step(StepPlan(new_ids=ids, prompt_lens=[PROMPT_LEN] * batch))
    m.step(StepPlan(grant_ids=ids, draft_lens=[DRAFT_LEN] * batch))
    return m, ids


def run_batched(m: KVCacheManager, ids: list[str], accepted: list[int]) -> None:
    m.step(StepPlan(result_ids=ids, num_accepted=accepted, grant_ids=ids,
                    draft_lens=[DRAFT_LEN] * len(ids)))


def run_per_request(m: KVCacheManager, ids: list[str], accepted: list[int]) -> None:
    for req, acc in zip(ids, accepted, strict=True):
        m.update_resources(req, acc)
        m.try_allocate_generation(req, DRAFT_LEN)


def measure(batch: int, steps: int, device: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    acc = rng.integers(0, DRAFT_LEN + 1, size=(steps, batch)).tolist()
    out: dict[str, dict] = {}
    # Alternate the two variants step by step so both see the same machine state.
    managers = {name: make_manager(batch, device, steps) for name in ("batched", "per_request")}
    fns = {"batched": run_batched, "per_request": run_per_request}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(steps):
        for name, fn in fns.items():
            m, ids = managers[name]
            t0 = time.perf_counter_ns()
            fn(m, ids, acc[i])
            samples[name].append((time.perf_counter_ns() - t0) / 1e3)
    for name, xs in samples.items():
        warm = xs[steps // 10 :]
        out[name] = {"median_us": statistics.median(warm),
                     "p99_us": float(np.percentile(warm, 99))}
        managers[name][0].check_invariants()
    out["ratio_per_request_over_batched"] = (out["per_request"]["median_us"]
                                             / out["batched"]["median_us"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON results here")
    args = p.parse_args()
    results = {
        "benchmark": "bench_host",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
                   f"({torch.get_num_threads()} torch threads)".strip(),
        "device": args.device,
        "draft_len": DRAFT_LEN,
        "steps": args.steps,
        "results": {str(b): measure(b, args.steps, args.device, args.seed) for b in args.batches},
    }
    print("| requests | batched step median (us) | p99 | per-request median (us) | p99 | ratio |")
    print("|---|---|---|---|---|---|")
    for b, r in results["results"].items():
        print(f"| {b} | {r['batched']['median_us']:.1f} | {r['batched']['p99_us']:.1f} | "
              f"{r['per_request']['median_us']:.1f} | {r['per_request']['p99_us']:.1f} | "
              f"{r['ratio_per_request_over_batched']:.1f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
