"""The worker's decode step on its own, next to what a decode step must cost, in one run.

    python benchmarks/bench_decode.py --out benchmarks/results/bench_decode.json   # on a GPU
    python benchmarks/bench_decode.py --quick                                      # CPU, seconds

Per model shape (the ~1B Llama shape: 16 layers, hidden 2048, 32 / 8 heads x 64; the 8B shape:
32 layers, hidden 4096, intermediate 14336, 32 / 8 heads x 128; random weights, bf16), a batch
of 64 prompts of 1536 tokens decodes with D = 3 (every decode padded to 1 + 3 tokens, so each
decode step has one shape), the service in process. Side by side:

- ``worker``: `worker.engine.Engine` with its decode steps replayed as CUDA graphs (each batch
  bucket's captured by `Engine.warm_up` before the run), synchronous (``sync``: the service
  commits the accepted tokens in its call; ``sync+own-commit``: registered as an overlap
  worker, the worker commits them inside its step and the call commits nothing) and one step
  ahead (``overlap``): the decode steps' GPU time (``decode_busy_ms``, CUDA events around each
  step's device work) and wall time, and tokens/s over the whole run. The steady step
  (``step_wall_ms``) is the median time from one replayed launch to the next at the full batch:
  the run's averages also hold the prefill chunks still on the device when decoding starts, up
  to two of them one step ahead, and the shrinking batch at the end;
- ``no_attention``: the same model's forward over the same 256 packed tokens with attention
  left out (a `PoolStep` that stages every layer's K/V and attends to nothing: the GEMMs,
  norms, rotary, staging and logits alone), one graph, with the fused kernels the worker runs
  (`worker.fusion`: norms, rotary and staging, gated MLPs); ``no_attention_stock`` the same with
  transformers' own modules;
- ``sdpa_contiguous``: that forward with torch's SDPA over a contiguous KV cache of the same
  context instead (grouped heads, causal among the step's tokens), one graph: what the step
  would cost with a plain cache and no paging;
- ``copy``: a device-to-device copy's bandwidth, the ceiling; ``kv_bytes``: the pool bytes one
  decode step must read (every layer's K and V of every entry's history and step), and
  ``weight_bytes``;
- ``generate``: `model.generate` (SDPA, its own cache, transformers' own modules) on the same
  prompts and new tokens.

Each worker row also has the replayed launches' host time (``step_launch_us``: inputs, replay
and the outcome's copy; ``step_metadata_us`` of it for the inputs) and, with
``--host-profile``, the functions it goes to, and those of the decode steps' service calls.
With ``--gap-profile`` the one-step-ahead row also has ``device_gaps``: over a few steady
decode steps of a third run after the measured one, the device's busy and idle time a step
(torch's profiler), and the idle time by the two device operations on either side of it: what
the device waited between.

Targets it reports as ratios of the same run: the replayed steps' median GPU time
``step_gpu_ms <= 1.15 x (no_attention + kv_bytes at 70% of the copy bandwidth)`` (``vs_target``;
``wall_vs_target`` for ``step_wall_ms``),
and the bytes' floor ``(weight_bytes + kv_bytes) /
copy``. ``--quick``: a 2-layer float32 model on the CPU, eager (no graphs there), to exercise
the code.
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
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_attention import copy_us, graph_us, host_us
from bench_worker import connect, machine
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.attention.hook import ATTN_IMPLEMENTATION, PoolStep
from kvalloc.worker.attention.pool_attention import PagedLayout
from kvalloc.worker.drafters import DeviceOracleDrafter
from kvalloc.worker.engine import Engine
from kvalloc.worker.fusion import fuse_model
from kvalloc.worker.model import kv_shape, pool_for_model, random_model
from kvalloc.worker.requests import NamedPrompt
from kvalloc.worker.run_stats import RunStats
from kvalloc.worker.step.device_step import Launched, LaunchPlan

SHAPES = {
    "1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=4096, eos_token_id=None),
    "8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=4096, eos_token_id=None),
}
QUICK = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    eos_token_id=None)
FULL = {"batch": 64, "prompt_len": 1536, "new_tokens": 48, "max_step_tokens": 8192,
        "dtype": "bfloat16", "device": "cuda"}
SMALL = {"batch": 4, "prompt_len": 48, "new_tokens": 6, "max_step_tokens": 256,
         "dtype": "float32", "device": "cpu"}
DRAFT_LEN = 3
ORACLE_RATE = 0.6
CONTIGUOUS = "bench_sdpa_contiguous"
FIRST_KERNEL = "_metadata"  # every decode graph's first kernel (`worker.kernels.step_metadata`)


def timed_ms(fn: Callable[[], object], device: torch.device, *, repeats: int = 20) -> float:
    """Milliseconds of one ``fn()``: a replayed CUDA graph's GPU time on CUDA (the median of
    ``repeats`` replays), the median wall time of eager calls on a CPU."""
    if device.type != "cuda":
        return host_us(fn, repeats) / 1e3
    return graph_us(fn, launches=1, repeats=repeats) / 1e3


def prompts_for(model: Any, setup: dict[str, Any], seed: int) -> list[NamedPrompt]:
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    return [NamedPrompt(f"p{i}", rng.integers(0, vocab, setup["prompt_len"]).tolist())
            for i in range(setup["batch"])]


def worker_rows(model: Any, prompts: list[NamedPrompt], setup: dict[str, Any],
                seed: int, *, host_profile: bool = False,
                gap_profile: bool = False) -> list[dict[str, Any]]:
    """The engine's decode steps, synchronous and one step ahead, graphs on where CUDA is;
    ``host_profile``: the warm-up run's launches profiled on the host, ``gap_profile``: the
    device's timeline one step ahead (`GapTrace`) in a run after the measured one."""
    graphs = setup["device"] == "cuda"
    pool = pool_for_model(model.config, longest=setup["prompt_len"] + setup["new_tokens"],
                          num_requests=setup["batch"], draft_len=DRAFT_LEN,
                          dtype=setup["dtype"], device=setup["device"],
                          max_batch_size=setup["batch"])
    # The first steps at a shape compile its kernels (Triton, cold cache): they may keep the
    # worker silent for longer than the default lease. One worker at a time: a service of one
    # worker needs no step fence for the overlap worker (docs/protocol.md).
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=setup["max_step_tokens"],
                                     lease_ttl_s=600.0, max_workers=1))
    # Random weights: the drafts' truth is random too, so acceptance stays near the oracle's
    # rate times the model's own agreement; every decode runs 1 + D tokens all the same.
    rng = np.random.default_rng(seed)
    truth = {p.req_id: rng.integers(0, model.config.vocab_size, setup["new_tokens"]).tolist()
             for p in prompts}
    rows = []
    try:
        # (registered as an overlap worker: commits itself, runs one step ahead; it keeps its
        # own block table where it runs ahead, as `kvalloc worker` registers)
        for registered, overlap in ((False, False), (True, False), (True, True)):
            with connect("in-process", core, overlap=registered, own_table=overlap) as client:
                functions: dict[str, Any] = {}
                # The first run compiles for the shapes; the device's timeline is traced in a
                # run after the measured one: once torch's profiler has run, every launch
                # costs the host more.
                runs = ["warm-up", "measured"] + (["traced"] if gap_profile and overlap
                                                  and graphs else [])
                for run in runs:
                    drafter = DeviceOracleDrafter(truth, ORACLE_RATE,
                                                  vocab_size=model.config.vocab_size,
                                                  device=model.device, seed=seed)
                    engine = Engine(model, client, drafter, draft_len=DRAFT_LEN,
                                    overlap=overlap, cuda_graphs=graphs, pad_decodes=True)
                    profiled = host_profile and run == "warm-up"
                    engine.warm_up()  # every graph captured before the first step
                    steps = StepLog(engine, cProfile.Profile() if profiled else None,
                                    cProfile.Profile() if profiled else None,
                                    trace=GapTrace() if run == "traced" else None)
                    engine.run(prompts, setup["new_tokens"])
                    steps.close()  # the client serves the next run's engine too
                    if profiled:
                        functions = {key: value for key, value in steps.summary().items()
                                     if key.endswith("_host_functions")}
                    if run == "measured":
                        measured = {**steps.summary(), **run_figures(engine.stats)}
                        if graphs and overlap:
                            measured["replay_kernels"] = replay_kernels(engine)
                    if run == "traced":
                        functions["device_gaps"] = steps.summary()["device_gaps"]
                mode = "overlap" if overlap else "sync+own-commit" if registered else "sync"
                row = {"mode": mode + ("+graphs" if graphs else ""), **measured, **functions}
                row["decode_tokens_per_s"] = round(
                    1e3 * setup["batch"] * (1 + row["acceptance_rate"] * DRAFT_LEN)
                    / row["decode_step_ms"], 1)
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    finally:
        core.close()
    return rows


