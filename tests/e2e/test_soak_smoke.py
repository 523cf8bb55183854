"""benchmarks/soak.py runs (a few seconds here; ten minutes on demand) and judges a healthy run:
no errors, no request left and no block leaked, descriptors back where they started, with a
worker one step ahead (lag 2) beside the synchronous ones when asked; with
prefix caching and KV events (its default) the workers' prompts hit the cache, and the events'
subscriber ends with the service's count of cached blocks, having lost no batch, and computes
the hashes of blocks stored from a root as the workers' namespaces give them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def short_soak(*flags: str) -> dict:
    out = subprocess.run([sys.executable, str(SOAK), "--duration", "3", "--workers", "2",
                          "--warm-up", "0.5", "--json", *flags],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["steps"] > 0 and report["churn"]["cycles"] > 0
    assert report["errors"] == {} and report["churn"]["errors"] == []
    assert report["left_in_pool"]["requests"] == 0 and report["leaked_blocks"] == 0
    service = report["service"]
    assert service["end"]["open_fds"] == service["start"]["open_fds"]
    return report


def test_a_short_soak_ends_healthy_and_its_subscriber_sees_what_the_service_caches() -> None:
    report = short_soak("--overlap-workers", "1")
    assert report["workers"] == 3 and report["overlap_workers"] == 1
    assert 0 < report["overlap_steps"] < report["steps"]
    assert report["cached_tokens"] > 0
    events, pool = report["events"], report["left_in_pool"]
    assert events["batches"] > 0 and events["errors"] == []
    assert (events["lost"], events["anomalies"]) == (0, 0)
    # Each worker's first prompt is stored from its namespace's root, keyed with the token.
    assert events["roots_checked"] >= report["workers"]
    # Every block still off the free stack is a cached one no request holds.
    assert events["cached_blocks"] == pool["cached_blocks"] == pool["parked_blocks"] > 0
    assert pool["used_blocks"] == 0  # parked blocks are not used ones


def test_a_short_soak_of_the_plain_pool_leaves_it_empty() -> None:
    report = short_soak("--no-prefix-caching")
    assert report["events"] is None and report["prompt_tokens"] == 0
    assert report["left_in_pool"]["used_blocks"] == 0
