"""Prometheus config, alert rules and the Grafana dashboard: promtool accepts them, every alert
has a unit test that promtool runs, and every PromQL expression names only metrics that
`AllocatorMetrics` and the service's own `ServiceMetrics` export.

promtool comes from Debian's `prometheus` package (`apt-get install -y prometheus`); these tests
skip only where that binary is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kvalloc.allocator import KVCacheManager, KVStorage, PoolConfig
from kvalloc.allocator.metrics import AllocatorMetrics
from kvalloc.allocator.nwor.acceptance import ScvAcceptor
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.server.service.metrics import ServiceMetrics
from prometheus_client import CollectorRegistry
from promql_sources import (
    DASHBOARD,
    PROM,
    ROOT,
    RULE_FILES,
    alert_rules,
    dashboard_exprs,
    metric_names,
)
from test_deploy_schemas import load_compose

PROMTOOL = shutil.which("promtool")
# .ci/run installs it, so in CI a missing binary fails instead of skipping.
needs_promtool = pytest.mark.skipif(PROMTOOL is None and not os.environ.get("CI"),
                                    reason="promtool absent: apt-get install -y prometheus")

# Series Prometheus makes itself, not the allocator.
SYNTHETIC = {"up"}


def test_metric_name_extraction_reads_promql_like_prometheus_does():
    expr = ('histogram_quantile(0.99, sum by (le, transport) (rate(kvalloc_a_bucket'
            '{instance=~"$x", job="j"}[5m]))) / on (instance) group_left sum(kvalloc_b) > 1e-3')
    assert metric_names(expr) == {"kvalloc_a_bucket", "kvalloc_b"}
    assert metric_names("1 + 2 * kvalloc_c offset 5m") == {"kvalloc_c"}


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",)}


def exported_families() -> dict[str, str]:
    """Family name -> type, from a live `AllocatorMetrics` with the real NWOR and SCV objects
    attached (the library's whole surface: the service attaches NWOR; SCV runs in workers) and
    the service's `ServiceMetrics` beside it, in one registry as ``kvalloc serve`` builds them;
    the manager has a host tier, whose families exist only then."""
    config = PoolConfig(num_blocks=8, tokens_per_block=4, max_seq_len=16, device="cpu")
    manager = KVCacheManager(config, prefix_caching=True, register_when_written=True,
                             host_tier_blocks=4)
    registry = CollectorRegistry()
    ServiceMetrics(registry, AllocatorMetrics(
        registry, manager, DeferredWriteManager(KVStorage(config), max_tokens=8),
        scv=ScvAcceptor("off")))
    return {fam.name: fam.type for fam in registry.collect()}


def exported_names() -> set[str]:
    """Every series name those families serve, with their type's suffixes (a labelled family
    with no samples yet, e.g. step latency by transport, counts by the names it will have)."""
    return {name + suffix for name, kind in exported_families().items()
            for suffix in SUFFIXES[kind]}


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)


# ---------------------------------------------------------------- promtool


@needs_promtool
def test_promtool_accepts_the_prometheus_config():
    r = promtool("check", "config", "deploy/prometheus/prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
@pytest.mark.parametrize("rules", RULE_FILES)
def test_promtool_accepts_the_alert_rules(rules):
    r = promtool("check", "rules", f"deploy/prometheus/{rules}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules(rules))} rules found" in r.stdout


@needs_promtool
def test_every_alert_passes_its_promtool_unit_tests():
    r = promtool("test", "rules", *RULE_FILES.values(), cwd=PROM)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("rules, unit_tests", RULE_FILES.items())
def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_stays_silent(rules,
                                                                                  unit_tests):
    doc = yaml.safe_load((PROM / unit_tests).read_text())
    assert doc["rule_files"] == [f"../{rules}"]
    cases = [c for t in doc["tests"] for c in t["alert_rule_test"]]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    names = {r["alert"] for r in alert_rules(rules)}
    assert fires == names, f"alerts without a firing test: {names - fires}"
    assert silent == names, f"alerts without a silent case: {names - silent}"


def test_the_observability_docs_list_every_alert_in_their_alerts_table():
    """An operator reads what an alert means there: one row per alert, none for an alert gone."""
    section = (ROOT / "docs" / "observability.md").read_text().split("## Alerts", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(Kvalloc\w+)` \|", section, flags=re.MULTILINE)
    assert sorted(rows) == sorted({r["alert"] for r in alert_rules()})


def threshold(rule: dict) -> float:
    """The number an alert's expression compares with (``... > 0.005``)."""
    return float(rule["expr"].rsplit(">", 1)[1])


def test_each_compose_stack_alerts_on_step_latency_with_its_own_threshold():
    """The GPU stack's Prometheus evaluates step-latency.yml (prometheus.yml names it, and the
    base compose file mounts the folder); the CPU override mounts step-latency-cpu.yml in its
    place, whose threshold is the higher, and which alerts under the same name."""
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml", "step-latency.yml"]
    base, cpu = load_compose("docker-compose.yml"), load_compose("docker-compose.cpu.yml")
    assert "./prometheus:/etc/prometheus:ro" in base["services"]["prometheus"]["volumes"]
    assert cpu["services"]["prometheus"]["volumes"] == [
        "./prometheus/step-latency-cpu.yml:/etc/prometheus/step-latency.yml:ro"]
    (gpu_rule,), (cpu_rule,) = alert_rules("step-latency.yml"), alert_rules("step-latency-cpu.yml")
    assert gpu_rule["alert"] == cpu_rule["alert"] == "KvallocStepLatencyHigh"
    assert threshold(gpu_rule) == 0.005 and threshold(cpu_rule) == 0.05
    assert {k: v for k, v in gpu_rule.items() if k != "expr"} == \
           {k: v for k, v in cpu_rule.items() if k != "expr"}


@needs_promtool
def test_every_dashboard_expression_parses(tmp_path):
    """promtool parses each query as a recording rule with Prometheus's own PromQL parser."""
    exprs = dashboard_exprs()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard_query_{i}", "expr": e} for i, e in enumerate(exprs.values())]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_promql_expression_names_only_exported_metrics(source):
    exprs = ({r["alert"]: r["expr"] for r in alert_rules()} if source == "alerts"
             else dashboard_exprs())
    known = exported_names() | SYNTHETIC
    unknown = {where: sorted(metric_names(e) - known) for where, e in exprs.items()
               if metric_names(e) - known}
    assert unknown == {}
    assert all(metric_names(e) for e in exprs.values()), "every expression reads a metric"


def test_the_dashboard_shows_every_metric_family_the_allocator_exports():
    used = set().union(*map(metric_names, dashboard_exprs().values()))
    dash = json.loads(DASHBOARD.read_text())
    used |= {metric_names(v["definition"].split("(")[1].split(",")[0]).pop()
             for v in dash["templating"]["list"] if v["type"] == "query"}
    shown = {name for name, kind in exported_families().items()
             if any(name + suffix in used for suffix in SUFFIXES[kind])}
    assert set(exported_families()) - shown == set()
