"""`kvalloc loadgen`: a simulated inference worker (`simulated_worker`, or one step ahead with
``--overlap``: `overlap_worker`) driving a running service, one call per step.

It stops after ``--steps`` or ``--duration``, whichever comes first (``--duration`` alone: for that
long; neither: 1000 steps), and prints p50/p99 call latency and every error by code; exit status 1
when any call failed, 2 when no service could be registered with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvalloc.allocator.commands.arguments import argument_type, bounded
from kvalloc.allocator.commands.interrupt import INTERRUPTED, sigint_stops
from kvalloc.allocator.commands.simulated_acceptance import Acceptance
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.addresses import client_address, default_client_address
from kvalloc.server.contract.errors import RemoteError, ServiceUnreachable, TransportTimeout
from kvalloc.server.devtools.overlap_worker import OverlapSimulatedWorker
from kvalloc.server.devtools.simulated_worker import SimulatedWorker, Workload
from tqdm import tqdm

DEFAULT_STEPS = 1000  # when neither --steps nor --duration is given


# ---------------------------------------------------------------- driving a service


@dataclass
class Report:
    address: str
    steps: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    worker: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        lat = np.array(self.latencies_s) * 1e3
        pct = (lambda q: round(float(np.percentile(lat, q)), 3)) if lat.size else (lambda q: None)
        return {"address": self.address, "steps": self.steps, "seconds": round(self.seconds, 3),
                "latency_ms": {"p50": pct(50), "p99": pct(99), "max": pct(100)},
                "errors": dict(self.errors), **{k: self.worker[k] for k in sorted(self.worker)}}


def drive(client: Client, worker: SimulatedWorker, *, steps: int | None,
          duration_s: float | None, step_interval_s: float, progress: bool,
          stop: Callable[[], bool] = lambda: False,
          register: Callable[[], object] | None = None) -> Report:
    """Run steps until ``steps`` or ``duration_s`` (None: no such bound), or until ``stop()``
    says so between two steps. A refused call (or a lost service) costs the worker its
    requests: it registers again with ``register`` (by default detached, not replacing a live
    session) and starts over, as an engine would after a restart. Unless ``register``
    replaces, a worker whose id another process took over stops instead of taking it back."""
    if register is None:
        def register() -> object:
            return client.register(attach=False)
    report = Report(client.address, worker=worker.stats)
    start = time.perf_counter()
    deadline = start + duration_s if duration_s is not None else float("inf")
    limit = steps if steps is not None else float("inf")
    with tqdm(total=steps, unit="step", disable=not progress, file=sys.stderr) as bar:
        while report.steps < limit and time.perf_counter() < deadline and not stop():
            fields = worker.next_step()
            t0 = time.perf_counter()
            try:
                reply = client.step(**fields)
            except (RemoteError, TransportTimeout) as exc:
                report.errors[getattr(exc, "code", "timeout")] += 1
                worker.reset()
                if not _register(register, report):
                    break
            except Exception as exc:  # the service is gone: connection refused, ...
                report.errors[type(exc).__name__] += 1
                break
            else:
                report.latencies_s.append(time.perf_counter() - t0)
                worker.take_reply(reply)
            report.steps += 1
            bar.update()
            if report.steps % 100 == 0:
                bar.set_postfix(p50_ms=f"{np.median(report.latencies_s[-100:]) * 1e3:.2f}",
                                live=len(worker.live), errors=sum(report.errors.values()))
            if step_interval_s:
                time.sleep(step_interval_s)
    report.seconds = time.perf_counter() - start
    return report


def _register(register: Callable[[], object], report: Report) -> bool:
    """Register afresh (the service freed this worker's requests); False when it cannot."""
    try:
        register()
    except Exception as exc:  # any failure here: no usable service
        report.errors[f"register: {type(exc).__name__}"] += 1
        return False
    return True


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return bounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, type=argument_type(client_address),
                        help="stream:///path, ipc:///path, tcp://host:port, http://host:port or "
                             "unix:///path (default: $KVALLOC_ADDRESS, else the service's default "
                             "stream socket)")
    parser.add_argument("--worker-id", default=None,
                        help="the worker's name at the service (default: <host>-<pid>)")
    parser.add_argument("--timeout", type=bounded(float, 0, low_open=True), default=10.0,
                        help="seconds to wait for one reply")
    parser.add_argument("--replace", action="store_true",
                        help="take the worker id over from a live session (a previous run's), "
                             "at start and after an error; without it, a run whose id another "
                             "process took stops")
    parser.add_argument("--data-parallel-rank", type=bounded(int, 0), default=None, metavar="K",
                        help="the data-parallel rank whose allocator the load goes to, for a "
                             "service of several (kvalloc serve --devices of several "
                             "tensor-parallel groups)")
    stop = parser.add_argument_group(
        "how long", f"whichever comes first; --duration alone runs that long, neither runs "
                    f"{DEFAULT_STEPS} steps")
    stop.add_argument("--steps", type=bounded(int, 1), default=None,
                      help="scheduler steps, one call each")
    stop.add_argument("--duration", type=bounded(float, 0, low_open=True), default=None,
                      help="seconds")
    sim = parser.add_argument_group("the simulated engine")
    sim.add_argument("--draft-len", type=bounded(int, 0), default=3,
                     help="MTP draft length D (at most the service's --max-draft-len)")
    sim.add_argument("--overlap", action="store_true",
                     help="one step ahead: register as an overlap worker, whose results reach "
                          "the service two calls late (lag 2, docs/protocol.md)")
    sim.add_argument("--acceptance", type=Acceptance.parse, default="geometric:0.7",
                     help="geometric:P, fixed:K or uniform")
    sim.add_argument("--arrival-rate", type=bounded(float, 0), default=0.5,
                     help="new requests per step, Poisson mean")
    sim.add_argument("--prompt-len", type=_range, default="16:512", help="MIN:MAX tokens")
    sim.add_argument("--output-len", type=_range, default="16:256", help="MIN:MAX tokens")
    sim.add_argument("--max-live", type=bounded(int, 1), default=32,
                     help="running requests at most")
    sim.add_argument("--skip-rate", type=bounded(float, 0, 1), default=0.02,
                     help="share of forwards skipped and reverted")
    sim.add_argument("--pad-rate", type=bounded(float, 0, 1), default=0.1,
                     help="share of grants padded to max_draft_len")
    sim.add_argument("--step-interval", type=bounded(float, 0), default=0.02,
                     help="seconds between calls: the forward's duration")
    sim.add_argument("--shared-prefix", type=bounded(int, 0), default=0, metavar="TOKENS",
                     help="every prompt starts with one system prompt of this many tokens, "
                          "sent with token ids to share it (the service needs "
                          "--prefix-caching; --prompt-len is then the rest)")
    sim.add_argument("--seed", type=int, default=0, help="random seed of the workload")
    out = parser.add_argument_group("output")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    workload = Workload(draft_len=args.draft_len, acceptance=args.acceptance,
                        arrival_rate=args.arrival_rate, prompt_len=args.prompt_len,
                        output_len=args.output_len, max_live=args.max_live,
                        skip_rate=args.skip_rate, pad_rate=args.pad_rate,
                        shared_prefix=args.shared_prefix)
    address = args.address or default_client_address()
    steps = DEFAULT_STEPS if args.steps is None and args.duration is None else args.steps
    with Client(address, worker_id=args.worker_id, timeout_s=args.timeout) as client:

        def register() -> wire.Registration:  # at start and after each refusal
            return client.register(attach=False,  # the load generator never touches KV
                                   replace=args.replace, overlap=args.overlap,
                                   data_parallel_rank=args.data_parallel_rank)

        try:
            registration = register()
        except (ServiceUnreachable, RemoteError, TransportTimeout) as exc:
            print(f"kvalloc loadgen: cannot register at {address}: {exc}", file=sys.stderr)
            return 2
        layout = registration.layout
        if args.draft_len > layout.max_draft_len:
            print(f"kvalloc loadgen: --draft-len {args.draft_len} is more than the service's "
                  f"max_draft_len {layout.max_draft_len}: drafting {layout.max_draft_len}",
                  file=sys.stderr)
        simulated = OverlapSimulatedWorker if args.overlap else SimulatedWorker
        worker = simulated(workload, max_draft_len=layout.max_draft_len,
                           max_step_tokens=layout.max_step_tokens, seed=args.seed)
        with sigint_stops() as stop:
            report = drive(client, worker, steps=steps, duration_s=args.duration,
                           step_interval_s=args.step_interval, progress=not args.no_progress,
                           stop=stop, register=register)
            with contextlib.suppress(Exception):  # best effort: a lost service frees it by lease
                client.deregister()
    summary = {**report.summary(), "overlap": args.overlap,
               **({"interrupted": True} if stop.requested else {})}
    print(json.dumps(summary) if args.json else _human(summary))
    if stop.requested:
        return INTERRUPTED
    return 1 if report.errors else 0


