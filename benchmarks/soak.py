"""Soak: a real `kvalloc serve` under several `kvalloc loadgen` workers for minutes, with
register/deregister churn beside them; reports steps, errors, leaked blocks, and the service's
RSS and open descriptors at the start and the end.

    python benchmarks/soak.py                       # 10 minutes, 6 workers (on demand)
    python benchmarks/soak.py --duration 5 --workers 2 --json

Workers alternate between IPC and REST over TCP. A healthy run ends with no errors, no blocks
or requests left in the pool, invariants holding (``GET /v1/pool?verify=true``), the same
descriptor count as at the start, and RSS flat after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from server.client import Client
from server.devtools.launch import ServiceProcess, kvalloc_command

POOL = ("--device", "cpu", "--num-blocks", "4096", "--tokens-per-block", "16",
        "--max-batch-size", "256", "--max-seq-len", "4096", "--max-step-tokens", "4096",
        "--max-workers", "16", "--lease-ttl-s", "10")


def process_usage(pid: int) -> dict[str, int]:
    """The process's resident memory (KiB) and open descriptors now."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmRSS:"))
    return {"rss_kib": rss, "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Churn(threading.Thread):
    """Registers and deregisters a short-lived worker over and over until stopped."""

    def __init__(self, address: str) -> None:
        super().__init__(name="soak-churn", daemon=True)
        self.address = address
        self.cycles = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with Client(self.address, worker_id="soak-churn") as client:
            while not self.stop.wait(0.05):
                try:
                    client.register(attach=False)
                    client.step(new=(["c"], [16]))
                    client.deregister()
                    self.cycles += 1
                except Exception as exc:  # counted, never fatal: the soak reports it
                    self.errors.append(f"{type(exc).__name__}: {exc}")


def soak(duration_s: float, workers: int, workdir: Path, warm_up_s: float) -> dict[str, Any]:
    with ServiceProcess(workdir, *POOL) as svc:
        assert svc.proc is not None
        time.sleep(warm_up_s)
        start = process_usage(svc.proc.pid)
        addresses = [svc.ipc if i % 2 == 0 else svc.rest_tcp for i in range(workers)]
        procs = [subprocess.Popen(
            [*kvalloc_command(), "loadgen", "--address", address, "--worker-id", f"soak-{i}",
             "--duration", str(duration_s), "--steps", str(10**9), "--step-interval", "0",
             "--seed", str(i), "--no-progress", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, address in enumerate(addresses)]
        churn = Churn(svc.ipc)
        churn.start()
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=duration_s + 120)
            reports.append(json.loads(out) if out.strip() else {"errors": {"exit": err[-500:]}})
        churn.stop.set()
        churn.join()
        time.sleep(1.0)  # the workers' connections close
        end = process_usage(svc.proc.pid)
        with Client(svc.ipc, worker_id="soak-check") as check:
            pool = check.get_pool(verify=True)
    return {
        "duration_s": duration_s, "workers": workers,
        "steps": sum(r.get("steps", 0) for r in reports),
        "errors": {k: v for r in reports for k, v in r.get("errors", {}).items()},
        "churn": {"cycles": churn.cycles, "errors": churn.errors[:10]},
        "p99_ms": [r.get("latency_ms", {}).get("p99") for r in reports],
        "left_in_pool": {"used_blocks": pool.used_blocks, "requests": pool.num_requests},
        "service": {"start": start, "end": end},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--workers", type=int, default=6, help="loadgen processes (default 6)")
    parser.add_argument("--warm-up", type=float, default=5.0,
                        help="seconds before the start figures: imports and first allocations "
                             "are not the steady state (default 5)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvsoak-") as tmp:
        report = soak(args.duration, args.workers, Path(tmp), args.warm_up)
    if args.json:
        print(json.dumps(report))
    else:
        s, e = report["service"]["start"], report["service"]["end"]
        print(f"soak: {report['steps']} steps by {report['workers']} workers in "
              f"{report['duration_s']:.0f}s, {report['churn']['cycles']} register/deregister "
              f"cycles\n  errors: {report['errors'] or 'none'}; churn errors: "
              f"{report['churn']['errors'] or 'none'}\n  left in pool: {report['left_in_pool']}"
              f"\n  service RSS {s['rss_kib'] // 1024} -> {e['rss_kib'] // 1024} MiB, open fds "
              f"{s['open_fds']} -> {e['open_fds']}")
    healthy = (not report["errors"] and not report["churn"]["errors"]
               and report["left_in_pool"] == {"used_blocks": 0, "requests": 0})
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
