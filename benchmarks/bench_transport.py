"""Round trip of the per-step call, side by side: in process, IPC (ZeroMQ + msgpack), REST over a
Unix socket and REST over TCP, for batches of 1, 64 and 256 decode requests with MTP3 (3 drafts:
each step settles the previous one with random accepted counts and grants 1 + 3 tokens again);
then sustained steps per second with 4 concurrent worker processes per transport.

    python benchmarks/bench_transport.py --out benchmarks/results/transport_cpu.json

One ``kvalloc serve`` subprocess serves every transport at once, with the default small model
shape (2 layers x 2 KV heads x 64, bf16), so each call includes the real NWOR commit of the
previous step (on a CPU pool a host memory copy, on a GPU pool an asynchronous kernel). The
"in-process" column is the same call on a `ServiceCore` in this process: the part no transport
can remove. Request bodies are built before the clock starts; a round trip covers encoding,
transport, the service's work and decoding the reply. Bounded: under 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from allocator import PoolConfig
from server import wire
from server.client import Client
from server.core import ServiceCore
from server.launch import ServiceProcess
from server.settings import ServiceConfig

BATCHES = (1, 64, 256)
DRAFT = 3
PROMPT = 16
TRANSPORTS = ("in-process", "ipc", "rest-unix", "rest-tcp")
WORKERS = 4
WORKER_BATCH = 64


def pool_flags(device: str) -> dict[str, Any]:
    """Room for 256 requests growing by up to 4 tokens per step for a few hundred steps."""
    return {"device": device, "num_blocks": 12288, "tokens_per_block": 16,
            "max_batch_size": 256, "max_seq_len": 1024, "max_draft_len": DRAFT}


MAX_STEP_TOKENS = 256 * (1 + DRAFT)


def cycle(prefix: str, batch: int, decode_steps: int, seed: int
          ) -> Iterator[tuple[bool, dict[str, list[Any]]]]:
    """One request lifetime for ``batch`` requests: admission (chunked to fit a step), a grant,
    ``decode_steps`` settle-and-grant steps (the timed ones), then settle-and-finish.
    Yields (timed, step fields)."""
    rng = np.random.default_rng(seed)
    ids = [f"{prefix}{i}" for i in range(batch)]
    per_step = MAX_STEP_TOKENS // PROMPT
    for start in range(0, batch, per_step):
        yield False, {"new": [wire.NewRequest(req_id=r, prompt_len=PROMPT)
                              for r in ids[start:start + per_step]]}
    grants = [wire.Grant(req_id=r, draft_len=DRAFT) for r in ids]
    yield False, {"grants": grants}
    for _ in range(decode_steps):
        accepted = rng.integers(0, DRAFT + 1, batch).tolist()
        yield True, {"results": [wire.Result(req_id=r, num_accepted=a)
                                 for r, a in zip(ids, accepted, strict=True)], "grants": grants}
    yield False, {"results": [wire.Result(req_id=r, num_accepted=0) for r in ids],
                  "finished": ids}


def round_trips(client: Client, batch: int, warmup: int, steps: int) -> np.ndarray:
    client.register(attach=False)
    times = []
    for timed, fields in cycle("r", batch, warmup + steps, seed=batch):
        t0 = time.perf_counter()
        client.step(**fields)
        if timed:
            times.append(time.perf_counter() - t0)
    client.deregister()
    return np.array(times[warmup:])


def sustained_worker(address: str, worker_id: str, duration_s: float) -> tuple[int, float]:
    """Steps of ``WORKER_BATCH`` requests for ``duration_s``; returns (steps, p50 seconds)."""
    torch.set_num_threads(1)
    with Client(address, worker_id=worker_id) as client:
        client.register(attach=False)
        times: list[float] = []
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            for _, fields in cycle(f"{worker_id}-", WORKER_BATCH, 100, seed=len(times)):
                t0 = time.perf_counter()
                client.step(**fields)
                times.append(time.perf_counter() - t0)
                if time.monotonic() >= end:
                    break
        client.deregister()
    return len(times), float(np.percentile(times, 50))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--duration", type=float, default=3.0, help="sustained run, seconds")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    flags = pool_flags(args.device)
    cli = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    results: dict[str, Any] = {
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "load_average_at_start": os.getloadavg()},
        "pool": {**flags, "max_step_tokens": MAX_STEP_TOKENS, "shape": "2 layers x 2 KV heads "
                 "x 64, bfloat16"},
        "draft_len": DRAFT, "steps": args.steps, "latency_ms": {}, "sustained": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp, ServiceProcess(
            Path(tmp), *cli, f"--max-step-tokens={MAX_STEP_TOKENS}") as svc:
        core = ServiceCore(ServiceConfig(pool=PoolConfig(**flags),
                                         max_step_tokens=MAX_STEP_TOKENS))
        addresses = {"ipc": svc.ipc, "rest-unix": svc.rest_unix, "rest-tcp": svc.rest_tcp}
        try:
            for batch in BATCHES:
                for transport in TRANSPORTS:
                    client = (Client.in_process(core, worker_id="bench")
                              if transport == "in-process"
                              else Client(addresses[transport], worker_id="bench"))
                    with client:
                        t = round_trips(client, batch, args.warmup, args.steps) * 1e3
                    results["latency_ms"].setdefault(str(batch), {})[transport] = {
                        "p50": round(float(np.percentile(t, 50)), 4),
                        "p99": round(float(np.percentile(t, 99)), 4),
                        "mean": round(float(t.mean()), 4), "n": int(t.size)}
                    print(f"batch {batch:>3} {transport:<10} p50 {np.percentile(t, 50):7.3f} ms",
                          file=sys.stderr)
        finally:
            core.close()
        ctx = mp.get_context("spawn")
        for transport, address in addresses.items():
            with ctx.Pool(WORKERS) as pool:
                jobs = [(address, f"s{i}", args.duration) for i in range(WORKERS)]
                out = pool.starmap(sustained_worker, jobs)
            steps = sum(n for n, _ in out)
            results["sustained"][transport] = {
                "workers": WORKERS, "batch_per_worker": WORKER_BATCH,
                "duration_s": args.duration, "steps_per_s": round(steps / args.duration, 1),
                "worker_p50_ms": [round(p * 1e3, 3) for _, p in out]}
            print(f"sustained {transport:<10} {steps / args.duration:8.1f} steps/s",
                  file=sys.stderr)
    print(markdown(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def markdown(results: dict[str, Any]) -> str:
    lat = results["latency_ms"]
    lines = ["| batch (MTP3) | " + " | ".join(f"{t} p50 / p99 ms" for t in TRANSPORTS)
             + " | REST-TCP / IPC p50 | REST-Unix / IPC p50 |",
             "|---:|" + "---:|" * (len(TRANSPORTS) + 2)]
    for batch, row in lat.items():
        cells = [f"{row[t]['p50']:.3f} / {row[t]['p99']:.3f}" for t in TRANSPORTS]
        ratio = [row[r]["p50"] / row["ipc"]["p50"] for r in ("rest-tcp", "rest-unix")]
        lines.append(f"| {batch} | " + " | ".join(cells)
                     + f" | {ratio[0]:.1f}x | {ratio[1]:.1f}x |")
    lines += ["", f"| transport | steps/s, {WORKERS} workers x batch {WORKER_BATCH} | "
                  "per-worker p50 ms |", "|---|---:|---|"]
    for transport, row in results["sustained"].items():
        lines.append(f"| {transport} | {row['steps_per_s']:.0f} | "
                     + ", ".join(f"{p:.2f}" for p in row["worker_p50_ms"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
