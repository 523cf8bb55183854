"""The service's own Prometheus metrics, beside the allocator's, in the registry it serves.

`allocator.metrics.AllocatorMetrics` reads the allocator's state (pool, requests, counters,
NWOR) and counts failed invariant checks; what only the service sees is counted here: each
per-step call's service time by transport, and worker leases that expired. `ServiceMetrics` is
the `ServiceObserver` the core reports both to. A service of several data-parallel ranks
(`server.service.ranks`) serves each rank's allocator metrics with a ``data_parallel_rank``
label (`rank_metrics`). Names follow the same rules as the allocator's
(``kvalloc_`` prefix, base units, counters end in ``_total``), and the deploy rules and dashboard
read them by these names.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvalloc.allocator import AllocatorMetrics
from kvalloc.server.service.shared_pool import SHARED_STATE
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the service imports this module only where prometheus_client exists
    from kvalloc.server.service.ranks import RankedService

RANK_LABEL = "data_parallel_rank"

# Step latency spans an in-process call (~10 us) to REST under load (~100 ms); the decode step
# this sits beside is 10-30 ms, so resolution is finest below a millisecond.
STEP_LATENCY_BUCKETS: tuple[float, ...] = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    1.0,
)


class ServiceMetrics:
    """The service's metrics, registered into ``registry``; ``allocator`` holds the allocator's
    (registered into the same registry), which the state and invariant reports go to."""

    def __init__(self, registry: CollectorRegistry, allocator: AllocatorMetrics) -> None:
        self.allocator = allocator
        self.step_latency = Histogram(
            "kvalloc_step_latency_seconds",
            "Service time of one per-step call, by transport.",
            ["transport"], buckets=STEP_LATENCY_BUCKETS, registry=registry,
        )
        self.leases_expired = Counter(
            "kvalloc_leases_expired", "Worker leases that expired; their requests were freed.",
            registry=registry,
        )
        self.shared_state_repairs = Counter(
            "kvalloc_shared_state_repairs",
            "Entries of the state workers map read-only (block table cells, protection flags of "
            "cached blocks, fence words) that another process changed; each was put back from "
            "the service's own state.", ["what"], registry=registry,
        )
        for what in SHARED_STATE:  # at 0 from the start: an increase over a window needs it
            self.shared_state_repairs.labels(what=what)
        # The step latency's series by transport, looked up once: `labels` costs several
        # observations, and every step call pays it.
        self._step_latency_of: dict[str, Any] = {}

    def observe_step(self, transport: str, seconds: float) -> None:
        """Record one per-step call's service time (``transport``: e.g. "ipc", "rest")."""
        series = self._step_latency_of.get(transport)
        if series is None:
            series = self._step_latency_of[transport] = self.step_latency.labels(
                transport=transport)
        series.observe(seconds)

    def lease_expired(self, n: int = 1) -> None:
        """Count ``n`` expired worker leases."""
        self.leases_expired.inc(n)

    def invariant_violation(self, n: int = 1) -> None:
        self.allocator.invariant_violation(n)

    def shared_state_repaired(self, repaired: dict[str, int]) -> None:
        """Count the entries ``repaired`` put back, by what they were."""
        for what, n in repaired.items():
            self.shared_state_repairs.labels(what=what).inc(n)

    def state_changed(self) -> None:
        self.allocator.state_changed()

    def with_allocator(self, allocator: Any) -> ServiceMetrics:
        """The same service metrics (step latency, leases: one series for every rank), with
        state and invariant reports going to ``allocator`` instead (a data-parallel rank's)."""
        view = copy.copy(self)
        view.allocator = allocator
        return view


class RankLabelled(Collector):
    """The families of each rank's registry as one set, every sample labelled with its rank:
    the ranks export the same names, which one registry cannot hold twice."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for rank, registry in enumerate(self.registries):
            for family in registry.collect():
                out = merged.setdefault(family.name, Metric(
                    family.name, family.documentation, family.type, family.unit))
                out.samples += [sample._replace(labels={**sample.labels, RANK_LABEL: str(rank)})
                                for sample in family.samples]
        yield from merged.values()


def rank_metrics(service: RankedService, registry: CollectorRegistry) -> None:
    """Serve ``service``'s metrics in ``registry``: the service's own once (step latency, leases),
    each rank's allocator families labelled with its rank (`RankLabelled`)."""
    own = [CollectorRegistry() for _ in service.ranks]
    allocators = [AllocatorMetrics(reg, rank.manager, rank.pool.committer.writes,
                                   tier_copies=(rank.pool.tier_stores or [None])[0])
                  for reg, rank in zip(own, service.ranks, strict=True)]
    shared = ServiceMetrics(registry, allocators[0])
    registry.register(RankLabelled(own))
    for rank, allocator in zip(service.ranks, allocators, strict=True):
        with rank.lock:  # scrapes read what each rank publishes under its lock
            rank.add_observer(shared.with_allocator(allocator))
            allocator.state_changed()
