"""The per-step call, side by side in one run: the manager's numpy step (the reference), its
compiled step, the service's step in process, and the IPC and REST-TCP round trips.

    python benchmarks/bench_step.py                  # batches 64, 256, 1024; markdown table
    python benchmarks/bench_step.py --quick --json   # batch 256 only; one JSON object

Workload (a decode-heavy engine under an overlap scheduler): ``batch`` decode requests with MTP3
(3 drafts per grant, 0-3 accepted at random), each step settling the previous one; about 0.5
requests finish per step and are replaced by new 1000-token prompts, which get their first grant
the step after admission. tokens_per_block 16, max_seq_len 32768. The manager runs on a 200k
block pool (it is host-only: no KV memory). The service runs the default small model shape
(2 layers x 2 KV heads x 64, bf16) on a pool sized for the run, with an attached worker, so each
call includes the real NWOR commit of the previous step; ``commit_us`` is that commit's own time
inside the service step (on a CPU pool a host memory copy, on a GPU pool kernel launches).
``--layers`` and friends reshape the service's pool (e.g. a real model's 32 x 8 x 128 on a GPU).

Medians in microseconds. Bounded: ``--quick`` finishes in well under 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from allocator import KVCacheManager, PoolConfig, StepPlan
from server.client import Client
from server.columns import StepCall
from server.core import ServiceCore
from server.launch import ServiceProcess
from server.settings import ServiceConfig

DRAFT = 3
PROMPT = 1000
TOKENS_PER_BLOCK = 16
MAX_SEQ_LEN = 32768
MANAGER_BLOCKS = 200_000
FINISH_RATE = 0.5


@dataclass
class DecodeWorkload:
    """The engine's side of the workload, in terms of the handles (or rows) it names requests
    by: which requests decode, which were just admitted, and what this step sends."""

    batch: int
    seed: int = 0
    decoding: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    admitted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    next_id: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def fill_step(self) -> dict[str, Any]:
        """Admit up to 8 new prompts per step until ``batch`` requests run (not timed)."""
        running = self.decoding.size + self.admitted.size
        return self._step(finish=0, new=min(8, self.batch - running))

    def decode_step(self) -> dict[str, Any]:
        """Settle the previous grants, finish ~0.5, grant the rest and last step's admissions,
        admit replacements."""
        finish = min(int(self.rng.poisson(FINISH_RATE)), self.decoding.size)
        return self._step(finish=finish, new=finish)

    def _step(self, *, finish: int, new: int) -> dict[str, Any]:
        decoding = self.decoding
        done = self.rng.choice(decoding.size, size=finish, replace=False)
        stays = np.ones(decoding.size, dtype=bool)
        stays[done] = False
        grants = np.concatenate([decoding[stays], self.admitted])
        ids = [f"r{self.next_id + i}" for i in range(new)]
        self.next_id += new
        self._granted = grants
        return {"result_handles": decoding[stays],
                "num_accepted": self.rng.integers(0, DRAFT + 1, int(stays.sum())),
                "finished_handles": decoding[done], "grant_handles": grants,
                "draft_lens": np.full(grants.size, DRAFT), "new_req_ids": ids,
                "prompt_lens": np.full(new, PROMPT)}

    def learn(self, admitted: np.ndarray) -> None:
        """The step's reply: the handles (rows) of the admitted requests (-1 refused)."""
        self.decoding = self._granted
        self.admitted = admitted[admitted >= 0]


# ---------------------------------------------------------------- the manager alone


def manager_config(batch: int) -> PoolConfig:
    return PoolConfig(num_blocks=MANAGER_BLOCKS, tokens_per_block=TOKENS_PER_BLOCK,
                      max_seq_len=MAX_SEQ_LEN, max_batch_size=batch + 64, max_draft_len=DRAFT,
                      device="cpu")


def as_plan(fields: dict[str, Any]) -> StepPlan:
    """A workload step as the manager takes it: handles are rows here."""
    return StepPlan(result_rows=fields["result_handles"], num_accepted=fields["num_accepted"],
                    finished_rows=fields["finished_handles"], grant_rows=fields["grant_handles"],
                    draft_lens=fields["draft_lens"], prompt_lens=fields["prompt_lens"])


