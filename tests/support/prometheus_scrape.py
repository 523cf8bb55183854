"""Reading a registry as Prometheus does: the text exposition, parsed back with
prometheus_client's parser, so names and suffixes are checked as served."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    """Every sample served, keyed by (sample name, labels)."""
    return samples_of(generate_latest(registry).decode())


def samples_of(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a text exposition (what /metrics answered), keyed as `scrape` keys it."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def assert_names_follow_prometheus_rules(registry: CollectorRegistry) -> None:
    """``kvalloc_`` prefix, no colons, ``_total`` exactly on counters."""
    text = generate_latest(registry).decode()
    for fam in text_string_to_metric_families(text):
        assert re.fullmatch(r"kvalloc_[a-z0-9_]+", fam.name), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        else:
            assert not fam.name.endswith("_total"), f"{fam.name}: _total is for counters"
