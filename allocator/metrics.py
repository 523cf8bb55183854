"""Prometheus metrics for one `KVCacheManager`, collected into a registry the caller provides.

The library never touches prometheus_client's global registry: an engine embedding ``allocator``
and the ``kvalloc serve`` service both build ``AllocatorMetrics(registry, manager, ...)`` and
serve that registry however they like. What only the service sees (step latency by transport,
expired leases) is the service's own: `server.service.metrics`.

Invariants:
- Every state value (blocks, requests, token sums and maxima, counters) is read from the manager
  itself, never mirrored, so nothing can drift. Alone, a scrape reads it at that instant. When
  another thread mutates the manager, that writer calls ``state_changed()`` holding its own lock
  after each change: the state is then copied there (step-consistent, at most every
  ``min_interval_s``; a later call catches up), and scrapes serve the latest copy without ever
  taking the writer's lock, so any number of scrapers cannot delay a step.
- Names follow Prometheus rules: prefix ``kvalloc_``, base units (tokens, blocks, seconds,
  ratios), counters end in ``_total``, no colons (reserved for recording rules).
- Counters are monotonic: they are cumulative counts owned by the manager, the deferred-write
  manager, the SCV engine, or this object (invariant violations).

Deferred writes (NWOR) and SCV are read through documented, duck-typed interfaces, so this
module depends on neither implementation. ``deferred_writes`` is a `DeferredWriteManager` (its
``metrics()`` returns `NworMetrics`) or anything whose ``metrics`` is such an object, with
cumulative integer attributes ``windows``, ``staged_tokens``, ``committed_tokens``,
``rejected_tokens``, ``fallback_tokens``, a mapping ``fallbacks`` of reason -> count and a
sequence ``accepted_per_position`` (index i counts drafts accepted at draft position i). ``scv``
is an `ScvAcceptor`, read through its ``stats``: ``graph_replays``, ``captures``, ``evictions``,
``eager_calls`` and a mapping ``fallbacks`` of reason -> count. A missing attribute reads as 0
(or no samples), so a partial implementation still exports every family. Only the names of the
fallback reasons come from the implementations (their ``FALLBACK_REASONS``): each is served at 0
before its first fallback, since ``increase`` over a window needs a sample from before the rise.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvalloc.allocator.capacity.manager import KVCacheManager
from kvalloc.allocator.nwor import acceptance, window
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# ManagerCounters field -> help text. Every field is exported as kvalloc_<field>_total; a field
# added to ManagerCounters later is exported too, with a generic help text until listed here.
_COUNTER_HELP: dict[str, str] = {
    "grants": "Generation grants given (try_allocate_generation and prepare_draft_resources).",
    "draft_grants": "Grants given through the draft model's grant site.",
    "grants_refused": "Generation grants refused for lack of blocks (allocation failures).",
    "reverts": "Grants undone because the forward was skipped.",
    "updates": "Grants settled with the previous step's accepted count.",
    "rewound_tokens": "Rejected draft tokens rewound out of capacity.",
    "reclaimed_slack_tokens": "Overlap slack tokens reclaimed at settlement.",
    "padding_topups": "CUDA-graph padding top-ups of a pending grant.",
    "requests_added": "Requests admitted.",
    "requests_refused": "New requests refused for lack of blocks or rows (allocation failures).",
    "requests_freed": "Requests whose blocks went back to the pool.",
    "row_overflows": "Steps refused because a request would overflow its block-table row.",
    "evicted_blocks": "Unowned cached prefix blocks evicted to make room.",
    "prefix_queried_tokens": "Prompt tokens of admitted requests sent with token ids.",
    "prefix_hit_tokens": "Of those, prompt tokens found in cached prefix blocks.",
}

# Deferred-write attribute -> (metric name without _total, help).
_NWOR_COUNTERS: dict[str, tuple[str, str]] = {
    "windows": ("kvalloc_nwor_windows", "NWOR staging windows closed."),
    "staged_tokens": ("kvalloc_nwor_staged_tokens",
                      "Tokens staged: committed + rejected + fallback."),
    "committed_tokens": ("kvalloc_nwor_committed_tokens", "Staged tokens written to the pool."),
    "rejected_tokens": ("kvalloc_nwor_rejected_tokens", "Rejected draft tokens never written."),
    "fallback_tokens": ("kvalloc_nwor_fallback_tokens",
                        "Tokens written unconditionally because a window fell back."),
    "protected_refusals": ("kvalloc_nwor_protected_refusals",
                           "Staged tokens refused because their slot was in a cached block."),
}

_SCV_COUNTERS: dict[str, tuple[str, str]] = {
    "graph_replays": ("kvalloc_scv_graph_replays", "Acceptance-mask CUDA graph replays."),
    "captures": ("kvalloc_scv_graph_captures", "Acceptance-mask CUDA graphs captured."),
    "evictions": ("kvalloc_scv_graph_evictions",
                  "Captured graphs evicted from the bounded per-bucket cache."),
    "eager_calls": ("kvalloc_scv_eager_calls", "Acceptance masks computed eagerly."),
}


class AllocatorMetrics:
    """The allocator's metrics, registered into ``registry``.

    ``invariant_violation`` records an event the manager does not see (a failed
    ``check_invariants``); everything else is read from ``manager``, ``deferred_writes`` and
    ``scv`` when Prometheus scrapes.
    """

    def __init__(self, registry: CollectorRegistry, manager: KVCacheManager,
                 deferred_writes: object | None = None, *, scv: object | None = None,
                 tier_copies: object | None = None,
                 min_interval_s: float = 0.25) -> None:
        self.manager = manager
        self.deferred_writes = deferred_writes
        self.tier_copies = tier_copies
        self.scv = scv
        self.min_interval_s = min_interval_s
        self._published: list[Metric] | None = None  # replaced whole, never changed in place
        self._published_at = -float("inf")
        self.invariant_violations = Counter(
            "kvalloc_invariant_violations",
            "check_invariants() failures: states that must never exist. Expected zero.",
            registry=registry,
        )
        registry.register(_StateCollector(self))

    def invariant_violation(self, n: int = 1) -> None:
        """Count ``n`` invariant violations (call it where ``check_invariants`` raised)."""
        self.invariant_violations.inc(n)

    def state_changed(self) -> None:
        """The writer changed the manager: call it holding the writer's lock (after each change,
        and now and then while idle, so a change skipped by the interval is copied later).
        From the first call on, scrapes serve these copies instead of reading live state."""
        now = time.monotonic()
        if now - self._published_at >= self.min_interval_s:
            self._published, self._published_at = self.state_families(), now

    def state_families(self) -> list[Metric]:
        """The state families read from the live objects now."""
        families = [*_manager_families(self.manager)]
        if self.deferred_writes is not None:
            families += _nwor_families(self.deferred_writes)
        if self.scv is not None:
            families += _scv_families(self.scv)
        if self.manager.tier is not None:
            families += _tier_families(self.manager, self.tier_copies)
        return families


class _StateCollector(Collector):
    """Builds the state families from the live objects on every scrape."""

    def __init__(self, metrics: AllocatorMetrics) -> None:
        self._m = metrics

    def describe(self) -> list[Metric]:
        # Describing by collecting lets the registry detect name clashes at registration.
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        published = self._m._published  # one read: the writer may swap in a newer list meanwhile
        yield from published if published is not None else self._m.state_families()


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _manager_families(manager: KVCacheManager) -> list[Metric]:
    cfg = manager.config
    total = manager.pool.num_blocks
    free = manager.free_blocks
    # Parked blocks (cached, no request holds them) are room: the next allocation evicts them.
    # Counted as used, an idle service with a warm cache would read a nearly full pool.
    used = manager.held_blocks
    t = manager.totals()
    info = GaugeMetricFamily(
        "kvalloc_pool_info", "Static pool configuration (value is always 1).",
        labels=["device", "dtype", "slack_policy", "overlap_scheduler"],
    )
    info.add_metric([str(cfg.device), cfg.dtype, manager.policy.value,
                     str(cfg.overlap_scheduler).lower()], 1)
    families: list[Metric] = [
        info,
        _gauge("kvalloc_pool_blocks", "Blocks in the pool.", total),
        _gauge("kvalloc_pool_free_blocks", "Blocks on the free list.", free),
        _gauge("kvalloc_pool_used_blocks",
               "Blocks held by live requests (parked cached blocks are not: "
               "kvalloc_prefix_parked_blocks).", used),
        _gauge("kvalloc_pool_usage_ratio",
               "Used blocks / pool blocks; parked cached blocks count as room.", used / total),
        _gauge("kvalloc_tokens_per_block", "Token slots per block.", cfg.tokens_per_block),
        _gauge("kvalloc_max_blocks_per_seq", "Blocks in one block-table row.",
               manager.max_blocks_per_seq),
        _gauge("kvalloc_max_batch_size", "Block-table rows.", cfg.max_batch_size),
        _gauge("kvalloc_max_draft_len", "Largest draft length a grant may ask for.",
               cfg.max_draft_len),
        _gauge("kvalloc_live_requests", "Requests holding a block-table row.",
               manager.num_requests),
        _gauge("kvalloc_capacity_tokens", "Reserved tokens, summed over live requests.",
               t["capacity_tokens"]),
        _gauge("kvalloc_history_tokens", "Committed tokens, summed over live requests.",
               t["history_tokens"]),
        _gauge("kvalloc_pending_slack_tokens",
               "Pending overlap slack, summed over live requests.", t["pending_slack_tokens"]),
        _gauge("kvalloc_request_max_capacity_tokens", "Largest capacity of one live request.",
               t["max_capacity_tokens"]),
        _gauge("kvalloc_request_max_history_tokens", "Largest history of one live request.",
               t["max_history_tokens"]),
        _gauge("kvalloc_request_max_pending_slack_tokens",
               "Largest pending overlap slack of one live request.",
               t["max_pending_slack_tokens"]),
        _gauge("kvalloc_request_max_uncommitted_tokens",
               "Largest capacity - history of one live request.", t["max_uncommitted_tokens"]),
        _gauge("kvalloc_request_max_blocks",
               "Most blocks held by one live request (row overflow at kvalloc_max_blocks_per_seq).",
               t["max_blocks"]),
        _gauge("kvalloc_prefix_cached_blocks", "Blocks holding cached prefix content.",
               len(manager.cache.hash_of) if manager.cache is not None else 0),
        _gauge("kvalloc_prefix_parked_blocks",
               "Cached blocks no request holds: reusable until evicted.", manager.pool.num_parked),
    ]
    for f in dataclasses.fields(manager.counters):
        help_text = _COUNTER_HELP.get(f.name, f"ManagerCounters.{f.name}.")
        families.append(CounterMetricFamily(f"kvalloc_{f.name}", help_text,
                                            value=getattr(manager.counters, f.name)))
    return families


def _source(obj: object) -> object:
    """The object holding the counters: ``obj.metrics`` (called when it is a method, as on
    `DeferredWriteManager`), else ``obj.stats`` (`ScvAcceptor`), else ``obj`` itself."""
    src = getattr(obj, "metrics", None) or getattr(obj, "stats", None) or obj
    return src() if callable(src) else src


def _counter_families(obj: object, table: Mapping[str, tuple[str, str]]) -> list[Metric]:
    src = _source(obj)
    return [CounterMetricFamily(name, help_text, value=_int(getattr(src, attr, 0)))
            for attr, (name, help_text) in table.items()]


def _by_reason(name: str, help_text: str, reasons: Mapping[str, Any] | None,
               known: Sequence[str]) -> Metric:
    """Counts by reason: every ``known`` reason from the start (at 0 until it counts), any
    other from its first count."""
    counts = dict.fromkeys(known, 0) | {str(r): _int(n) for r, n in (reasons or {}).items()}
    family = CounterMetricFamily(name, help_text, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family


def _scv_families(scv: object) -> list[Metric]:
    src = _source(scv)
    return [*_counter_families(src, _SCV_COUNTERS),
            _by_reason("kvalloc_scv_graph_fallbacks",
                       "Shape buckets whose graph capture or replay failed and fell back to eager.",
                       getattr(src, "fallbacks", None), acceptance.FALLBACK_REASONS)]


def _tier_families(manager: KVCacheManager, copies: object | None) -> list[Metric]:
    """The host tier's: its size and content from the manager's index, what crossed the link
    (blocks are whole: bytes are blocks times the block's bytes), and the seconds the copies
    took, from whoever made them (``copies.copy_seconds``)."""
    tier = manager.tier
    assert tier is not None
    block_bytes = manager.config.bytes_per_block
    c = tier.counters
    return [
        _gauge("kvalloc_host_tier_blocks", "Blocks the host tier holds at most.", tier.num_slots),
        _gauge("kvalloc_host_tier_bytes", "Host memory of the host tier.",
               tier.num_slots * block_bytes),
        _gauge("kvalloc_host_tier_held_blocks", "Host tier slots holding a cached block.",
               tier.held),
        CounterMetricFamily("kvalloc_host_tier_offloaded_blocks",
                            "Registered pool blocks copied into the host tier.",
                            value=c.offloaded_blocks),
        CounterMetricFamily("kvalloc_host_tier_onboarded_blocks",
                            "Host tier hits: blocks copied back into fresh pool blocks.",
                            value=c.onboarded_blocks),
        CounterMetricFamily("kvalloc_host_tier_evicted_blocks",
                            "Host tier slots evicted (least recently used) for new content.",
                            value=c.evicted_blocks),
        CounterMetricFamily("kvalloc_host_tier_offloaded_bytes",
                            "Bytes copied from the pool into the host tier.",
                            value=c.offloaded_blocks * block_bytes),
        CounterMetricFamily("kvalloc_host_tier_onboarded_bytes",
                            "Bytes copied from the host tier into the pool.",
                            value=c.onboarded_blocks * block_bytes),
        CounterMetricFamily("kvalloc_host_tier_copy_seconds",
                            "Time the host tier's copies took (device time on a GPU): bytes over "
                            "it is the copies' throughput.",
                            value=float(getattr(copies, "copy_seconds", 0.0))),
    ]


def _nwor_families(deferred_writes: object) -> list[Metric]:
    src = _source(deferred_writes)
    families = _counter_families(src, _NWOR_COUNTERS)
    fallbacks = _by_reason("kvalloc_nwor_fallbacks",
                           "NWOR windows that fell back to writing every staged token.",
                           getattr(src, "fallbacks", None), window.FALLBACK_REASONS)
    accepted = CounterMetricFamily("kvalloc_nwor_accepted_tokens",
                                   "Draft tokens accepted, by draft position (0 = first draft).",
                                   labels=["position"])
    per_pos: Sequence[Any] = getattr(src, "accepted_per_position", None) or ()
    for pos, count in enumerate(per_pos):
        accepted.add_metric([str(pos)], _int(count))
    return [*families, fallbacks, accepted]


def _int(value: Any) -> int:
    """Counts may be Python ints, numpy scalars or 0-d tensors; expose a plain int."""
    return int(value.item() if hasattr(value, "item") else value)