class StepLog:
    """Each decode-only step an engine launches: its shape as it ran (grown to its batch
    bucket), whether it replayed a graph, its GPU time (CUDA events), its host time to lay out
    and upload its inputs, and the host time of the whole launch. ``profiler``: where the
    steady launches' host time goes (the replayed ones; every decode step's without graphs),
    function by function (cProfile, which slows what it times: its figures rank, the
    unprofiled ones measure); ``call_profiler``: the same for the service calls of decode-only
    steps (those with no prompt in them)."""

    def __init__(self, engine: Engine, profiler: cProfile.Profile | None = None,
                 call_profiler: cProfile.Profile | None = None, *,
                 trace: GapTrace | None = None) -> None:
        """``trace``: told of every replayed decode launch (`GapTrace.launched`)."""
        self.steps: list[tuple[tuple[int, int], bool, Launched, float]] = []
        self.trace = trace
        self.started: list[float] = []  # each logged step's launch, on the host's clock
        self.profiler, self.profiled = profiler, 0
        launch, graphs = engine.step.launch, engine.step.graphs

        def logged(plan: LaunchPlan) -> Launched:
            replays = plan.decode_only and engine.step.replays(plan)
            profiled = profiler is not None and plan.decode_only and (graphs is None or replays)
            if profiled:
                profiler.enable()
                self.profiled += 1
            started = time.perf_counter()
            launched = launch(plan)
            host_s = time.perf_counter() - started
            if profiled:
                profiler.disable()
            if plan.decode_only:
                self.steps.append(((launched.ran, int(plan.num_tokens[0])), replays,
                                   launched, host_s))
                self.started.append(started)
                if trace is not None and replays:
                    trace.launched()
            return launched

        engine.step.launch = logged  # type: ignore[method-assign]
        self.call_profiler, self.calls_profiled = call_profiler, 0
        if call_profiler is not None:
            step = engine.client.step

            def profiled_call(**call: Any) -> Any:
                if "new" in call or "prefill" in call:
                    return step(**call)
                self.calls_profiled += 1
                call_profiler.enable()
                try:
                    return step(**call)
                finally:
                    call_profiler.disable()

            engine.client.step = profiled_call  # type: ignore[method-assign]
        self._client = engine.client

    def close(self) -> None:
        """Give the client its own ``step`` back: it outlives this log's engine."""
        vars(self._client).pop("step", None)
        if self.trace is not None:
            self.trace.close()

    def step_wall_ms(self) -> float | None:
        """The median time from one replayed launch to the next of the same shape: the step's
        period on the host's clock once nothing else (prefill chunks still on the device, a
        shrinking batch) is in it. One step ahead, the device's period; synchronous, the
        device's and the host's in turn. Without graphs, every decode step counts."""
        graphs = any(replayed for _, replayed, _, _ in self.steps)
        gaps = [b - a for a, b, (shape_a, replayed_a, _, _), (shape_b, replayed_b, _, _)
                in zip(self.started, self.started[1:], self.steps, self.steps[1:], strict=False)
                if shape_a == shape_b and ((replayed_a and replayed_b) or not graphs)]
        return round(1e3 * statistics.median(gaps), 3) if gaps else None

    def summary(self) -> dict[str, Any]:
        """Medians over the steady state: the decode steps that replayed a graph (all of
        them where there are no graphs)."""
        steady = [(launched, host_s) for _, replayed, launched, host_s in self.steps
                  if replayed] or [(launched, host_s) for _, _, launched, host_s in self.steps]
        shapes: dict[str, int] = {}
        for (entries, width), replayed, _, _ in self.steps:
            key = f"{entries}x{width}{' replayed' if replayed else ''}"
            shapes[key] = shapes.get(key, 0) + 1
        gpu = [s.started.elapsed_time(s.done) for s, _ in steady if s.done is not None]
        summary = {"steady_steps": len(steady), "shapes": shapes,
                   "step_gpu_ms": round(statistics.median(gpu), 3) if gpu else None,
                   "step_metadata_us": round(1e6 * statistics.median(
                       s.metadata_s for s, _ in steady), 1) if steady else None,
                   "step_launch_us": round(1e6 * statistics.median(
                       host_s for _, host_s in steady), 1) if steady else None,
                   "step_wall_ms": self.step_wall_ms()}
        if self.profiler is not None and self.profiled:
            summary["launch_host_functions"] = host_functions(self.profiler, self.profiled)
        if self.call_profiler is not None and self.calls_profiled:
            summary["call_host_functions"] = host_functions(self.call_profiler,
                                                            self.calls_profiled)
        if self.trace is not None:
            summary["device_gaps"] = self.trace.gaps()
        return summary