def measure_managers(batch: int, steps: int) -> dict[str, float]:
    """The numpy and the compiled step on the same plans, alternating, identical outcomes."""
    managers = {"manager_numpy_us": KVCacheManager(manager_config(batch), compiled=False),
                "manager_us": KVCacheManager(manager_config(batch), compiled=True)}
    workload = DecodeWorkload(batch)
    while workload.decoding.size + workload.admitted.size < batch:
        plan = as_plan(workload.fill_step())
        rows = [m.step(plan).admitted_rows for m in managers.values()]
        workload.learn(rows[0])
    times: dict[str, list[float]] = {name: [] for name in managers}
    for _ in range(steps):
        plan = as_plan(workload.decode_step())
        outcomes = []
        for name, manager in managers.items():
            start = time.perf_counter()
            outcomes.append(manager.step(plan))
            times[name].append(time.perf_counter() - start)
        assert np.array_equal(outcomes[0].admitted_rows, outcomes[1].admitted_rows)
        workload.learn(outcomes[0].admitted_rows)
    for manager in managers.values():
        manager.check_invariants()
    return {name: _median_us(t) for name, t in times.items()}


# ---------------------------------------------------------------- the service


@dataclass(frozen=True)
class PoolShape:
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    device: str = "cpu"


def service_config(batch: int, steps: int, shape: PoolShape) -> ServiceConfig:
    """Room for ``batch`` requests growing by up to 4 tokens a step, plus replacements."""
    tokens = (batch + 64) * (PROMPT + (1 + 2 * DRAFT) * (steps + 100))
    pool = PoolConfig(num_blocks=tokens // TOKENS_PER_BLOCK + 1024,
                      tokens_per_block=TOKENS_PER_BLOCK, max_seq_len=MAX_SEQ_LEN,
                      max_batch_size=batch + 64, max_draft_len=DRAFT, num_layers=shape.layers,
                      num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, device=shape.device)
    step_tokens = (batch + 64) * (1 + DRAFT) + 8 * PROMPT
    return ServiceConfig(pool=pool, max_step_tokens=step_tokens)


def drive(client: Client, batch: int, steps: int, warmup: int,
          timed: Callable[[StepCall], Any]) -> list[float]:
    """Run the workload through ``client``; ``timed`` sends one prepared call (the clock runs
    around it only)."""
    reg = client.register()
    workload = DecodeWorkload(batch)

    def send(fields: dict[str, Any]) -> Any:
        call = StepCall.build(client.worker_id, reg.session, reg.epoch, client.next_step_id,
                              **fields)
        start = time.perf_counter()
        reply = timed(call)
        return reply, time.perf_counter() - start

    while workload.decoding.size + workload.admitted.size < batch:
        reply, _ = send(workload.fill_step())
        workload.learn(reply.admitted)
    times = []
    for _ in range(warmup + steps):
        reply, seconds = send(workload.decode_step())
        workload.learn(reply.admitted)
        times.append(seconds)
    client.deregister()
    return times[warmup:]


