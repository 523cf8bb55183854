"""A real model decoding through kvalloc: tokens/s, step time, the per-step call's share of it, and
the GPU's idle time between forwards, synchronous and one step ahead (``--overlap``).

    python benchmarks/bench_worker.py --out benchmarks/results/worker_cuda.json     # on a GPU
    python benchmarks/bench_worker.py --quick                                       # CPU, seconds

Full run: a ~1B Llama shape (16 layers, hidden 2048, 32 query heads, 8 KV heads x 64, random
weights, bf16), batches of 32 and 64 prompts of 512-2048 tokens, 64 new tokens each, D=3 with
the oracle drafter at a 60% per-token hit rate. Side by side in one run, with the service in
process and behind IPC (a ``kvalloc serve`` subprocess sharing its pool over CUDA IPC; its
messages over ZeroMQ, ``ipc``, and over its plain Unix stream socket, ``stream``): a plain run
(D=0, which also gives the oracle its continuation), the n-gram and oracle drafters
synchronously, and the oracle drafted on the device by a worker one step ahead (``overlap``).
``decode_call_share`` is the call's share of the wall time of decode-only steps (no prefill in
them). ``idle_ms``: per step, the GPU time between the end of one step's device work and the
start of the next one's (CUDA events on the worker's stream): a synchronous worker leaves the
GPU idle for its whole call, an overlap worker makes the call while the GPU runs the previous
step. ``decode_idle_ms`` and ``decode_idle_share``: the same before decode-only steps alone, the
steady state (the prefill steps' long forwards dominate ``idle_share``). ``metadata_us``: the
worker's host time per step to lay out the step (its columns and their one upload). On a
GPU the overlap worker also runs with its decode steps replayed as CUDA graphs
(``overlap+graphs``; ``graph_replays`` counts them). Each batch first runs untimed in process,
so that the model's first steps at the batch's shapes count in no transport's figures.

``--quick``: a 2-layer model in float32 on the CPU, batches of 4 and 8 prompts of 16-64 tokens.
``--batches`` and ``--transports`` run a part of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvalloc.allocator import PoolConfig
from kvalloc.server.client import Client
from kvalloc.server.devtools.launch import ServiceProcess
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.drafters import DeviceOracleDrafter, Drafter, NgramDrafter, OracleDrafter
from kvalloc.worker.engine import Engine
from kvalloc.worker.model import pool_for_model, random_model
from kvalloc.worker.requests import NamedPrompt

FULL = {
    "model": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, max_position_embeddings=4096, eos_token_id=None),
    "dtype": "bfloat16", "device": "cuda", "batches": (32, 64), "prompt_len": (512, 2048),
    "new_tokens": 64, "max_step_tokens": 8192,
}
QUICK = {
    "model": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, eos_token_id=None),
    "dtype": "float32", "device": "cpu", "batches": (4, 8), "prompt_len": (16, 64),
    "new_tokens": 8, "max_step_tokens": 512,
}
DRAFT_LEN = 3
ORACLE_RATE = 0.6
TRANSPORTS = ("in-process", "ipc", "stream")


@contextlib.contextmanager
def service(transport: str, config: ServiceConfig, workdir: Path) -> Iterator[Any]:
    """A core in this process, or a ``kvalloc serve`` subprocess."""
    if transport == "in-process":
        core = ServiceCore(config)
        try:
            yield core
        finally:
            core.close()
        return
    with ServiceProcess(workdir, *serve_flags(config), tcp=False) as process:
        yield process


@contextlib.contextmanager
def connect(transport: str, target: Any, *, overlap: bool = False,
            own_table: bool | None = None) -> Iterator[Client]:
    """A registered, attached client of ``target`` (`service`'s): in process, or over IPC
    (``ipc``: ZeroMQ; ``stream``: the plain Unix stream socket); ``overlap`` and ``own_table``
    as `Client.register` takes them."""
    client = (Client.in_process(target, worker_id="bench") if transport == "in-process"
              else Client(getattr(target, transport), worker_id="bench", timeout_s=120.0))
    with client:
        client.register(overlap=overlap, own_table=own_table)
        try:
            yield client
        finally:
            client.deregister()


def serve_flags(config: ServiceConfig) -> list[str]:
    pool: PoolConfig = config.pool
    flags = {name: getattr(pool, name) for name in (
        "num_blocks", "tokens_per_block", "num_layers", "num_kv_heads", "head_dim", "dtype",
        "device", "max_batch_size", "max_seq_len", "max_draft_len")}
    flags["max_step_tokens"] = config.max_step_tokens
    flags["lease_ttl_s"] = config.lease_ttl_s
    # A service of more workers fences an overlap worker's steps (docs/protocol.md).
    flags["max_workers"] = config.max_workers
    return [*(arg for name, value in flags.items()
              for arg in (f"--{name.replace('_', '-')}", str(value))),
            *(() if config.nwor else ("--no-nwor",))]


def measure(model: Any, client: Client, prompts: list[NamedPrompt], new_tokens: int,
            drafter: Drafter | DeviceOracleDrafter | None, draft_len: int, *,
            overlap: bool = False, cuda_graphs: bool = False
            ) -> tuple[dict[str, list[int]], dict[str, Any]]:
    engine = Engine(model, client, drafter, draft_len=draft_len, overlap=overlap,
                    cuda_graphs=cuda_graphs)
    if client.pool is not None and client.pool.kv.is_cuda:  # as the worker's CLI does
        engine.warm_up()
    outputs = engine.run(prompts, new_tokens)
    s = engine.stats
    return outputs, {
        "idle_ms": round(1e3 * s.device_idle_s / s.steps, 3),
        "busy_ms": round(1e3 * s.device_busy_s / s.steps, 3),
        # Decode-only steps' own GPU time: the prefill steps (long chunks on the reference
        # attention) dominate busy_ms and every mean over all steps.
        "decode_busy_ms": round(1e3 * s.decode_busy_s / max(s.decode_steps, 1), 3),
        # The GPU's idle time before decode-only steps: the steady state's share, which the
        # prefill steps' long forwards would hide in idle_share.
        "decode_idle_ms": round(1e3 * s.decode_idle_s / max(s.decode_steps, 1), 3),
        "decode_idle_share": round(
            s.decode_idle_s / max(s.decode_idle_s + s.decode_busy_s, 1e-12), 4),
        "idle_share": round(s.device_idle_s / max(s.device_idle_s + s.device_busy_s, 1e-12), 4),
        "metadata_us": round(1e6 * s.metadata_s / s.steps, 1),
        "forwards_ahead": s.forwards_ahead, "graph_replays": s.graph_replays,
        "tokens_per_s": round(s.tokens_per_s, 1), "steps": s.steps,
        "step_ms": round(1e3 * s.wall_s / s.steps, 3),
        "call_ms": round(1e3 * s.call_s / s.steps, 3),
        "call_share": round(s.call_share, 4),
        "decode_steps": s.decode_steps,
        "decode_step_ms": round(1e3 * s.decode_wall_s / max(s.decode_steps, 1), 3),
        "decode_call_ms": round(1e3 * s.decode_call_s / max(s.decode_steps, 1), 3),
        "decode_call_share": round(s.decode_call_share, 4),
        "acceptance_rate": round(s.acceptance_rate, 4), "preemptions": s.preemptions,
    }


def run(setup: dict[str, Any], seed: int,
        transports: tuple[str, ...] = TRANSPORTS) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    dtype = getattr(torch, setup["dtype"])
    model = random_model(setup["model"], seed=seed, dtype=dtype, device=setup["device"])
    rows = []
    for batch in setup["batches"]:
        lo, hi = setup["prompt_len"]
        prompts = [NamedPrompt(f"p{i}", rng.integers(0, model.config.vocab_size, int(n)).tolist())
                   for i, n in enumerate(rng.integers(lo, hi, batch, endpoint=True))]
        pool = pool_for_model(model.config, longest=hi + setup["new_tokens"],
                              num_requests=batch, draft_len=DRAFT_LEN, dtype=setup["dtype"],
                              device=setup["device"], max_batch_size=batch)
        # The first steps at a shape compile its kernels (Triton, cold cache): they may keep
        # the worker silent for longer than the default lease. One worker at a time: a service
        # of one worker needs no step fence for the overlap worker (docs/protocol.md).
        config = ServiceConfig(pool=pool, max_step_tokens=setup["max_step_tokens"],
                               lease_ttl_s=600.0, max_workers=1)
        with tempfile.TemporaryDirectory() as tmp:
            # Untimed, at the measured shapes: the model's first steps at a new batch shape pick
            # and compile its kernels, which would otherwise slow the first transport's runs.
            with service("in-process", config, Path(tmp)) as core:
                with connect("in-process", core) as client:
                    truth, _ = measure(model, client, prompts, setup["new_tokens"], None, 0)
                with connect("in-process", core, overlap=True) as client:
                    measure(model, client, prompts, setup["new_tokens"], device_oracle(
                        truth, model, seed), DRAFT_LEN, overlap=True)
            for transport in transports:
                with service(transport, config, Path(tmp)) as target:
                    new = [{"batch": batch, "transport": transport, **row}
                           for row in transport_rows(model, target, transport, prompts,
                                                     setup["new_tokens"], seed)]
                print(table(new, header=not rows), flush=True)
                rows += new
    return rows


def device_oracle(truth: dict[str, list[int]], model: Any, seed: int) -> DeviceOracleDrafter:
    return DeviceOracleDrafter(truth, ORACLE_RATE, vocab_size=model.config.vocab_size,
                               device=next(model.parameters()).device, seed=seed)


def transport_rows(model: Any, target: Any, transport: str, prompts: list[NamedPrompt],
                   new_tokens: int, seed: int) -> list[dict[str, Any]]:
    """The plain run, the synchronous drafters and the overlap worker, on one service."""
    rows = []
    with connect(transport, target) as client:
        # Warm-up, not measured: first calls compile and allocate (service and model).
        measure(model, client, prompts[:2], 2, NgramDrafter(), DRAFT_LEN)
        truth, row = measure(model, client, prompts, new_tokens, None, 0)
        rows.append({"mode": "sync", "drafter": "none", **row})
        drafters: dict[str, Drafter] = {
            f"oracle:{ORACLE_RATE}": OracleDrafter(truth, ORACLE_RATE,
                                                   vocab_size=model.config.vocab_size, seed=seed),
            "ngram": NgramDrafter()}
        for name, drafter in drafters.items():
            _, row = measure(model, client, prompts, new_tokens, drafter, DRAFT_LEN)
            rows.append({"mode": "sync", "drafter": name, **row})
    graphs = [False, True] if next(model.parameters()).is_cuda else [False]
    with connect(transport, target, overlap=True) as client:
        measure(model, client, prompts[:2], 2, None, 0, overlap=True)
        for cuda_graphs in graphs:
            _, row = measure(model, client, prompts, new_tokens,
                             device_oracle(truth, model, seed), DRAFT_LEN, overlap=True,
                             cuda_graphs=cuda_graphs)
            rows.append({"mode": "overlap+graphs" if cuda_graphs else "overlap",
                         "drafter": f"oracle:{ORACLE_RATE}", **row})
    return rows


COLUMNS = ("batch", "transport", "mode", "drafter", "tokens_per_s", "step_ms", "decode_step_ms",
           "decode_call_ms", "decode_call_share", "idle_ms", "idle_share", "decode_idle_ms",
           "decode_idle_share", "metadata_us",
           "forwards_ahead", "graph_replays", "acceptance_rate")


def table(rows: list[dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def machine(device: str) -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0))}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the rows and the machine as JSON")
    parser.add_argument("--batches", type=int, nargs="+", help="these batch sizes only")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=TRANSPORTS,
                        help="these transports only")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    if args.batches:
        setup = {**setup, "batches": tuple(args.batches)}
    if args.quick:
        torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared CPU
    if setup["device"] == "cuda" and not torch.cuda.is_available():
        parser.error("the full benchmark needs CUDA; --quick runs on the CPU")
    rows = run(setup, args.seed, tuple(args.transports))
    if args.out is not None:
        meta = {k: v for k, v in setup.items() if k != "model"}
        meta["model"] = setup["model"].to_diff_dict()
        args.out.write_text(json.dumps({"machine": machine(setup["device"]), "setup": meta,
                                        "draft_len": DRAFT_LEN, "rows": rows}, indent=1)
                            + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