def _human(s: dict[str, Any]) -> str:
    lat = s["latency_ms"]
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "none"
    behind = (f", grants behind an unsettled step {s.get('grants_behind', 0)}"
              if s.get("overlap") else "")
    return "\n".join([
        f"kvalloc loadgen: {s['steps']} steps in {s['seconds']:.1f}s against {s['address']}"
        f"{' (interrupted)' if s.get('interrupted') else ''}"
        f"{', one step ahead (lag 2)' if s.get('overlap') else ''}",
        f"  step call latency: p50 {lat['p50']} ms, p99 {lat['p99']} ms, max {lat['max']} ms",
        f"  requests: {s.get('admitted', 0)} admitted, {s.get('finished', 0)} finished, "
        f"{s.get('requests_refused', 0)} refused, {s.get('preempted', 0)} preempted; "
        f"grants refused {s.get('grants_refused', 0)}, reverts {s.get('reverts', 0)}{behind}",
        f"  tokens: {s.get('output_tokens', 0)} output, {s.get('accepted_tokens', 0)} accepted "
        f"drafts",
        f"  errors: {errors}",
        *([f"  prefix cache: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached "
           f"({s['cached_tokens'] / s['prompt_tokens']:.1%})"] if s.get("prompt_tokens") else []),
    ])