class GapTrace:
    """The device's timeline over ``active`` replayed decode steps after the first ``skip``
    (torch's profiler, CUDA activity only): what the device did, and waited for, between two
    forwards."""

    def __init__(self, skip: int = 16, active: int = 8) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.active = active
        self._profile = profile(activities=[ProfilerActivity.CUDA],
                                schedule=schedule(wait=skip, warmup=1, active=active, repeat=1))
        self._profile.start()
        self._open = True

    def launched(self) -> None:
        """A replayed decode step was launched: the schedule moves one step on."""
        if self._open:
            self._profile.step()

    def close(self) -> None:
        if self._open:
            torch.cuda.synchronize()
            self._profile.stop()
            self._open = False

    def gaps(self, top: int = 12, lead: int = 8) -> dict[str, Any]:
        """Busy and idle microseconds a step over the traced steps; the idle time between each
        pair of device operations (``after`` -> ``before``), the largest first; and
        ``before_forward``: the ``lead`` operations before the last traced forward's first
        kernel (the step's metadata, `FIRST_KERNEL`), each with the idle time before it."""
        from torch.autograd import DeviceType

        events = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                        for e in self._profile.profiler.kineto_results.events()
                        if e.device_type() == DeviceType.CUDA)
        if not events:
            return {}
        busy, waited, between = idle_sweep(events)
        idle = sum(waited)
        steps = self.active
        pairs = sorted(between.items(), key=lambda item: -sum(item[1]))[:top]
        firsts = [i for i, (_, _, name) in enumerate(events) if name == FIRST_KERNEL]
        lead_in = range(max(0, firsts[-1] - lead), firsts[-1] + 1) if firsts else range(0)
        return {"steps": steps, "busy_us_per_step": round(busy / 1e3 / steps, 1),
                "idle_us_per_step": round(idle / 1e3 / steps, 1),
                "idle_between": [{"after": a, "before": b,
                                  "us_per_step": round(sum(gaps) / 1e3 / steps, 2),
                                  "times_per_step": round(len(gaps) / steps, 2)}
                                 for (a, b), gaps in pairs],
                "before_forward": [{"op": events[i][2][:70],
                                    "us": round((events[i][1] - events[i][0]) / 1e3, 2),
                                    "idle_before_us": round(waited[i] / 1e3, 2)}
                                   for i in lead_in]}


