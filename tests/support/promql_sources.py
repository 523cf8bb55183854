"""What the deploy folder asks Prometheus: the alert rules and the Grafana dashboard's queries,
and the metric names a PromQL expression reads. The deploy tests check them against what the
allocator exports; the Prometheus end-to-end test checks them against a real scrape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvalloc.json"

# Grafana's variables, replaced by values Prometheus accepts before parsing.
GRAFANA_VARS = {"$__rate_interval": "1m", "$instance": ".*"}

# Each rules file and its promtool unit tests. KvallocStepLatencyHigh's threshold depends on the
# deployment: step-latency.yml for GPU hosts, step-latency-cpu.yml for the CPU compose stack.
RULE_FILES = {"alerts.yml": "tests/alerts_test.yml",
              "step-latency.yml": "tests/step_latency_test.yml",
              "step-latency-cpu.yml": "tests/step_latency_cpu_test.yml"}

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan", "atan2",
}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, aggregations,
    keywords, label names (in {} or grouping clauses), strings, durations or numbers."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range and subquery durations
    e = _GROUPING.sub("", e)
    names = set()
    for m in _IDENT.finditer(e):
        before, after = e[: m.start()], e[m.end():]
        if re.match(r"\s*\(", after) or m.group().lower() in _KEYWORDS:
            continue  # a function or aggregation call, or a keyword
        if re.search(r"[0-9.]$", before):
            continue  # the exponent or unit of a number (1e-3, 5m)
        names.add(m.group())
    return names


def alert_rules(*files: str) -> list[dict]:
    """The rules of ``files`` (default: every rules file)."""
    docs = [yaml.safe_load((PROM / name).read_text()) for name in files or RULE_FILES]
    return [r for doc in docs for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs() -> dict[str, str]:
    """title/refId -> expression, Grafana variables substituted."""
    dash = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, val in GRAFANA_VARS.items():
                expr = expr.replace(var, val)
            assert "$" not in expr, f"{panel['title']}: unknown Grafana variable in {expr}"
            out[f"{panel['title']}/{target['refId']}"] = expr
    return out
