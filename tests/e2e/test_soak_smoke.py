"""benchmarks/soak.py runs (a few seconds here; ten minutes on demand) and judges a healthy run:
no errors, nothing left in the pool, descriptors back where they started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_a_short_soak_ends_healthy() -> None:
    out = subprocess.run([sys.executable, str(SOAK), "--duration", "3", "--workers", "2",
                          "--warm-up", "0.5", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["steps"] > 0 and report["churn"]["cycles"] > 0
    assert report["errors"] == {} and report["churn"]["errors"] == []
    assert report["left_in_pool"] == {"used_blocks": 0, "requests": 0}
    service = report["service"]
    assert service["end"]["open_fds"] == service["start"]["open_fds"]
