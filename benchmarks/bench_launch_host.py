"""The worker's per-step host time on its own: the engine's Python around a step and the
device step's launch, with a model so small that its forward is a sliver of the figures.

    python benchmarks/bench_launch_host.py                       # CPU, seconds
    python benchmarks/bench_launch_host.py --profile             # and where the time goes

A 1-layer model (hidden 32, float32) decodes ``--batches`` prompts of 8 tokens, 24 new tokens
each, D = 3 drafted on the device (every decode padded to 1 + 3 tokens), the service in
process, synchronously and one step ahead. Per decode-only step, medians in microseconds:
``plan_us`` (`StepPlanner.plan`), ``launch_plan_us`` (the reply checked into a `LaunchPlan`),
``launch_us`` (`DeviceStep.launch`, the tiny forward included; ``metadata_us`` of it for the
inputs) and ``read_us`` (a step's outcome applied to its requests). On a CPU the device's
work runs inside the launch; what the figures compare is the host's Python and allocations
between two versions of the worker, in one run each.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_worker import connect
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker import engine as engine_module
from kvalloc.worker.drafters import DeviceOracleDrafter
from kvalloc.worker.engine import Engine
from kvalloc.worker.model import pool_for_model, random_model
from kvalloc.worker.requests import NamedPrompt

TINY = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                   eos_token_id=None)
PROMPT_LEN, NEW_TOKENS, DRAFT_LEN, ORACLE_RATE = 8, 24, 3, 0.6


class Timers:
    """Each wrapped callable's host time per call, while the step being planned is decode-only
    (``decode_only`` says so after the reply)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.metadata: list[float] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            self.times.setdefault(name, []).append(time.perf_counter() - started)
            return out
        return timed

    def summary(self) -> dict[str, float]:
        return {f"{name}_us": round(1e6 * statistics.median(ts), 1)
                for name, ts in self.times.items()}


def run(batch: int, overlap: bool, profiler: cProfile.Profile | None) -> dict[str, Any]:
    model = random_model(TINY, seed=0, dtype=torch.float32, device="cpu")
    rng = np.random.default_rng(0)
    prompts = [NamedPrompt(f"p{i}", rng.integers(0, TINY.vocab_size, PROMPT_LEN).tolist())
               for i in range(batch)]
    truth = {p.req_id: rng.integers(0, TINY.vocab_size, NEW_TOKENS).tolist() for p in prompts}
    pool = pool_for_model(TINY, longest=PROMPT_LEN + NEW_TOKENS, num_requests=batch,
                          draft_len=DRAFT_LEN, dtype="float32", device="cpu",
                          max_batch_size=batch)
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=batch * (1 + DRAFT_LEN),
                                     lease_ttl_s=600.0))
    timers = Timers()
    try:
        with connect("in-process", core, overlap=overlap) as client:
            drafter = DeviceOracleDrafter(truth, ORACLE_RATE, vocab_size=TINY.vocab_size,
                                          device=model.device, seed=0)
            engine = Engine(model, client, drafter, draft_len=DRAFT_LEN, overlap=overlap,
                            pad_decodes=True)
            engine.warm_up()
            launch = engine.step.launch

            def launched(plan: Any) -> Any:
                if not plan.decode_only:
                    return launch(plan)
                out = timers.wrap("launch", launch)(plan)
                timers.metadata.append(out.metadata_s)
                return out

            engine.step.launch = launched  # type: ignore[method-assign]
            # The planner is frozen: its method is wrapped on the instance all the same.
            object.__setattr__(engine.planner, "plan", timers.wrap("plan", engine.planner.plan))
            engine._read = timers.wrap("read", engine._read)  # type: ignore[method-assign]
            real_launch_plan = engine_module.launch_plan
            engine_module.launch_plan = timers.wrap("launch_plan", real_launch_plan)
            if profiler is not None:
                profiler.enable()
            try:
                engine.run(prompts, NEW_TOKENS)
            finally:
                if profiler is not None:
                    profiler.disable()
                engine_module.launch_plan = real_launch_plan
    finally:
        core.close()
    return {"batch": batch, "mode": "overlap" if overlap else "sync", **timers.summary(),
            "metadata_us": round(1e6 * statistics.median(timers.metadata), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the runs: the functions with the most own time")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in args.batches:
        for overlap in (False, True):
            profiler = cProfile.Profile() if args.profile else None
            rows.append(run(batch, overlap, profiler))
            print(json.dumps(rows[-1]), flush=True)
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
