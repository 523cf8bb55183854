"""The engine's own per-step host Python, on the CPU, without a model or a service: planning a
step's call, checking the reply into a launch plan, and reading a step's outcome back into its
requests.

    python benchmarks/bench_engine_host.py                  # batches 64 and 256, a few seconds
    python benchmarks/bench_engine_host.py --quick --json   # batch 64, a few steps (the tests)

``--batches`` requests decode steadily (prompts of 512 tokens, no end in sight), D = 3 drafted on
the device and every decode padded to 1 + 3 tokens, synchronously (``sync``: each step's
outcome read before the next call) and one step ahead (``overlap``: read two steps later). The
loop is `Engine.run`'s for a decode-only step, with its two outside parties replaced by numpy:
the service answers each call as the protocol says (it settles the results, then schedules each
grant at its settled position plus its unsettled steps, padded to 1 + D tokens) and the device
emits 1 + accepted tokens per decode, each draft accepted with probability 0.6 in turn. Timed,
per step, medians over ``--steps`` steps after a warm-up, in microseconds: ``plan_us``
(`StepPlanner.plan`), ``launch_plan_us`` (`launch_plan`: the reply checked into the device
step's plan) and ``read_us`` (`Engine._read`: the outcome applied to its requests), and
``total_us`` (their sum, per step). Every request's output is checked against what the
simulated device emitted at the end, so the figures are of a loop that did its work.

What the figures compare is the host's Python between two versions of the worker, run side by
side in one session; on a GPU the same Python runs between a step's launch and the next.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvalloc.server.contract.columns import NO_VALUES, Refused, Scheduled, StepResult
from kvalloc.worker.engine import Engine, _Flight
from kvalloc.worker.launch_plans import launch_plan
from kvalloc.worker.requests import Request
from kvalloc.worker.run_stats import DeviceClock, RunStats
from kvalloc.worker.step.device_step import Launched, LaunchPlan, StepOutputs
from kvalloc.worker.step_plans import StepPlanner

PROMPT_LEN, DRAFT_LEN, ACCEPT_RATE, VOCAB = 512, 3, 0.6, 32000
STOP_TOKEN = VOCAB  # never emitted: every request decodes through the run


class Service:
    """The service's side of a decode-only step: each handle's settled position (its pending
    token's) and its steps granted but not settled yet."""

    def __init__(self, requests: list[Request]) -> None:
        self.settled = np.array([r.prompt.size + len(r.output) - 1 for r in requests])
        self.unsettled = np.zeros(len(requests), dtype=np.int64)
        self.step_id = 0

    def step(self, call: dict[str, Any]) -> StepResult:
        if set(call) - {"results", "grants", "padding"}:
            raise AssertionError(f"a steady decode step asked for {sorted(call)}")
        if "results" in call:
            done, accepted = call["results"]
            self.settled[done] += 1 + accepted
            self.unsettled[done] -= 1
        granted, drafts = call["grants"]
        width_of = np.zeros(self.settled.size, dtype=np.int64)
        width_of[granted] = 1 + drafts
        if "padding" in call:  # the padding grant widens a grant to its count of drafts
            padded, padded_to = call["padding"]
            width_of[padded] = 1 + padded_to
        widths = width_of[granted]
        starts = self.settled[granted] + self.unsettled[granted]
        self.unsettled[granted] += 1
        self.step_id += 1
        scheduled = Scheduled(granted, granted, np.cumsum(widths) - widths, widths, widths - 1,
                              starts)
        none = NO_VALUES
        return StepResult(0, self.step_id, none, scheduled, Refused(none, none, none), None, 0)


def device(plan: LaunchPlan, rng: np.random.Generator) -> Launched:
    """A launched step whose outcome is ready: each decode accepts its drafts in turn with
    probability ``ACCEPT_RATE`` and emits them and the bonus token."""
    entries, width = plan.emitting.size, int(plan.num_tokens.max())
    hits = rng.random((entries, width - 1)) < ACCEPT_RATE
    accepted = np.minimum(np.cumprod(hits, axis=1).sum(axis=1), plan.drafts)
    tokens = rng.integers(0, VOCAB, (entries, width))
    host = torch.from_numpy(np.concatenate([tokens.ravel(), accepted + 1, accepted]))
    # Only what the host reads: no logits, commit or metadata stand behind it.
    outputs = StepOutputs(host, width, None, None, None)  # type: ignore[arg-type]
    return Launched(plan, host, outputs, entries, None, None, 0.0)


def count_emitted(emitted: dict[str, int], flight: _Flight) -> None:
    """Add what ``flight``'s step emitted to each of its requests' count."""
    for r, n in zip(flight.requests, flight.launched.outcome()[1].tolist(), strict=True):
        emitted[r.req_id] += n


def engine_host() -> Engine:
    """An engine with only what `Engine._read` uses: its stats and stop tokens."""
    engine = Engine.__new__(Engine)
    engine.stats = RunStats()
    engine.clock = DeviceClock(engine.stats)
    engine.stop_token_ids = frozenset({STOP_TOKEN})
    return engine


def run(batch: int, overlap: bool, steps: int, warm_up: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    requests = []
    for i in range(batch):
        r = Request(f"p{i}", rng.integers(0, VOCAB, PROMPT_LEN), max_new_tokens=1 << 30,
                    output=[int(rng.integers(0, VOCAB))], handle=i)
        r.admitted, r.scheduled = r.prompt, r.prompt.size
        requests.append(r)
    live = {r.handle: r for r in requests}
    layout = SimpleNamespace(max_step_tokens=batch * (1 + DRAFT_LEN), max_batch_size=batch)
    planner = StepPlanner(layout, DRAFT_LEN, None, pad_decodes=True,  # type: ignore[arg-type]
                          share_prefixes=False)
    service, engine = Service(requests), engine_host()
    emitted = {r.req_id: len(r.output) for r in requests}
    flights: deque[_Flight] = deque()
    times: dict[str, list[int]] = {"plan": [], "launch_plan": [], "read": []}
    for _ in range(warm_up + steps):
        read_ns, results = 0, []
        while len(flights) >= (2 if overlap else 1):
            flight = flights.popleft()
            started = time.perf_counter_ns()
            results += engine._read(flight, None)
            read_ns += time.perf_counter_ns() - started
            count_emitted(emitted, flight)
        started = time.perf_counter_ns()
        plan = planner.plan(deque(), live, results)
        planned = time.perf_counter_ns()
        reply = service.step(plan.call)
        scheduled = [live[h] for h in reply.scheduled.handles.tolist()]
        checking = time.perf_counter_ns()
        launch, emitting = launch_plan(reply, scheduled)
        checked = time.perf_counter_ns()
        for r in emitting:
            r.unread += 1
        flights.append(_Flight(device(launch, rng), emitting))
        for name, ns in (("plan", planned - started), ("launch_plan", checked - checking),
                         ("read", read_ns)):
            times[name].append(ns)
    while flights:
        engine._read(flights[0], None)
        count_emitted(emitted, flights.popleft())
    wrong = [r.req_id for r in requests if len(r.output) != emitted[r.req_id]]
    if wrong:
        raise AssertionError(f"requests {wrong[:3]} hold other tokens than the device emitted")
    row: dict[str, Any] = {"batch": batch, "mode": "overlap" if overlap else "sync"}
    timed = {name: ts[warm_up:] for name, ts in times.items()}
    timed["total"] = [sum(parts) for parts in zip(*timed.values(), strict=True)]
    row.update({f"{name}_us": round(statistics.median(ts) / 1e3, 1) for name, ts in timed.items()})
    row["generated_tokens"] = engine.stats.generated_tokens
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--steps", type=int, help="timed steps per run (default 2000)")
    parser.add_argument("--quick", action="store_true", help="batch 64, 50 steps")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    batches = [64] if args.quick else args.batches
    steps = args.steps or (50 if args.quick else 2000)
    rows = []
    for batch in batches:
        for overlap in (False, True):
            rows.append(run(batch, overlap, steps, warm_up=10 if args.quick else 200))
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