def idle_sweep(events: list[tuple[int, int, str]]
               ) -> tuple[int, list[int], dict[tuple[str, str], list[int]]]:
    """Over device operations ``(start_ns, stop_ns, name)`` sorted by start (overlapping where
    streams run side by side): the nanoseconds some operation ran, the idle time before each
    operation, and the idle times by the operation that ended last before them and the one
    they ended at (names cut to 70 characters)."""
    busy = 0
    waited = [0] * len(events)
    between: dict[tuple[str, str], list[int]] = {}
    end, last = events[0][0], events[0][2]
    for i, (start, stop, name) in enumerate(events):
        if start > end:
            waited[i] = start - end
            between.setdefault((last[:70], name[:70]), []).append(start - end)
        busy += max(0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    return busy, waited, between


def host_functions(profiler: cProfile.Profile, steps: int, top: int = 15
                   ) -> list[dict[str, Any]]:
    """The functions a profiled launch spent its host time in, most first (their own time)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [{"function": f"{Path(file).name}:{line}:{name}",
             "self_us_per_step": round(1e6 * own / steps, 1),
             "total_us_per_step": round(1e6 * total / steps, 1), "calls_per_step": calls // steps}
            for (file, line, name), (_, calls, own, total, _) in rows]


def replay_kernels(engine: Engine, replays: int = 5, top: int = 12) -> list[dict[str, Any]]:
    """Where a replayed decode step's GPU time goes: the kernels of the most replayed graph,
    from torch's profiler over a few more replays after the run (the rows' state they change
    is the finished run's)."""
    replay = engine.step.graphs.most_replayed if engine.step.graphs is not None else None
    if replay is None:
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    return [{"kernel": e.key[:90], "us_per_step": round(e.device_time_total / replays, 1),
             "calls_per_step": e.count // replays, "share": round(e.device_time_total / total, 3)}
            for e in events[:top]]


def run_figures(s: RunStats) -> dict[str, Any]:
    return {"decode_busy_ms": round(1e3 * s.decode_busy_s / max(s.decode_steps, 1), 3),
            "decode_step_ms": round(1e3 * s.decode_wall_s / max(s.decode_steps, 1), 3),
            "decode_call_ms": round(1e3 * s.decode_call_s / max(s.decode_steps, 1), 3),
            "decode_steps": s.decode_steps, "graph_replays": s.graph_replays,
            "warm_up_shapes": s.warm_up_shapes, "warm_up_s": round(s.warm_up_s, 2),
            "tokens_per_s": round(s.tokens_per_s, 1),
            "acceptance_rate": round(s.acceptance_rate, 4)}


def not_attending(model: Any, num_tokens: int) -> PoolStep:
    """A step of ``num_tokens`` over a scratch pool that stages every layer's K/V and attends to
    nothing: the worker's forward (its fused kernels too) with attention left out."""
    layers, kv_heads, dim = kv_shape(model.config)
    device, tokens_per_block = model.device, 16
    pool = torch.zeros(layers, 2, 1, tokens_per_block, kv_heads, dim, dtype=model.dtype,
                       device=device)
    staging = torch.empty(layers, 2, num_tokens, kv_heads, dim, dtype=model.dtype,
                          device=device)
    one = np.zeros(1, dtype=np.int64)
    layout = PagedLayout.build(torch.zeros(1, 1, dtype=torch.int32, device=device),
                               tokens_per_block, rows=one, query_starts=one,
                               query_lens=np.array([num_tokens]), starts=one,
                               group_width=num_tokens)
    return PoolStep.of(pool, staging, layout, attend=False)



class ContiguousCache:
    """Per layer a ``[B, Hkv, context, D]`` K and V; the step's ``q`` new tokens a request go
    to its last ``q`` places, and SDPA attends over all of it, causal among the new ones."""

    def __init__(self, config: Any, batch: int, context: int, queries: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        layers, kv_heads, dim = kv_shape(config)
        self.kv = torch.randn(layers, 2, batch, kv_heads, context, dim, dtype=dtype,
                              device=device)
        self.batch, self.queries = batch, queries
        keys = torch.arange(context, device=device)
        new = torch.arange(queries, device=device) + context - queries
        self.mask = keys[None, :] <= new[:, None]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: Any, **kwargs: Any) -> tuple[Any, None]:
        b, q = self.batch, self.queries
        cache = self.kv[module.layer_idx]

        def per_request(x: torch.Tensor) -> torch.Tensor:  # [1, H, B*q, D] -> [B, H, q, D]
            return x[0].unflatten(1, (b, q)).transpose(0, 1)

        cache[:, :, :, -q:] = torch.stack([per_request(key), per_request(value)])
        out = F.scaled_dot_product_attention(per_request(query), cache[0], cache[1],
                                             attn_mask=self.mask, enable_gqa=True,
                                             scale=kwargs.get("scaling"))
        heads, dim = out.shape[1], out.shape[3]
        return out.transpose(1, 2).reshape(1, b * q, heads, dim), None


def step_inputs(model: Any, setup: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A decode step's packed ids and positions at mid-run context, and that context."""
    batch, queries = setup["batch"], 1 + DRAFT_LEN
    context = setup["prompt_len"] + setup["new_tokens"] // 2 + queries
    ids = torch.randint(0, model.config.vocab_size, (1, batch * queries), device=model.device)
    positions = (torch.arange(queries, device=model.device) + context - queries).repeat(batch)
    return ids, positions, context


def forward_ms(model: Any, ids: torch.Tensor, positions: torch.Tensor,
               implementation: str, **extra: Any) -> float:
    """The forward over ``ids`` with ``implementation``'s attention (`timed_ms`); ``extra``
    goes to the model (a `PoolStep`, say)."""
    try:
        with torch.inference_mode():
            model.set_attn_implementation(implementation)
            return round(timed_ms(lambda: model(input_ids=ids, position_ids=positions[None],
                                                use_cache=False, **extra), model.device), 3)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def no_attention_ms(model: Any, setup: dict[str, Any]) -> float:
    """The forward without attention, as the model's modules run it now (`not_attending`)."""
    ids, positions, _ = step_inputs(model, setup)
    return forward_ms(model, ids, positions, ATTN_IMPLEMENTATION,
                      kvalloc_step=not_attending(model, ids.shape[1]))


def reference_rows(model: Any, setup: dict[str, Any]) -> dict[str, Any]:
    """The forward without attention and with SDPA over a contiguous cache, the copy
    bandwidth and the bytes a decode step must read."""
    ids, positions, context = step_inputs(model, setup)
    batch, queries = setup["batch"], 1 + DRAFT_LEN
    cache = ContiguousCache(model.config, batch, context, queries, model.dtype, model.device)
    AttentionInterface.register(CONTIGUOUS, cache.attend)
    figures: dict[str, Any] = {
        "no_attention_ms": no_attention_ms(model, setup),
        "sdpa_contiguous_ms": forward_ms(model, ids, positions, CONTIGUOUS)}
    layers, kv_heads, dim = kv_shape(model.config)
    item = model.dtype.itemsize
    figures["kv_bytes"] = 2 * layers * batch * context * kv_heads * dim * item
    figures["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    figures["copy_gbps"] = round(copy_gbps(model.device), 1)
    del cache
    return figures


def copy_gbps(device: torch.device) -> float:
    """A device-to-device copy's bandwidth, read + write (`bench_attention`'s copy)."""
    nbytes = 1 << 30
    if device.type != "cuda":
        src = torch.empty(nbytes // 16, dtype=torch.uint8)
        return 2 * src.numel() / host_us(src.clone, 5) / 1e3
    return 2 * nbytes / copy_us(nbytes, launches=8, repeats=10) / 1e3


def generate_row(model: Any, prompts: list[NamedPrompt], new_tokens: int) -> dict[str, Any]:
    """`model.generate`'s tokens/s over the run, and over its decode alone: a run of
    ``new_tokens`` less a run of one token (the prefill)."""
    ids = torch.tensor([p.token_ids for p in prompts], device=model.device)
    model.set_attn_implementation("sdpa")

    def wall_s(tokens: int) -> float:
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=tokens, min_new_tokens=tokens)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    try:
        with torch.inference_mode():
            wall_s(2)  # picks its kernels
            prefill, whole = wall_s(1), wall_s(new_tokens)
    finally:
        model.set_attn_implementation("kvalloc")
    decode = max(whole - prefill, 1e-9)
    return {"tokens_per_s": round(len(prompts) * new_tokens / whole, 1),
            "decode_tokens_per_s": round(len(prompts) * (new_tokens - 1) / decode, 1),
            "decode_step_ms": round(1e3 * decode / (new_tokens - 1), 3),
            "wall_s": round(whole, 3)}


def shape_row(name: str, config: Any, setup: dict[str, Any], seed: int, *,
              host_profile: bool = False, gap_profile: bool = False) -> dict[str, Any]:
    model = random_model(config, seed=seed, dtype=getattr(torch, setup["dtype"]),
                         device=setup["device"])
    prompts = prompts_for(model, setup, seed)
    # transformers' own modules first: generate, and the forward without attention as it is.
    row: dict[str, Any] = {"shape": name,
                           "generate": generate_row(model, prompts, setup["new_tokens"]),
                           "no_attention_stock_ms": no_attention_ms(model, setup)}
    fuse_model(model)  # what the worker's engine does on CUDA: the forward it runs
    row.update(reference_rows(model, setup))
    row["worker"] = worker_rows(model, prompts, setup, seed, host_profile=host_profile,
                                gap_profile=gap_profile)
    bandwidth = row["copy_gbps"] * 1e6  # bytes per ms
    row["bytes_floor_ms"] = round((row["weight_bytes"] + row["kv_bytes"]) / bandwidth, 3)
    row["target_ms"] = round(1.15 * (row["no_attention_ms"]
                                     + row["kv_bytes"] / (0.7 * bandwidth)), 3)
    for run in row["worker"]:
        if run["step_gpu_ms"] is not None:
            run["vs_target"] = round(run["step_gpu_ms"] / row["target_ms"], 3)
        if run["step_wall_ms"] is not None:
            run["wall_vs_target"] = round(run["step_wall_ms"] / row["target_ms"], 3)
    print(json.dumps({k: v for k, v in row.items() if k != "worker"}), flush=True)
    del model
    if setup["device"] == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the rows and the machine as JSON")
    parser.add_argument("--host-profile", action="store_true",
                        help="where the launches' host time goes, function by function (from "
                             "each warm-up run; the measured runs stay unprofiled)")
    parser.add_argument("--gap-profile", action="store_true",
                        help="the device's idle time between two forwards one step ahead, and "
                             "what it lies between (a run after the measured one; CUDA graphs "
                             "only)")
    args = parser.parse_args()
    setup = SMALL if args.quick else FULL
    if setup["device"] == "cuda" and not torch.cuda.is_available():
        parser.error("the full benchmark needs CUDA; --quick runs on the CPU")
    if args.quick:
        torch.set_num_threads(1)
    shapes = {"quick": QUICK} if args.quick else {s: SHAPES[s] for s in args.shapes}
    rows = [shape_row(name, config, setup, args.seed, host_profile=args.host_profile,
                      gap_profile=args.gap_profile)
            for name, config in shapes.items()]
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": machine(setup["device"]), "setup": setup,
                                        "draft_len": DRAFT_LEN, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
