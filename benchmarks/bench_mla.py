"""The MLA decode kernel over a latent pool on the GPU, against a plain read of the same bytes.

DeepSeek-V3's per-layer shape: 128 query heads over one latent of 512 + 64 (bf16), batch 64
entries of 4 queries (1 + 3 drafts), history 1k, 4k and 16k tokens each in 16-token blocks in
random order. Per context, side by side:
- ``kernel``: `latent_attention_triton`'s time and the bandwidth it achieves on the bytes it
  must move (every entry's history latents once, the staged latents, the queries read and the
  latent output written: the heads of an entry share its latent reads, so these are the bytes);
- ``read``: a sum over a buffer of as many bytes (its bandwidth counts the read), and ``copy``,
  a device-to-device copy of as many (read + write): the ceilings, measured in the same run.
- ``gemm``: a bf16 matrix product of as many multiply-adds as the kernel's scores and weighted
  sums need (every query row against every latent of its entry: ``2 * rows * (R + P + R)``
  FLOPs a latent), the compute ceiling, measured in the same run. With 128 heads x 4 queries
  an entry does about 970 FLOPs per byte of latent it reads, beyond the ridge of a GPU like
  the H200 (~200): the decode step is compute-bound, so ``kernel_vs_gemm`` says how close the
  kernel is to its real ceiling and ``kernel_vs_read`` how far the read ceiling is out of reach.
Every figure is one CUDA graph of ``--launches`` back-to-back launches, replayed; the median of
``--repeats`` replays, divided by the launches (bench_attention's `graph_us`).

Each context also times every cut of `LATENT_CANDIDATES` (``sweep``, fastest first, each
with its time; one graph of ``--sweep-launches`` launches, median of ``--sweep-repeats``) and
names the fastest (``best``, and under the result's ``best`` by context): how the defaults are
checked. At 1k each candidate's output is also checked against the reference (``exact``; one
that is not is never the best); a cut the GPU's shared memory cannot hold is listed as not
fitting. ``--no-sweep`` times the default alone. ``--quick``: fewer repeats. On a machine
without CUDA ``--quick`` runs a tiny shape with every candidate in Triton's interpreter against
the reference, timed on the host: a smoke run.
Prints JSON; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import graph_us
from kvalloc.worker.attention.latent_attention import latent_attention
from kvalloc.worker.attention.latent_attention_triton import (
    LATENT_CANDIDATES,
    LatentLaunch,
    latent_attention_triton,
)
from kvalloc.worker.attention.pool_attention import PagedLayout

HEADS, RANK, ROPE = 128, 512, 64
BATCH, QUERIES, TPB = 64, 4, 16
CONTEXTS = (1024, 4096, 16384)
QUICK_CPU = {"heads": 4, "rank": 32, "rope": 16, "batch": 3, "contexts": (40,)}
BF16 = torch.bfloat16
TOLERANCE = 2e-2  # bf16, as the kernel's tests have it


class LatentStep:
    """One layer's tensors: ``batch`` entries of ``QUERIES`` tokens at ``history`` each."""

    def __init__(self, history: int, *, heads: int = HEADS, rank: int = RANK, rope: int = ROPE,
                 batch: int = BATCH, device: str = "cuda", dtype: torch.dtype = BF16) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        per_row = -(-(history + QUERIES) // TPB)
        num_blocks = batch * per_row + 64
        table = torch.randperm(num_blocks, device=device, generator=gen)[:batch * per_row]
        self.pool = torch.randn(num_blocks, TPB, 1, rank + rope, device=device, generator=gen,
                                dtype=dtype)
        n = batch * QUERIES
        self.q_latent = torch.randn(n, heads, rank, device=device, generator=gen, dtype=dtype)
        self.q_rope = torch.randn(n, heads, rope, device=device, generator=gen, dtype=dtype)
        self.staged = torch.randn(n, 1, rank + rope, device=device, generator=gen, dtype=dtype)
        lens = np.full(batch, QUERIES)
        self.layout = PagedLayout.build(
            table.view(batch, per_row).to(torch.int32), TPB, rows=np.arange(batch),
            query_starts=np.cumsum(lens) - lens, query_lens=lens,
            starts=np.full(batch, history), group_width=QUERIES)
        self.out = torch.empty_like(self.q_latent)
        size = dtype.itemsize
        self.bytes = ((batch * history + n) * (rank + rope)
                      + self.q_latent.numel() + self.q_rope.numel() + self.out.numel()) * size
        self.args = (self.q_latent, self.q_rope, self.staged, self.pool, self.layout)
        self.scale = (rank // 4 + rope) ** -0.5
        self.flops = 2 * heads * QUERIES * (2 * rank + rope) * batch * (history + QUERIES)

    def kernel(self, launch: LatentLaunch | None = None) -> torch.Tensor:
        return latent_attention_triton(*self.args, scale=self.scale, out=self.out,
                                       launch=launch)

    def reference(self) -> torch.Tensor:
        return latent_attention(*self.args, scale=self.scale)


def _gbps(nbytes: int, us: float) -> float:
    return round(nbytes / us / 1e3, 1)


def _tflops(flops: int, us: float) -> float:
    return round(flops / us / 1e6, 1)


def context_row(history: int, launches: int, repeats: int, sweep: tuple[int, int] | None
                ) -> dict:
    """One context's figures; ``sweep`` (launches, repeats), when given, times every
    candidate too."""
    step = LatentStep(history)
    expected = None
    if history == CONTEXTS[0]:  # the reference's dense scores need 72 GiB at 4k already
        expected = step.reference()
        torch.testing.assert_close(step.kernel(), expected, atol=TOLERANCE, rtol=TOLERANCE)
    buf = torch.empty(step.bytes // 2, dtype=BF16, device="cuda").normal_()
    dst, total = torch.empty_like(buf), torch.empty((), dtype=torch.float32, device="cuda")
    side = round((step.flops / 2) ** (1 / 3) / 128) * 128  # a square product of as many FLOPs
    a, b = (torch.randn(side, side, dtype=BF16, device="cuda") for _ in range(2))
    product = torch.empty_like(a)
    timed = {"kernel": graph_us(step.kernel, launches=launches, repeats=repeats),
             "read": graph_us(lambda: torch.sum(buf, 0, dtype=torch.float32, out=total),
                              launches=launches, repeats=repeats),
             "copy": graph_us(lambda: dst.copy_(buf), launches=launches, repeats=repeats),
             "gemm": graph_us(lambda: torch.mm(a, b, out=product), launches=launches,
                              repeats=repeats)}
    gemm_flops = 2 * side ** 3
    row = {"context": history, "batch": BATCH, "queries": QUERIES, "bytes": step.bytes,
           **{f"{name}_us": round(us, 1) for name, us in timed.items()},
           **{f"{name}_gbps": _gbps(step.bytes * (2 if name == "copy" else 1), timed[name])
              for name in ("kernel", "read", "copy")},
           "flops": step.flops, "kernel_tflops": _tflops(step.flops, timed["kernel"]),
           "gemm_tflops": _tflops(gemm_flops, timed["gemm"]),
           "kernel_vs_read": round(timed["read"] / timed["kernel"], 3),
           "kernel_vs_gemm": round(_tflops(step.flops, timed["kernel"])
                                   / _tflops(gemm_flops, timed["gemm"]), 3)}
    if sweep:
        swept = [_swept(step, launch, expected, *sweep) for launch in LATENT_CANDIDATES]
        row["sweep"] = sorted(swept, key=lambda r: (not r.get("exact", True), r["us"]))
        row["best"] = row["sweep"][0]
    return row


def _swept(step: LatentStep, launch: LatentLaunch, expected: torch.Tensor | None,
           launches: int, repeats: int) -> dict:
    """One cut's time, and against ``expected`` (when given) its largest error and whether
    it is within the tolerance; a cut whose tiles do not fit the GPU's shared memory is listed
    as not fitting (infinite time), not a failed sweep."""
    row = {"launch": repr(launch), "default": launch == LatentLaunch()}
    try:
        got = step.kernel(launch)
        us = graph_us(lambda: step.kernel(launch), launches=launches, repeats=repeats)
    except (OutOfResources, CompilationError) as error:
        return {**row, "us": float("inf"), "fits": False, "error": str(error)[:200]}
    row["us"] = round(us, 1)
    row["tflops"] = _tflops(step.flops, us)
    if expected is not None:
        row["max_abs_err"] = (got.float() - expected.float()).abs().max().item()
        row["exact"] = torch.allclose(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
    return row


def cpu_smoke() -> dict:
    """The kernel in Triton's interpreter against the reference on a tiny shape, cut as each
    candidate is."""
    shape = {k: QUICK_CPU[k] for k in ("heads", "rank", "rope", "batch")}
    rows = []
    for history in QUICK_CPU["contexts"]:
        step = LatentStep(history, device="cpu", dtype=torch.float32, **shape)
        expected = step.reference()
        for launch in LATENT_CANDIDATES:
            started = time.perf_counter()
            got = step.kernel(launch)
            host_ms = (time.perf_counter() - started) * 1e3
            rows.append({"context": history, **shape, "launch": repr(launch),
                         "max_abs_err": (got - expected).abs().max().item(),
                         "interpreter_ms": round(host_ms, 1)})
    return {"device": "cpu", "smoke": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--sweep-launches", type=int, default=5)
    parser.add_argument("--sweep-repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        if not args.quick:
            sys.exit("bench_mla: needs CUDA (on a CPU, only --quick runs, in the interpreter)")
        result = cpu_smoke()
    else:
        repeats = 5 if args.quick else 30
        result = {"device": torch.cuda.get_device_name(), "decode": []}
        for history in CONTEXTS:
            sweep = None if args.no_sweep else (args.sweep_launches, args.sweep_repeats)
            row = context_row(history, args.launches, repeats, sweep)
            result["decode"].append(row)
            if sweep:  # the fastest cut per context, at the top
                result.setdefault("best", {})[history] = {
                    k: row["best"][k] for k in ("launch", "us", "tflops")}
            if args.out:  # after every row: a run cut short still records what it measured
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
