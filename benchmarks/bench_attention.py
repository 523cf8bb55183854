"""The paged two-source attention kernel on the GPU, next to its physical references, one run.

Decode: batch 64, 4 queries an entry (1 + 3 drafts), 1.5k tokens of history each in the pool
(16-token blocks in random order), bf16, on the ~1B shape (32 query heads, 8 KV heads x 64) and
the 8B shape (32 / 8 x 128). Per layer, side by side:
- ``kernel``: `pool_attention_triton`'s time and the bandwidth it achieves on the bytes it must
  move (the history's K and V, the staged K/V, the queries read, the output written);
- ``copy``: a device-to-device copy of as many bytes (its bandwidth counts read + write), the
  ceiling; target: the kernel at >= 70% of it;
- ``sdpa``: cuDNN's SDPA on un-grouped heads (KV repeated to 32 heads, contiguous, no mask), the
  attention an engine with a contiguous cache would run; its bandwidth is on the bytes it reads.
Every figure is one CUDA graph of ``--launches`` back-to-back launches, replayed; the median of
``--repeats`` replays, divided by the launches (a graph, so launch overhead stays out of all).

``chunk``: 8 entries of 64 tokens (the longest the decode launch takes) at the same history,
the kernel against the torch reference (eager: it synchronises, so no graph holds it).

``--sweep`` also times every `LaunchConfig` in ``SWEEP`` on both shapes (how the defaults were
picked). ``--quick``: fewer repeats, for a smoke run. Prints JSON; ``--out`` writes it too.

``--prefill``: prefill instead, a chunk of 2048 tokens an entry after 0 and after 4096 tokens of
history, batch 1 and 4, both shapes, bf16: the kernel (the prefill launch; a graph as above)
against the torch reference (eager) and torch's SDPA (flash) over contiguous K/V at the same
grouping and causal alignment (the attention an engine with a contiguous cache would run), each
with its time and FLOP/s on the causal product's FLOPs (4 x head size per query-key pair and
query head). With ``--sweep`` also every `PrefillConfig` in ``PREFILL_SWEEP`` at 4096 tokens of
history and batch 4. On a machine without CUDA, ``--prefill --quick`` runs tiny shapes (2 KV
heads, chunks of 96) with the kernel in Triton's interpreter, timed on the host: a smoke run.
``mixed``: one step of 63 decodes (as above) and one 8192-token chunk, kernel against reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_commit import call_us  # one eager call from an idle device (the reference syncs)
from kvalloc.worker.attention.pool_attention import PagedLayout, pool_attention
from kvalloc.worker.attention.pool_attention_triton import (
    MAX_DECODE_QUERY,
    LaunchConfig,
    PrefillConfig,
    default_launch,
    default_prefill,
    pool_attention_triton,
)

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128)}  # query heads, KV heads, head size
BATCH, QUERIES, HISTORY, TPB = 64, 4, 1536, 16
SWEEP = [*(LaunchConfig(*c, splits=1) for c in itertools.product((32, 64), (4, 8), (2, 3))),
         *(LaunchConfig(n, w, 2, splits=2) for n, w in ((32, 4), (64, 4), (64, 8)))]
PREFILL_SWEEP = [PrefillConfig(*c) for c in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))]
CHUNK, PREFILL_HISTORIES, PREFILL_BATCHES = 2048, (0, 4096), (1, 4)
QUICK_SHAPES = {"tiny": (8, 2, 16), "tiny-mha": (2, 2, 32)}
QUICK_CHUNK, QUICK_HISTORIES = 96, (0, 64)
BF16 = torch.bfloat16


def graph_us(fn: Callable[[], object], *, launches: int, repeats: int) -> float:
    """Microseconds one call takes inside a graph of ``launches`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


class PagedStep:
    """One layer's tensors for ``entries`` entries of ``queries`` tokens at ``history`` (each a
    number, or one an entry), for ``dims`` (query heads, KV heads, head size)."""

    def __init__(self, dims: tuple[int, int, int], *, entries: int, queries: int | list[int],
                 history: int | list[int], device: str = "cuda") -> None:
        heads, kv_heads, dim = dims
        lens, hist = np.broadcast_to(queries, entries), np.broadcast_to(history, entries)
        gen = torch.Generator(device=device).manual_seed(0)
        per_row = -(-int((hist + lens).max()) // TPB)
        num_blocks = entries * per_row + 64
        table = torch.randperm(num_blocks, device=device, generator=gen)[:entries * per_row]
        table = table.view(entries, per_row).to(torch.int32)
        self.pool_k, self.pool_v = (torch.randn(num_blocks, TPB, kv_heads, dim, device=device,
                                                generator=gen, dtype=BF16) for _ in range(2))
        n = int(lens.sum())
        self.query = torch.randn(n, heads, dim, device=device, generator=gen, dtype=BF16)
        self.staged_k, self.staged_v = (torch.randn(n, kv_heads, dim, device=device,
                                                    generator=gen, dtype=BF16) for _ in range(2))
        self.layout = PagedLayout.build(
            table, TPB, rows=np.arange(entries), query_starts=np.cumsum(lens) - lens,
            query_lens=lens, starts=hist, group_width=min(int(lens.max()), MAX_DECODE_QUERY))
        self.out = torch.empty_like(self.query)
        kv_bytes = 2 * (int(hist.sum()) + n) * kv_heads * dim * 2
        self.bytes = kv_bytes + 2 * self.query.numel() * 2  # + queries read, output written
        self.args = (self.query, self.staged_k, self.staged_v, self.pool_k, self.pool_v,
                     self.layout)

    def kernel(self, launch: LaunchConfig | None = None,
               prefill: PrefillConfig | None = None) -> None:
        pool_attention_triton(*self.args, out=self.out, launch=launch, prefill=prefill)

    def reference(self) -> None:
        pool_attention(*self.args)


def copy_us(nbytes: int, launches: int, repeats: int) -> float:
    src = torch.empty(nbytes // 2, dtype=BF16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return graph_us(lambda: dst.copy_(src), launches=launches, repeats=repeats)


def sdpa_row(shape: str, launches: int, repeats: int) -> dict:
    heads, _, dim = SHAPES[shape]
    q = torch.randn(BATCH, heads, QUERIES, dim, device="cuda", dtype=BF16)
    k, v = (torch.randn(BATCH, heads, HISTORY + QUERIES, dim, device="cuda", dtype=BF16)
            for _ in range(2))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = "cudnn"
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            us = graph_us(lambda: F.scaled_dot_product_attention(q, k, v), launches=launches,
                          repeats=repeats)
    except RuntimeError:  # no cuDNN attention in this build: the flash kernel instead
        backend = "flash"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            us = graph_us(lambda: F.scaled_dot_product_attention(q, k, v), launches=launches,
                          repeats=repeats)
    nbytes = (k.numel() + v.numel() + 2 * q.numel()) * 2
    return {"backend": backend, "us": round(us, 2), "bytes": nbytes,
            "gbps": round(nbytes / us / 1e3, 1)}


def decode_row(shape: str, launches: int, repeats: int, sweep: bool) -> dict:
    step = PagedStep(SHAPES[shape], entries=BATCH, queries=QUERIES, history=HISTORY)
    heads, kv_heads, dim = SHAPES[shape]
    kernel_us = graph_us(step.kernel, launches=launches, repeats=repeats)
    copy = copy_us(step.bytes, launches, repeats)
    copy_gbps = 2 * step.bytes / copy / 1e3
    kernel_gbps = step.bytes / kernel_us / 1e3
    row = {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
           "batch": BATCH, "queries": QUERIES, "history": HISTORY, "bytes": step.bytes,
           "launch": vars(default_launch(dim)),
           "kernel_us": round(kernel_us, 2), "kernel_gbps": round(kernel_gbps, 1),
           "copy_us": round(copy, 2), "copy_gbps": round(copy_gbps, 1),
           "kernel_over_copy_bandwidth": round(kernel_gbps / copy_gbps, 3),
           "sdpa_ungrouped": sdpa_row(shape, launches, repeats)}
    if sweep:
        row["sweep"] = [{**vars(c), "us": round(graph_us(lambda c=c: step.kernel(c),
                                                         launches=launches, repeats=repeats), 2)}
                        for c in SWEEP]
    return row


def chunk_row(shape: str, launches: int, repeats: int) -> dict:
    step = PagedStep(SHAPES[shape], entries=8, queries=MAX_DECODE_QUERY, history=HISTORY)
    return {"shape": shape, "entries": 8, "queries": MAX_DECODE_QUERY, "history": HISTORY,
            "kernel_us": round(graph_us(step.kernel, launches=launches, repeats=repeats), 2),
            "reference_us": round(call_us(step.reference, lambda: None, repeats=repeats), 2)}


@dataclass(frozen=True)
class Timing:
    """How a prefill row times a call: in a graph (or eagerly, for the reference) on CUDA; on
    the host, as wall time, on a CPU (where the kernel runs in the interpreter)."""

    device: str
    launches: int
    repeats: int

    def graph(self, fn: Callable[[], object]) -> float:
        if self.device == "cuda":
            return graph_us(fn, launches=self.launches, repeats=self.repeats)
        return host_us(fn, self.repeats)

    def eager(self, fn: Callable[[], object]) -> float:
        if self.device == "cuda":
            return call_us(fn, lambda: None, repeats=self.repeats)
        return host_us(fn, self.repeats)


def host_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def causal_flops(dims: tuple[int, int, int], batch: int, chunk: int, history: int) -> int:
    """Each query head's query ``i`` of a chunk sees the history and the chunk's first ``i + 1``
    tokens: 2 x head size FLOPs for its score and 2 x head size for its value, per key."""
    heads, _, dim = dims
    return 4 * dim * heads * batch * (chunk * history + chunk * (chunk + 1) // 2)


def contiguous_sdpa(dims: tuple[int, int, int], batch: int, chunk: int, history: int,
                    device: str) -> tuple[str, Callable[[], object]]:
    """torch's SDPA over contiguous K/V with the kernel's grouping and causal alignment (the
    last query sees every key): flash on CUDA, whatever torch picks on a CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, dim = dims
    q = torch.randn(batch, heads, chunk, dim, device=device, dtype=BF16)
    k, v = (torch.randn(batch, kv_heads, history + chunk, dim, device=device, dtype=BF16)
            for _ in range(2))
    mask = causal_lower_right(chunk, history + chunk)
    if device != "cuda":
        return "default", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                 enable_gqa=True)

    def flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return "flash", flash


def prefill_row(shape: str, dims: tuple[int, int, int], batch: int, chunk: int, history: int,
                timing: Timing, sweep: bool) -> dict:
    step = PagedStep(dims, entries=batch, queries=chunk, history=history, device=timing.device)
    flops = causal_flops(dims, batch, chunk, history)
    step.kernel()
    error = (step.out.float() - pool_attention(*step.args).float()).abs().max().item()
    kernel_us, reference_us = timing.graph(step.kernel), timing.eager(step.reference)
    backend, sdpa = contiguous_sdpa(dims, batch, chunk, history, timing.device)
    sdpa_us = timing.graph(sdpa)
    row = {"shape": shape, "heads": dims[0], "kv_heads": dims[1], "head_dim": dims[2],
           "batch": batch, "chunk": chunk, "history": history, "flops": flops,
           "prefill_launch": vars(default_prefill(dims[2])),
           "max_abs_error_vs_reference": error, **_timed("kernel", kernel_us, flops),
           **_timed("reference", reference_us, flops),
           "sdpa_contiguous": {"backend": backend, **_timed("", sdpa_us, flops)}}
    if sweep:
        row["sweep"] = [{**vars(c), **_timed("", timing.graph(lambda c=c: step.kernel(prefill=c)),
                                             flops)} for c in PREFILL_SWEEP]
    return row


def _timed(name: str, us: float, flops: int) -> dict:
    prefix = f"{name}_" if name else ""
    return {f"{prefix}us": round(us, 2), f"{prefix}tflops": round(flops / us / 1e6, 2)}


def prefill_rows(args: argparse.Namespace, repeats: int) -> list[tuple[str, Callable[[], dict]]]:
    """Every prefill row, as (section, row) to measure; tiny ones on a CPU."""
    cuda = torch.cuda.is_available()
    shapes, chunk = (SHAPES, CHUNK) if cuda else (QUICK_SHAPES, QUICK_CHUNK)
    histories = PREFILL_HISTORIES if cuda else QUICK_HISTORIES
    timing = Timing("cuda" if cuda else "cpu", args.launches if cuda else 1, repeats if cuda else 2)
    rows = [("prefill", lambda s=s, b=b, h=h: prefill_row(
                s, shapes[s], b, chunk, h, timing, args.sweep and h == histories[-1] and b > 1))
            for s in shapes for h in histories for b in PREFILL_BATCHES]
    return rows + [("mixed", lambda s=s: mixed_row(s, timing)) for s in shapes]


def mixed_row(shape: str, timing: Timing) -> dict:
    """The step a serving engine meets: 63 decodes of 4 tokens at 1.5k history and one chunk of
    8192 tokens from history 0 (on a CPU: 7 decodes at 64 and a chunk of 96)."""
    cuda = timing.device == "cuda"
    decodes, chunk, history = (63, 8192, HISTORY) if cuda else (7, QUICK_CHUNK, 64)
    dims = SHAPES[shape] if cuda else QUICK_SHAPES[shape]
    step = PagedStep(dims, entries=decodes + 1, queries=[chunk, *[QUERIES] * decodes],
                     history=[0, *[history] * decodes], device=timing.device)
    flops = causal_flops(dims, 1, chunk, 0) + decodes * causal_flops(dims, 1, QUERIES, history)
    return {"shape": shape, "decodes": decodes, "chunk": chunk, "flops": flops,
            **_timed("kernel", timing.graph(step.kernel), flops),
            **_timed("reference", timing.eager(step.reference), flops)}


def decode_rows(args: argparse.Namespace, repeats: int) -> list[tuple[str, Callable[[], dict]]]:
    rows = [("decode", lambda s=s: decode_row(s, args.launches, repeats, args.sweep))
            for s in SHAPES]
    return rows + [("chunk", lambda s=s: chunk_row(s, args.launches, repeats)) for s in SHAPES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() and not (args.prefill and args.quick):
        sys.exit("bench_attention: needs CUDA (on a CPU, only --prefill --quick runs)")
    repeats = 5 if args.quick else 30
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = prefill_rows(args, repeats) if args.prefill else decode_rows(args, repeats)
    result: dict = {"device": device, **{section: [] for section, _ in rows}}
    for section, row in rows:
        result[section].append(row())
        if args.out:  # after every row: a run cut short still records what it measured
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))

if __name__ == "__main__":
    main()
