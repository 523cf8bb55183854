"""The Grafana dashboard reads at a glance: every panel of rates says per second in its unit, and
a panel broken down by a label draws one series per value of that label, legended by it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/kvalloc.json"
PANELS = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p.get("targets")]
# Grafana's built-in rate units, and custom "suffix:" units that end in /s.
RATE_UNITS = {"ops", "reqps", "rps", "wps", "iops", "Bps", "binBps"}


def is_rate_unit(unit: str) -> bool:
    return unit in RATE_UNITS or (unit.startswith("suffix:") and unit.endswith("/s"))


def uses_rate(panel: dict) -> bool:
    """Every query is a per-second rate (not a quantile, nor a ratio of two rates)."""
    return all(re.search(r"\brate\(", t["expr"]) and "histogram_quantile" not in t["expr"]
               and " / " not in t["expr"] for t in panel["targets"])


@pytest.mark.parametrize("panel", [p for p in PANELS if uses_rate(p)], ids=lambda p: p["title"])
def test_a_panel_of_rates_has_a_per_second_unit(panel):
    unit = panel["fieldConfig"]["defaults"].get("unit", "")
    assert is_rate_unit(unit), f"{panel['title']!r}: unit {unit!r} is not per second"


def test_the_rate_check_tells_rates_from_counts():
    assert is_rate_unit("suffix: tokens/s") and is_rate_unit("ops")
    assert not is_rate_unit("short") and not is_rate_unit("suffix: tokens")


@pytest.mark.parametrize("panel", [p for p in PANELS if "by reason" in p["title"]],
                         ids=lambda p: p["title"])
def test_a_by_reason_panel_draws_one_series_per_reason(panel):
    for target in panel["targets"]:
        assert re.search(r"by \([^)]*\breason\b", target["expr"]), target["expr"]
        assert "{{reason}}" in target["legendFormat"], target["legendFormat"]


def test_the_blocks_panel_parts_the_pool_into_used_parked_and_free():
    """Parked cached blocks are neither used nor free (AllocatorMetrics counts used as what live
    requests hold): the panel draws all three, so they add up to the pool on the screen."""
    (panel,) = [p for p in PANELS if p["title"] == "Blocks"]
    drawn = {re.sub(r"\{.*", "", t["expr"]) for t in panel["targets"]}
    assert drawn == {"kvalloc_pool_used_blocks", "kvalloc_prefix_parked_blocks",
                     "kvalloc_pool_free_blocks"}
