"""benchmarks/bench_engine_host.py runs its loop (seconds with ``--quick``): a steady decode step
planned, checked and read synchronously and one step ahead, every request holding what the
simulated device emitted, each part timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine_host.py"


def test_the_quick_engine_host_bench_times_each_part_of_a_decode_step() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(out.stdout)
    assert [(r["batch"], r["mode"]) for r in rows] == [(64, "sync"), (64, "overlap")]
    for row in rows:
        assert all(row[f"{part}_us"] > 0 for part in ("plan", "launch_plan", "read", "total"))
        # 60 steps of 64 decodes, each emitting its pending token and up to 3 drafts.
        assert 60 * 64 <= row["generated_tokens"] <= 60 * 64 * 4
