"""What publishing KV events costs the service's step, side by side in one run.

    python benchmarks/bench_events.py [--device cpu|cuda] [--batch 256] [--steps N]
                                      [--profile FILE] [--json] [--out results.json]

Two `ServiceCore`s in this process, both with prefix caching, step `bench_step`'s decode workload
(MTP3, ~0.5 finishes a step, each replaced by a 1000-token prompt) for one attached worker, every
new prompt sent with its token ids: a shared 512-token system prompt, then its own 488 tokens.
``events_off`` publishes nothing; ``events_on`` publishes on a stream per worker
(``ipc://<tmp>/events-{worker}``, nobody subscribed). They alternate step by step, the order
swapped every step, and each reports the median and p99 of `ServiceCore.step` in microseconds.

Before the batch is admitted, each service's prefix cache is filled with prompts of their own
until the pool holds no free block, as a warm service's is: every block a step takes is then
evicted from the cache, so the events path carries both `BlockStored` and `BlockRemoved`.

The stream's encoding and sending run on the service's sender thread, off the step: after each
``events_on`` step (untimed) the benchmark waits for that thread to send what the step
published, so its work never lands inside a timed step of either service. ``sender`` is that
thread's time per batch (msgpack encoding and the ZeroMQ send), timed around `EventStream.send`;
``on_plus_sender_over_off`` charges it to the step, as on a service whose steps come back to back
and whose two threads share one core. The target is ``on_over_off`` (median step, events on over
off) <= 1.05. ``--profile`` writes cProfile's stats of the ``events_on`` steps (the sender's
thread is not in them). Beside them: per timed step, the batches and events published, blocks
stored and removed, and both services' refused grants and admissions (0: the workload ran as
written), and ``prefix_hit_rate``, the share of the timed steps' prompt tokens found cached.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
from kvalloc.allocator import BlockRemoved, BlockStored
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

WORKER = "bench"
TARGET = 1.05


class CachedService(bench_step.ServiceStep):
    """`ServiceCore.step` in this process with prefix caching, new prompts sent with their token
    ids; with ``events``, publishing KV events there."""

    def __init__(self, setup: bench_step.Setup, events: str | None = None) -> None:
        base = setup.service_config()
        self.core = ServiceCore(ServiceConfig.model_validate(
            base.model_dump() | {"prefix_caching": True, "kv_events": events}))
        self.setup = setup
        self.rng = np.random.default_rng(setup.seed + 1)
        super().__init__(setup, Client.in_process(self.core, worker_id=WORKER))

    def prepare(self) -> StepCall:
        call = super().prepare()
        own = bench_step.PROMPT_LEN - bench_step.SYSTEM_PROMPT.size
        ids = [np.concatenate([bench_step.SYSTEM_PROMPT, self.rng.integers(0, 32000, own)])
               for _ in range(call.prompt_lens.size)]
        return StepCall.build(
            call.worker_id, call.session, call.epoch, call.step_id,
            result_handles=call.result_handles, num_accepted=call.num_accepted,
            finished_handles=call.finished_handles, grant_handles=call.grant_handles,
            draft_lens=call.draft_lens, prompt_lens=call.prompt_lens,
            prompt_token_ids=np.concatenate(ids) if ids else (), new_req_ids=call.new_req_ids)

    def refused(self) -> int:
        c = self.core.manager.counters
        return c.grants_refused + c.requests_refused

    def close(self) -> None:
        super().close()
        self.core.close()


class SenderTimes:
    """The sender thread's work for one stream: ``EventStream.send`` timed and its events
    counted, in place on that stream (the thread made it when the worker registered)."""

    def __init__(self, core: ServiceCore) -> None:
        assert core.kv_events is not None
        self.core = core
        stream = core.kv_events.sender._streams[WORKER][0]
        send = stream.send
        self.taken: list[float] = []
        self.counts = dict.fromkeys(("batches", "events", "stored_blocks", "removed_blocks"), 0)

        def timed_send(events: list[Any]) -> None:
            t0 = time.perf_counter_ns()
            send(events)
            self.taken.append((time.perf_counter_ns() - t0) / 1e3)
            self.counts["batches"] += 1
            self.counts["events"] += len(events)
            for e in events:
                if isinstance(e, BlockStored):
                    self.counts["stored_blocks"] += len(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    self.counts["removed_blocks"] += len(e.block_hashes)

        stream.send = timed_send  # type: ignore[method-assign]

    def drain(self) -> None:
        """Return once the thread has sent everything published so far."""
        assert self.core.kv_events is not None
        self.core.kv_events.sender.flush()

    def reset(self) -> None:
        self.drain()
        self.taken.clear()
        self.counts = dict.fromkeys(self.counts, 0)


def fill(runs: list[CachedService]) -> None:
    """Admit the batch (untimed)."""
    while not all(m.workload.full for m in runs):
        for m in runs:
            m.observe(m.run(m.prepare()))


def flood(m: CachedService) -> None:
    """Park the pool's every block in the prefix cache (untimed), as a warm service's cache
    fills its pool: prompts of their own token ids, admitted, prefilled, written and finished,
    as many at once as a step schedules."""
    c, reg = m.client, m.registration
    rng = np.random.default_rng(m.setup.seed + 2)
    at_once = m.core.config.max_step_tokens // bench_step.PROMPT_LEN
    none = np.zeros(at_once, dtype=np.int64)

    def send(**columns: Any) -> Any:
        return c.send_step(StepCall.build(c.worker_id, reg.session, reg.epoch, c.next_step_id,
                                          **columns))

    blocks = at_once * (bench_step.PROMPT_LEN // bench_step.TOKENS_PER_BLOCK + 1)
    while m.core.manager.free_blocks >= blocks:
        admitted = send(prompt_lens=np.full(at_once, bench_step.PROMPT_LEN),
                        prompt_token_ids=rng.integers(0, 32000, at_once * bench_step.PROMPT_LEN),
                        new_req_ids=[f"flood{c.next_step_id}-{i}" for i in range(at_once)]
                        ).admitted
        send(grant_handles=admitted, draft_lens=none)
        send(result_handles=admitted, num_accepted=none, finished_handles=admitted)


def measure(setup: bench_step.Setup, profile: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvevents-") as workdir:
        off = CachedService(setup)
        on = CachedService(setup, events=f"ipc://{workdir}/events-{{worker}}")
        sender = SenderTimes(on.core)
        flood(off)
        flood(on)
        fill([off, on])
        sender.reset()
        counters = on.core.manager.counters
        before = (counters.evicted_blocks, counters.prefix_hit_tokens,
                  counters.prefix_queried_tokens)
        taken: dict[str, list[float]] = {"events_off": [], "events_on": []}
        profiler = cProfile.Profile() if profile else None
        for i in range(setup.steps):
            order = (("events_off", off), ("events_on", on))
            for name, m in order if i % 2 == 0 else order[::-1]:
                prepared = m.prepare()
                if profiler is not None and m is on:
                    profiler.enable()
                t0 = time.perf_counter_ns()
                result = m.run(prepared)
                taken[name].append((time.perf_counter_ns() - t0) / 1e3)
                if profiler is not None and m is on:
                    profiler.disable()
                m.observe(result)
                if m is on:
                    sender.drain()
        if profiler is not None:
            profiler.dump_stats(profile)
        evicted, hits, queried = (counters.evicted_blocks - before[0],
                                  counters.prefix_hit_tokens - before[1],
                                  counters.prefix_queried_tokens - before[2])
        refused = {"refused_off": off.refused(), "refused_on": on.refused()}
        off.close()
        on.close()
    warm = max(2, setup.steps // 10)  # past warm-up
    out: dict[str, Any] = {}
    for name, t in taken.items():
        out[f"{name}_us"] = round(statistics.median(t[warm:]), 1)
        out[f"{name}_p99_us"] = round(float(np.percentile(t[warm:], 99)), 1)
    out["sender_us"] = round(statistics.median(sender.taken), 1) if sender.taken else 0.0
    out["on_over_off"] = round(out["events_on_us"] / out["events_off_us"], 3)
    # Every batch's sender time, spread over the steps: some steps publish nothing.
    sender_per_step = sum(sender.taken) / setup.steps
    out["on_plus_sender_over_off"] = round(
        (out["events_on_us"] + sender_per_step) / out["events_off_us"], 3)
    out["target_met"] = out["on_over_off"] <= TARGET
    out |= {f"{k}_per_step": round(v / setup.steps, 2) for k, v in sender.counts.items()}
    out["evicted_blocks_per_step"] = round(evicted / setup.steps, 2)
    out["num_blocks"] = on.core.config.pool.num_blocks
    out["prefix_hit_rate"] = round(hits / max(1, queried), 3)
    return out | refused


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu",
                   help="where the block table's device copy and the service's pool live")
    p.add_argument("--batch", type=int, default=bench_step.REPORTED_BATCH,
                   help=f"requests per step (default {bench_step.REPORTED_BATCH})")
    p.add_argument("--steps", type=int, default=400, help="timed steps (default 400)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--profile", metavar="FILE",
                   help="run the events_on steps under cProfile and write its stats here "
                        "(python -m pstats FILE); the step times then include the profiler's")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON object here")
    args = p.parse_args()
    torch.set_num_threads(1)
    setup = bench_step.Setup(args.batch, args.seed, args.device, steps=args.steps)
    result = {"benchmark": "bench_events", "date": date.today().isoformat(),
              "device": args.device, "batch": args.batch, "steps": args.steps,
              **measure(setup, args.profile)}
    result["machine"] = (f"{platform.machine()}, {os.cpu_count()} CPUs, "
                         f"{platform.python_version()}, load average "
                         f"{os.getloadavg()[0]:.1f} at the end")
    bench_step.emit(result, result, out=args.out, as_json=args.json)


if __name__ == "__main__":
    main()
