"""The service's own Prometheus metrics, beside the allocator's, in the registry it serves.

`allocator.metrics.AllocatorMetrics` reads the allocator's state (pool, requests, counters,
NWOR) and counts failed invariant checks; what only the service sees is counted here: each
per-step call's service time by transport, and worker leases that expired. `ServiceMetrics` is
the `ServiceObserver` the core reports both to. Names follow the same rules as the allocator's
(``kvalloc_`` prefix, base units, counters end in ``_total``), and the deploy rules and dashboard
read them by these names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from allocator.metrics import AllocatorMetrics

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

    def observe_step(self, transport: str, seconds: float) -> None:
        """Record one per-step call's service time (``transport``: e.g. "ipc", "rest")."""
        self.step_latency.labels(transport=transport).observe(seconds)

    def lease_expired(self, n: int = 1) -> None:
        """Count ``n`` expired worker leases."""
        self.leases_expired.inc(n)

    def invariant_violation(self, n: int = 1) -> None:
        self.allocator.invariant_violation(n)

    def state_changed(self) -> None:
        self.allocator.state_changed()
