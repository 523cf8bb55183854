"""What one host call into torch and CUDA costs on this machine: the units a step's host path
is made of.

    python benchmarks/bench_host_calls.py [--calls N] [--out results.json]

A step's host path on CUDA is a few dozen calls like these (the worker's upload, replay and
events; the service's block-table replay); how much each costs depends on the host's speed far
more than on the GPU, and hosts differ by 2x and more. Each row is the median over ``--calls``
calls, in microseconds, timed on the host only (nothing here waits for the device, but where
the row says so). ``kernels_300_graph`` against ``kernel_graph`` gives what each captured kernel
adds to a replay; ``kernel_eager`` is one small launch, the unit a replay saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvalloc.allocator.capacity.table_graphs import TableUploadGraphs
from kvalloc.allocator.common.device_io import PinnedUploads, capture_graph, current_stream

UPLOAD_BYTES = 10_240  # about a decode step's columns at batch 64
OUTCOME_BYTES = 2_048


def median_us(call: Callable[[], object], calls: int, *, busy: bool = False) -> float:
    """The median host time of ``call``, in microseconds (a tenth of ``calls`` warm it up), each
    call made with the device idle: a full launch queue would block the host, and the row would
    time the device instead."""
    for _ in range(max(1, calls // 10)):
        call()
    taken = []
    for _ in range(calls):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(2_000_000)
        t0 = time.perf_counter_ns()
        call()
        taken.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(taken) / 1e3, 2)


def graph_of(kernels: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    def body() -> None:
        for _ in range(kernels):
            x.add_(1)
    return capture_graph(body)


def measure(calls: int) -> dict[str, float]:
    index = torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    pinned = torch.empty(UPLOAD_BYTES, dtype=torch.uint8, pin_memory=True)
    pinned_out = torch.empty(OUTCOME_BYTES // 8, dtype=torch.int64, pin_memory=True)
    device_in = torch.empty(UPLOAD_BYTES // 8, dtype=torch.int64, device="cuda")
    device_out = torch.zeros(OUTCOME_BYTES // 8, dtype=torch.int64, device="cuda")
    source = pinned.view(torch.int64)
    x = torch.zeros(1, device="cuda")
    one, many = graph_of(1, x), graph_of(300, x)

    def copy_then_kernel() -> None:
        device_in.copy_(source, non_blocking=True)
        x.add_(1)
    with_upload = capture_graph(copy_then_kernel)
    uploads = PinnedUploads(x.device)
    columns = np.arange(UPLOAD_BYTES // 8, dtype=np.int64)
    table = torch.zeros((64, 512), dtype=torch.int32, device="cuda")
    table_graphs = TableUploadGraphs(table)
    table_graphs.capture_all(np.zeros(table.numel(), dtype=np.int32))
    cells = np.arange(0, table.numel(), 512)  # a new block for each of 64 rows
    values = np.arange(table.numel(), dtype=np.int32)
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()
    recorded = torch.cuda.Event()
    return {
        "torch_current_stream": median_us(lambda: torch.cuda.current_stream(index), calls),
        "current_stream": median_us(lambda: current_stream(index), calls),
        "event_new": median_us(lambda: torch.cuda.Event(enable_timing=True), calls),
        "event_record": median_us(lambda: recorded.record(stream), calls),
        "event_synchronize_done": median_us(done.synchronize, calls),
        "pinned_slice_view": median_us(lambda: pinned[:UPLOAD_BYTES].view(torch.int64), calls),
        "upload_10kb": median_us(lambda: device_in.copy_(source, non_blocking=True), calls),
        "outcome_2kb": median_us(lambda: pinned_out.copy_(device_out, non_blocking=True), calls),
        "kernel_eager": median_us(lambda: x.add_(1), calls),
        "kernel_graph": median_us(one.replay, calls),
        "kernels_300_graph": median_us(many.replay, calls),
        "upload_and_kernel_graph": median_us(with_upload.replay, calls),
        "upload_10kb_busy": median_us(lambda: device_in.copy_(source, non_blocking=True),
                                      calls, busy=True),
        "kernel_graph_busy": median_us(one.replay, calls, busy=True),
        "pinned_uploads_into_10kb": median_us(lambda: uploads.into(device_in, columns), calls),
        "pinned_uploads_into_10kb_busy": median_us(lambda: uploads.into(device_in, columns),
                                                   calls, busy=True),
        "table_upload_64_cells": median_us(lambda: table_graphs.upload(cells, values), calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per row")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_calls: no CUDA device")
    out = {"benchmark": "bench_host_calls", "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "calls": args.calls, "median_us": measure(args.calls)}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
