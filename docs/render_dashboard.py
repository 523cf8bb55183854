"""Render the Grafana dashboard's queries from a live Prometheus as one matplotlib figure.

Grafana is not available everywhere the project is built, so the README's dashboard picture is
drawn from the same PromQL that deploy/grafana/dashboards/kvalloc.json holds, panel by panel and
in its layout, against real data:

    python docs/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 5 \
        --out docs/dashboard.png

(docs/record_demo.sh starts a service, Prometheus and the load generator, then runs this.)
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after matplotlib.use: no display here

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvalloc.json"
GRID_COLUMNS = 24  # Grafana's grid width


def query_range(client: httpx.Client, expr: str, start: float, end: float,
                step: float) -> list[dict[str, Any]]:
    r = client.get("/api/v1/query_range",
                   params={"query": expr, "start": start, "end": end, "step": step})
    r.raise_for_status()
    return r.json()["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: ``{{label}}`` replaced by the series' label value. The picture
    shows one allocator, so its instance is left out."""
    labels = {k: v for k, v in labels.items() if k != "instance"}
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    return " ".join(text.split())


def render(prometheus: str, minutes: float, out: Path, rate_interval: str) -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    rows = sorted({p["gridPos"]["y"] for p in panels})
    end = time.time()
    start = end - minutes * 60
    step = max(1.0, minutes * 60 / 200)
    fig = plt.figure(figsize=(20, 3.1 * len(rows)), layout="constrained")
    grid = fig.add_gridspec(len(rows), GRID_COLUMNS)
    with httpx.Client(base_url=prometheus, timeout=30) as client:
        for p in panels:
            pos = p["gridPos"]
            row = rows.index(pos["y"])
            ax = fig.add_subplot(grid[row, pos["x"]: pos["x"] + pos["w"]])
            ax.set_title(p["title"], fontsize=10, loc="left")
            series = []
            for target in p["targets"]:
                expr = target["expr"].replace("$__rate_interval", rate_interval)
                expr = expr.replace("$instance", ".*")
                for s in query_range(client, expr, start, end, step):
                    t = [(float(ts) - end) / 60 for ts, _ in s["values"]]
                    v = [float(val) for _, val in s["values"]]
                    name = legend(target["legendFormat"], s["metric"]) or p["title"].lower()
                    series.append((name, t, v))
            if p["type"] == "stat":
                _stat(ax, series)
            else:
                _timeseries(ax, series, p["fieldConfig"]["defaults"].get("unit", "short"))
    fig.suptitle(f"{dash['title']}: {minutes:g} min of `kvalloc loadgen` against `kvalloc serve`"
                 " (CPU), real data from Prometheus",
                 fontsize=13, x=0.01, ha="left")
    fig.savefig(out, dpi=80)


def _stat(ax: Any, series: list[tuple[str, list[float], list[float]]]) -> None:
    ax.axis("off")
    lines = [f"{name}: {v[-1]:g}" if v[-1] != 1 or "=" not in name else name
             for name, _, v in series if v]
    ax.text(0.02, 0.95, "\n".join(lines), va="top", family="monospace", fontsize=9,
            transform=ax.transAxes)


def _timeseries(ax: Any, series: list[tuple[str, list[float], list[float]]], unit: str) -> None:
    # Grafana's units as the axis would show them; a custom "suffix: X" unit is X.
    suffix = unit.removeprefix("suffix:").strip() if unit.startswith("suffix:") else ""
    scale, label = {"s": (1e3, "ms"), "percentunit": (100.0, "%"),
                    "reqps": (1.0, "requests/s"), "ops": (1.0, "ops/s")}.get(unit, (1.0, suffix))
    for name, t, v in series:
        ax.plot(t, [x * scale for x in v], label=name, linewidth=1.4)
    ax.set_xlabel("minutes ago", fontsize=8)
    ax.set_ylabel(label, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7, loc="best", framealpha=0.6)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=5.0, help="time range to draw")
    parser.add_argument("--rate-interval", default="15s",
                        help="what Grafana's $__rate_interval becomes (4 scrape intervals)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    args = parser.parse_args()
    render(args.prometheus, args.minutes, args.out, args.rate_interval)


if __name__ == "__main__":
    main()
