"""The block table's sync on CUDA: a graph replay against the eager upload, side by side.

    python benchmarks/bench_table_upload.py [--batch 256] [--width 2049] [--steps 500]
                                            [--cells 16 64 256 1024 4096] [--json]
                                            [--out results.json]

Two tables of ``batch`` x ``width`` blocks take the same random cell changes, ``cells`` a sync,
one syncing through its CUDA graphs and one eagerly (``upload_graphs=False``). Each sync's host
time is what the step pays (the device work is a few microseconds either way), so the device is
synchronised between syncs, outside the timed call: the figures are the host's launch work alone.
Reports the median microseconds of each and their ratio, per size. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
from kvalloc.allocator import BlockTable


def median_sync_us(tables: dict[str, BlockTable], cells: int, steps: int,
                   rng: np.random.Generator) -> dict[str, float]:
    """Median host microseconds of each table's sync over ``steps`` syncs of ``cells`` random
    changes, after a tenth as many untimed (caches, allocator growth)."""
    size = next(iter(tables.values())).host.size
    taken: dict[str, list[float]] = {name: [] for name in tables}
    warmup = max(1, steps // 10)
    for step in range(warmup + steps):
        changed = rng.integers(0, size, cells)
        values = rng.integers(-1, 1 << 20, cells).astype(np.int32)
        for name, table in tables.items():
            table.host.reshape(-1)[changed] = values
            table.mark_cells(changed)
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            table.sync()
            if step >= warmup:
                taken[name].append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    first, second = tables.values()
    if not torch.equal(first.device_table, second.device_table):
        raise SystemExit(f"bench_table_upload: the two tables differ after {cells}-cell syncs")
    return {name: round(statistics.median(t), 1) for name, t in taken.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=bench_step.REPORTED_BATCH)
    p.add_argument("--width", type=int, default=2049, help="blocks per row (default 2049)")
    p.add_argument("--steps", type=int, default=500, help="timed syncs per size (default 500)")
    p.add_argument("--cells", type=int, nargs="+", default=[16, 64, 256, 1024, 4096],
                   help="changed cells per sync (default: 16 64 256 1024 4096)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON object here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_table_upload: needs CUDA")
    device = torch.device("cuda")
    tables = {"graph": BlockTable(args.batch, args.width, device),
              "eager": BlockTable(args.batch, args.width, device, upload_graphs=False)}
    rng = np.random.default_rng(0)
    sizes = {}
    for cells in args.cells:
        us = median_sync_us(tables, cells, args.steps, rng)
        sizes[str(cells)] = {**us, "eager_over_graph": round(us["eager"] / us["graph"], 2)}
    result = {"benchmark": "bench_table_upload", "date": date.today().isoformat(),
              "batch": args.batch, "width": args.width, "median_sync_us": sizes}
    rows = {f"{cells} cells": f"graph {s['graph']:7.1f} us  eager {s['eager']:7.1f} us  "
                              f"eager/graph {s['eager_over_graph']:5.2f}"
            for cells, s in sizes.items()}
    bench_step.emit(result, rows, out=args.out, as_json=args.json)


if __name__ == "__main__":
    main()
