"""Where a remote step call's time goes, in medians measured on both sides of the transport.

    python benchmarks/bench_call_split.py [--device cpu|cuda] [--steps N] [--transport stream|ipc]
                                          [--ipc-spin-s S] [--gap-ms G] [--json]
                                          [--out results.json]

`bench_step.py` times round trips against a real ``kvalloc serve``, from which only the service's
mean time per call can be read (its histogram), and a mean is moved by a few slow calls. Here the
service is a `ServiceCore` behind an `IpcServer` in a child process, both timing every call:
``service_step`` is `ServiceCore.step` alone, ``service_handling`` the whole handling of the
message (decoding, the step, encoding). The parent alternates `bench_step`'s decode workload in
its own process (``inproc``) and over the transport (``round_trip``), batch 256. Derived:
``handling_minus_step`` (the service's codec and dispatch), ``round_trip_minus_handling`` (the
caller's codec, both wake-ups and the system calls) and ``round_trip_minus_inproc`` (what a call
costs over the same step in the caller's process). ``--gap-ms`` sleeps that long after each
step (untimed), as a worker runs its forward between two calls: a service that polls for the
next call must then poll through the gap to gain anything.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from datetime import date
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepCall, StepResult
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.transport.ipc import IpcServer


class TimedCore(ServiceCore):
    """The core, timing each step (microseconds)."""

    taken: list[float]

    def step(self, call: StepCall) -> StepResult:
        t0 = time.perf_counter_ns()
        try:
            return super().step(call)
        finally:
            self.taken.append((time.perf_counter_ns() - t0) / 1e3)


class TimedIpcServer(IpcServer):
    """The IPC transport, timing each message's handling (microseconds)."""

    taken: list[float]

    def handle(self, frames: list[bytes], transport: str = "ipc") -> list[bytes]:
        t0 = time.perf_counter_ns()
        try:
            return super().handle(frames, transport)
        finally:
            self.taken.append((time.perf_counter_ns() - t0) / 1e3)


def serve(setup: bench_step.Setup, address: str, spin_s: float, to_parent: Queue[Any],
          from_parent: Queue[Any]) -> None:
    """The child: serve until told to stop, then send the medians of the last ``setup.steps``
    calls (the timed ones)."""
    config = setup.service_config().model_copy(update={"ipc_spin_s": spin_s})
    core = TimedCore(config)
    core.taken = []
    server = TimedIpcServer(core, [address])
    server.taken = []
    server.start()
    to_parent.put("ready")
    from_parent.get()
    server.stop()
    core.close()
    to_parent.put({"service_step": statistics.median(core.taken[-setup.steps:]),
                   "service_handling": statistics.median(server.taken[-setup.steps:])})


def measure(setup: bench_step.Setup, transport: str, spin_s: float,
            gap_s: float = 0.0) -> dict[str, float]:
    context = mp.get_context("spawn")
    to_parent: Queue[Any] = context.Queue()
    from_parent: Queue[Any] = context.Queue()
    with tempfile.TemporaryDirectory(prefix="kvsplit-") as workdir:
        scheme = "stream" if transport == "stream" else "ipc"
        address = f"{scheme}://{Path(workdir) / f'service.{scheme}'}"
        child = context.Process(target=serve, args=(setup, address, spin_s, to_parent,
                                                    from_parent))
        child.start()
        try:
            if to_parent.get(timeout=120) != "ready":
                raise RuntimeError("the service did not start")
            inproc = bench_step.InProcessService(setup)
            remote = bench_step.ServiceStep(setup, Client(address, worker_id="split"))
            taken: dict[str, list[float]] = {"inproc": [], "round_trip": []}
            runs = (("inproc", inproc), ("round_trip", remote))
            while not (inproc.workload.full and remote.workload.full):
                for _, m in runs:
                    m.observe(m.run(m.prepare()))
            for _ in range(setup.steps):
                for name, m in runs:
                    prepared = m.prepare()
                    t0 = time.perf_counter_ns()
                    result = m.run(prepared)
                    taken[name].append((time.perf_counter_ns() - t0) / 1e3)
                    m.observe(result)
                    time.sleep(gap_s)
            remote.close()
            inproc.close()
            from_parent.put("stop")
            service = to_parent.get(timeout=120)
        finally:
            child.join(60)
    out = {name: statistics.median(t) for name, t in taken.items()} | service
    out["handling_minus_step"] = out["service_handling"] - out["service_step"]
    out["round_trip_minus_handling"] = out["round_trip"] - out["service_handling"]
    out["round_trip_minus_inproc"] = out["round_trip"] - out["inproc"]
    return {f"{k}_us": round(v, 1) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=300, help="timed steps (default 300)")
    p.add_argument("--transport", choices=["stream", "ipc"], default="stream",
                   help="stream: the Unix stream socket (default); ipc: ZeroMQ")
    p.add_argument("--ipc-spin-s", type=float, default=bench_step.SPIN_DEFAULT_S,
                   help="the service's ipc_spin_s (default: the service's, "
                        f"{bench_step.SPIN_DEFAULT_S}; 0: it sleeps between calls)")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="sleep after each step, as a worker's forward (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON object here")
    args = p.parse_args()
    setup = bench_step.Setup(bench_step.REPORTED_BATCH, 0, args.device, steps=args.steps)
    result = {"benchmark": "bench_call_split", "date": date.today().isoformat(),
              "device": args.device, "transport": args.transport,
              "service_ipc_spin_s": args.ipc_spin_s, "gap_ms": args.gap_ms,
              "batch": bench_step.REPORTED_BATCH,
              **measure(setup, args.transport, args.ipc_spin_s, args.gap_ms / 1e3)}
    bench_step.emit(result, result, out=args.out, as_json=args.json)


if __name__ == "__main__":
    main()