def measure_in_process(batch: int, steps: int, warmup: int, shape: PoolShape
                       ) -> dict[str, float]:
    core = ServiceCore(service_config(batch, steps + warmup, shape))
    commit_times: list[float] = []
    commit = core.committer.commit

    def timed_commit(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = commit(*args, **kwargs)
        if core.device.type == "cuda":
            torch.cuda.synchronize()  # the commit's device time, not only its launches
        commit_times.append(time.perf_counter() - start)
        return out

    core.committer.commit = timed_commit  # type: ignore[method-assign]
    try:
        with Client.in_process(core, worker_id="bench") as client:
            times = drive(client, batch, steps, warmup, client.send_step)
    finally:
        core.close()
    return {"service_inproc_us": _median_us(times),
            "commit_us": _median_us(commit_times[-steps:])}


def measure_transports(batch: int, steps: int, warmup: int, shape: PoolShape
                       ) -> dict[str, float]:
    config = service_config(batch, steps + warmup, shape)
    pool = config.pool
    flags = [f"--num-blocks={pool.num_blocks}", f"--tokens-per-block={TOKENS_PER_BLOCK}",
             f"--max-seq-len={MAX_SEQ_LEN}", f"--max-batch-size={pool.max_batch_size}",
             f"--max-draft-len={DRAFT}", f"--num-layers={shape.layers}",
             f"--num-kv-heads={shape.kv_heads}", f"--head-dim={shape.head_dim}",
             f"--device={shape.device}", f"--max-step-tokens={config.max_step_tokens}"]
    out = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp, \
            ServiceProcess(Path(tmp), *flags) as svc:
        for key, address in (("ipc_us", svc.ipc), ("rest_tcp_us", svc.rest_tcp)):
            with Client(address, worker_id="bench") as client:
                out[key] = _median_us(drive(client, batch, steps, warmup, client.send_step))
    return out


def _median_us(seconds: list[float]) -> float:
    return round(float(np.median(seconds)) * 1e6, 1)


# ---------------------------------------------------------------- report


def run(batches: Iterator[int] | list[int], steps: int, warmup: int, shape: PoolShape
        ) -> dict[str, dict[str, float]]:
    results = {}
    for batch in batches:
        row = measure_managers(batch, steps)
        row |= measure_in_process(batch, steps, warmup, shape)
        row |= measure_transports(batch, steps, warmup, shape)
        results[str(batch)] = row
        print(f"batch {batch}: {row}", file=sys.stderr)
    return results


def ratios(row: dict[str, float]) -> dict[str, float]:
    """The targets, as numbers: each <= 1 when met."""
    return {
        "compiled_vs_numpy": round(row["manager_us"] / row["manager_numpy_us"], 3),
        "service_vs_2x_manager_plus_commit": round(
            row["service_inproc_us"] / (2 * row["manager_us"] + row["commit_us"]), 3),
        "ipc_minus_inproc_us": round(row["ipc_us"] - row["service_inproc_us"], 1),
        "rest_tcp_minus_inproc_us": round(row["rest_tcp_us"] - row["service_inproc_us"], 1),
    }


def host() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "load_average_at_start": os.getloadavg()}


def markdown(results: dict[str, dict[str, float]]) -> str:
    keys = ["manager_numpy_us", "manager_us", "service_inproc_us", "commit_us", "ipc_us",
            "rest_tcp_us"]
    lines = ["| batch | " + " | ".join(keys) + " | compiled / numpy | service / (2 manager + "
             "commit) |", "|---:|" + "---:|" * (len(keys) + 2)]
    for batch, row in results.items():
        r = ratios(row)
        lines.append(f"| {batch} | " + " | ".join(f"{row[k]:.0f}" for k in keys)
                     + f" | {r['compiled_vs_numpy']:.2f} | "
                       f"{r['service_vs_2x_manager_plus_commit']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="batch 256 only, fewer steps (default: batches 64, 256, 1024)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (batch 256 with --quick) instead of a table")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement "
                        "(default 150 with --quick, 400 otherwise)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps before timing")
    parser.add_argument("--device", default="cpu", help="the service's pool device")
    parser.add_argument("--layers", type=int, default=2, help="the service pool's layers")
    parser.add_argument("--kv-heads", type=int, default=2, help="the service pool's KV heads")
    parser.add_argument("--head-dim", type=int, default=64, help="the service pool's head dim")
    parser.add_argument("--out", type=Path, help="also write the full results here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = args.steps or (150 if args.quick else 400)
    shape = PoolShape(args.layers, args.kv_heads, args.head_dim, args.device)
    batches = [256] if args.quick else [64, 256, 1024]
    results = run(batches, steps, args.warmup, shape)
    full = {"host": host(), "shape": shape.__dict__, "steps": steps, "batches": results,
            "ratios": {b: ratios(row) for b, row in results.items()}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(full, indent=2) + "\n")
    if args.json:
        print(json.dumps(results["256"] if args.quick else full))
    else:
        print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
