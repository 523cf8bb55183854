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

``chunk``: 8 entries of 64 tokens (the longest the kernel takes) at the same history, the kernel
against the torch reference (eager: it synchronises, so no graph holds it): the dispatch rule's
bound.

``--sweep`` also times every `LaunchConfig` in ``SWEEP`` on both shapes (how the defaults were
picked). ``--quick``: fewer repeats, for a smoke run. Prints JSON; ``--out`` writes it too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_commit import call_us  # one eager call from an idle device (the reference syncs)

from worker.attention.pool_attention import PagedLayout, pool_attention
from worker.attention.pool_attention_triton import (
    LaunchConfig,
    default_launch,
    pool_attention_triton,
)

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128)}  # query heads, KV heads, head size
BATCH, QUERIES, HISTORY, TPB = 64, 4, 1536, 16
SWEEP = [*(LaunchConfig(*c, splits=1) for c in itertools.product((32, 64), (4, 8), (2, 3))),
         *(LaunchConfig(n, w, 2, splits=2) for n, w in ((32, 4), (64, 4), (64, 8)))]
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


class DecodeStep:
    """One layer's tensors for ``entries`` entries of ``queries`` tokens at ``history``."""

    def __init__(self, shape: str, *, entries: int, queries: int, history: int) -> None:
        heads, kv_heads, dim = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        per_row = -(-(history + queries) // TPB)
        num_blocks = entries * per_row + 64
        table = torch.randperm(num_blocks, device="cuda", generator=gen)[:entries * per_row]
        table = table.view(entries, per_row).to(torch.int32)
        self.pool_k, self.pool_v = (torch.randn(num_blocks, TPB, kv_heads, dim, device="cuda",
                                                generator=gen, dtype=BF16) for _ in range(2))
        n = entries * queries
        self.query = torch.randn(n, heads, dim, device="cuda", generator=gen, dtype=BF16)
        self.staged_k, self.staged_v = (torch.randn(n, kv_heads, dim, device="cuda",
                                                    generator=gen, dtype=BF16) for _ in range(2))
        lens = np.full(entries, queries)
        self.layout = PagedLayout.build(
            table, TPB, rows=np.arange(entries), query_starts=np.arange(entries) * queries,
            query_lens=lens, starts=np.full(entries, history), group_width=queries)
        self.out = torch.empty_like(self.query)
        kv_bytes = 2 * (entries * history + n) * kv_heads * dim * 2
        self.bytes = kv_bytes + 2 * self.query.numel() * 2  # + queries read, output written
        self.args = (self.query, self.staged_k, self.staged_v, self.pool_k, self.pool_v,
                     self.layout)

    def kernel(self, launch: LaunchConfig | None = None) -> None:
        pool_attention_triton(*self.args, out=self.out, launch=launch)

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
    step = DecodeStep(shape, entries=BATCH, queries=QUERIES, history=HISTORY)
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
    from worker.attention.pool_attention_triton import MAX_KERNEL_QUERY

    step = DecodeStep(shape, entries=8, queries=MAX_KERNEL_QUERY, history=HISTORY)
    return {"shape": shape, "entries": 8, "queries": MAX_KERNEL_QUERY, "history": HISTORY,
            "kernel_us": round(graph_us(step.kernel, launches=launches, repeats=repeats), 2),
            "reference_us": round(call_us(step.reference, lambda: None, repeats=repeats), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention: needs CUDA")
    repeats = 5 if args.quick else 30
    result: dict = {"device": torch.cuda.get_device_name(), "decode": [], "chunk": []}
    rows = [("decode", lambda s: decode_row(s, args.launches, repeats, args.sweep)),
            ("chunk", lambda s: chunk_row(s, args.launches, repeats))]
    for section, row in rows:
        for shape in SHAPES:
            result[section].append(row(shape))
            if args.out:  # after every row: a run cut short still records what it measured
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))

if __name__ == "__main__":
    main()
