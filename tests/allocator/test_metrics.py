"""`AllocatorMetrics`: what Prometheus scrapes equals the manager's own state, step by step.

Every check scrapes the registry through the text exposition format (what Prometheus reads) and
parses it back with prometheus_client's parser, so naming and suffixes are tested as served.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator import BlockTableOverflow, KVCacheManager, OutOfBlocks, PoolConfig, StepPlan
from kvalloc.allocator.metrics import AllocatorMetrics
from kvalloc.allocator.nwor import acceptance, window
from kvalloc.allocator.nwor.acceptance import ScvAcceptor
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager, WindowLayout
from kvalloc.allocator.nwor.storage import KVStorage
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_scrape import assert_names_follow_prometheus_rules, scrape, value

D = 3


def small_manager(**overrides: object) -> KVCacheManager:
    cfg = dict(num_blocks=16, tokens_per_block=4, max_seq_len=32, max_batch_size=4,
               max_draft_len=D, num_layers=1, num_kv_heads=1, head_dim=8, device="cpu")
    cfg.update(overrides)
    return KVCacheManager(PoolConfig(**cfg))


def assert_matches_manager(registry: CollectorRegistry, m: KVCacheManager) -> None:
    """The specification: every exported state value equals the manager's own."""
    s = scrape(registry)
    total, free, parked = m.pool.num_blocks, m.free_blocks, m.pool.num_parked
    assert value(s, "kvalloc_pool_blocks") == total
    assert value(s, "kvalloc_pool_free_blocks") == free
    assert value(s, "kvalloc_prefix_parked_blocks") == parked
    held = int((m.pool.refcounts > 0).sum())  # blocks some live request holds
    assert value(s, "kvalloc_pool_used_blocks") == held == total - free - parked
    assert value(s, "kvalloc_pool_usage_ratio") == pytest.approx(held / total)
    assert value(s, "kvalloc_live_requests") == m.num_requests
    t = m.totals()
    assert value(s, "kvalloc_capacity_tokens") == t["capacity_tokens"]
    assert value(s, "kvalloc_history_tokens") == t["history_tokens"]
    assert value(s, "kvalloc_pending_slack_tokens") == t["pending_slack_tokens"]
    assert value(s, "kvalloc_request_max_pending_slack_tokens") == t["max_pending_slack_tokens"]
    assert value(s, "kvalloc_request_max_uncommitted_tokens") == t["max_uncommitted_tokens"]
    views = [m.view(row) for row in m.live_rows.tolist()]  # with or without an id
    assert value(s, "kvalloc_request_max_capacity_tokens") == max(
        (v.capacity for v in views), default=0)
    assert value(s, "kvalloc_request_max_history_tokens") == max(
        (v.history for v in views), default=0)
    assert value(s, "kvalloc_request_max_blocks") == max((v.num_blocks for v in views), default=0)
    for f in dataclasses.fields(m.counters):
        assert value(s, f"kvalloc_{f.name}_total") == getattr(m.counters, f.name), f.name


@pytest.fixture
def manager() -> KVCacheManager:
    return small_manager()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_an_idle_pool_with_a_warm_cache_reads_empty_not_full(registry):
    """Parked blocks are reported apart: every block cached and none held is usage 0 (the
    pool-nearly-full alert reads this ratio), not the share of blocks off the free list."""
    m = KVCacheManager(small_manager().config, prefix_caching=True)
    AllocatorMetrics(registry, m)
    for i in range(3):
        row = m.add_request(f"r{i}", 16, prompt_tokens=[100 * i + t for t in range(16)])
        m.mark_written([row], [16])
        m.free(f"r{i}")
    assert m.pool.num_parked == 12 and m.free_blocks == 4
    s = scrape(registry)
    assert value(s, "kvalloc_pool_usage_ratio") == 0 == value(s, "kvalloc_pool_used_blocks")
    assert value(s, "kvalloc_prefix_parked_blocks") == 12
    assert_matches_manager(registry, m)


def test_scripted_steps_export_exactly_the_managers_state(manager, registry):
    m = manager
    AllocatorMetrics(registry, m)
    assert_matches_manager(registry, m)

    m.add_request("a", 20)
    m.add_request("b", 9)
    assert_matches_manager(registry, m)

    m.try_allocate_generation("a", D)
    m.try_allocate_generation("b", 1)
    m.extend_capacity_for_tokens("b", D)  # CUDA-graph padding top-up
    assert_matches_manager(registry, m)

    m.update_resources("a", 1)
    m.revert_allocate_generation("b")
    assert_matches_manager(registry, m)

    rows = m.rows_of(["a", "b"])
    out = m.step(StepPlan(grant_rows=rows, draft_lens=[D, D], prompt_lens=[12]))
    assert_matches_manager(registry, m)  # "c", admitted by row, counts as a live request
    m.step(StepPlan(result_rows=rows, num_accepted=[D, 0], finished_rows=out.admitted_rows))
    assert_matches_manager(registry, m)


def test_design_reference_values_are_what_prometheus_sees(manager, registry):
    """docs/design.md: D=3, cap 100: allocate -> 107, slack 3; update with 1 accepted -> 102,
    slack 0."""
    m = small_manager(num_blocks=64, max_seq_len=128)
    AllocatorMetrics(registry, m)
    m.add_request("r", 100)
    m.try_allocate_generation("r", D)
    s = scrape(registry)
    assert value(s, "kvalloc_capacity_tokens") == 107
    assert value(s, "kvalloc_pending_slack_tokens") == 3
    assert value(s, "kvalloc_request_max_uncommitted_tokens") == 7
    m.update_resources("r", 1)
    s = scrape(registry)
    assert value(s, "kvalloc_capacity_tokens") == 102
    assert value(s, "kvalloc_history_tokens") == 102
    assert value(s, "kvalloc_pending_slack_tokens") == 0
    assert value(s, "kvalloc_rewound_tokens_total") == 2
    assert value(s, "kvalloc_reclaimed_slack_tokens_total") == 3


def test_allocation_failures_and_row_overflows_are_counted(manager, registry):
    m = manager
    AllocatorMetrics(registry, m)
    m.add_request("long", 32)  # 8 of 16 blocks, row of max_blocks_per_seq = 10
    m.add_request("mid", 28)  # 7 more: one block left
    assert not m.try_allocate_generation("mid", D)  # needs 2 more blocks
    with pytest.raises(OutOfBlocks):
        m.add_request("late", 8)
    m.free("mid")
    assert m.try_allocate_generation("long", D)  # 32 + 7 tokens: all 10 blocks of the row
    m.update_resources("long", D)
    with pytest.raises(BlockTableOverflow):
        m.try_allocate_generation("long", D)
    s = scrape(registry)
    assert value(s, "kvalloc_grants_refused_total") == 1
    assert value(s, "kvalloc_requests_refused_total") == 1
    assert value(s, "kvalloc_row_overflows_total") == 1
    assert_matches_manager(registry, m)


def test_invariant_violations_are_counted(manager, registry):
    """Leases and step latency are the service's: tests/server/service/test_service_metrics.py."""
    metrics = AllocatorMetrics(registry, manager)
    metrics.invariant_violation()
    s = scrape(registry)
    assert value(s, "kvalloc_invariant_violations_total") == 1


def test_nwor_and_scv_counters_follow_the_documented_interface(manager, registry):
    """A deferred-writes object (or its ``metrics``) and the ScvAcceptor's ``stats`` are read by
    attribute at scrape time."""
    nwor = SimpleNamespace(metrics=SimpleNamespace(
        windows=5, committed_tokens=40, rejected_tokens=7, fallback_tokens=12,
        fallbacks={"stage_error": 1, "commit_error": 2}, accepted_per_position=[5, 3, 1]))
    scv = ScvAcceptor("off")
    scv.stats.graph_replays, scv.stats.captures, scv.stats.evictions = 9, 2, 1
    scv.stats.fallbacks["capture_failed"] = 1
    AllocatorMetrics(registry, manager, nwor, scv=scv)
    s = scrape(registry)
    assert value(s, "kvalloc_nwor_windows_total") == 5
    assert value(s, "kvalloc_nwor_committed_tokens_total") == 40
    assert value(s, "kvalloc_nwor_rejected_tokens_total") == 7
    assert value(s, "kvalloc_nwor_fallback_tokens_total") == 12
    assert value(s, "kvalloc_nwor_fallbacks_total", reason="commit_error") == 2
    assert value(s, "kvalloc_nwor_fallbacks_total", reason="stage_error") == 1
    assert [value(s, "kvalloc_nwor_accepted_tokens_total", position=str(i))
            for i in range(3)] == [5, 3, 1]
    assert value(s, "kvalloc_scv_graph_replays_total") == 9
    assert value(s, "kvalloc_scv_graph_captures_total") == 2
    assert value(s, "kvalloc_scv_graph_evictions_total") == 1
    assert value(s, "kvalloc_scv_graph_fallbacks_total", reason="capture_failed") == 1

    # Read at scrape time: a later change shows up in the next scrape, nothing is cached.
    nwor.metrics.windows = 6
    nwor.metrics.fallbacks["oom"] = 1
    s = scrape(registry)
    assert value(s, "kvalloc_nwor_windows_total") == 6
    assert value(s, "kvalloc_nwor_fallbacks_total", reason="oom") == 1


def fallbacks_served(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """(family, reason) -> count, for both fallback families."""
    return {(name, dict(labels)["reason"]): count
            for (name, labels), count in scrape(registry).items()
            if name in ("kvalloc_nwor_fallbacks_total", "kvalloc_scv_graph_fallbacks_total")}


def test_every_fallback_reason_is_served_at_0_before_any_fallback(manager, registry):
    """``increase(...) > 0`` (the SCV fallback alert) sees a reason's first fallback only if the
    series was scraped before it: one that first appears at 1 shows no increase. So every reason
    NWOR and SCV name ahead of time is there at 0 from the first scrape, and counts from there."""
    writes = DeferredWriteManager(KVStorage(manager.config), max_tokens=16)
    scv = ScvAcceptor("off")
    AllocatorMetrics(registry, manager, writes, scv=scv)
    zero = {("kvalloc_nwor_fallbacks_total", reason): 0 for reason in window.FALLBACK_REASONS}
    zero |= {("kvalloc_scv_graph_fallbacks_total", reason): 0
             for reason in acceptance.FALLBACK_REASONS}
    assert {"incomplete_staging", "accepted_out_of_range"} == set(window.FALLBACK_REASONS)
    assert {"capture_failed", "replay_failed"} == set(acceptance.FALLBACK_REASONS)
    assert fallbacks_served(registry) == zero

    scv.stats.fallbacks["capture_failed"] = 1
    assert fallbacks_served(registry) == zero | {
        ("kvalloc_scv_graph_fallbacks_total", "capture_failed"): 1}


def test_a_real_deferred_write_manager_is_read_through_its_metrics_method(registry):
    """Two requests, MTP3: 1 of 3 drafts accepted, then all 3: committed 2 + 4, rejected 2."""
    m = small_manager()
    storage = KVStorage(m.config)
    writes = DeferredWriteManager(storage, max_tokens=16)
    AllocatorMetrics(registry, m, writes)
    writes.begin_window(WindowLayout((4, 4), (3, 3)))
    kv = torch.zeros(8, m.config.num_kv_heads, m.config.head_dim, dtype=m.config.torch_dtype)
    for layer in range(m.config.num_layers):
        writes.stage_layer(layer, kv, kv, torch.arange(8, dtype=torch.int64))
    writes.commit([1, 3])
    s = scrape(registry)
    nwor = writes.metrics()
    assert (nwor.windows, nwor.committed_tokens, nwor.rejected_tokens) == (1, 6, 2)
    assert value(s, "kvalloc_nwor_windows_total") == nwor.windows
    assert value(s, "kvalloc_nwor_staged_tokens_total") == nwor.staged_tokens == 8
    assert value(s, "kvalloc_nwor_committed_tokens_total") == nwor.committed_tokens
    assert value(s, "kvalloc_nwor_rejected_tokens_total") == nwor.rejected_tokens
    assert value(s, "kvalloc_nwor_fallback_tokens_total") == nwor.fallback_tokens == 0
    # drafts accepted at positions 0, 1, 2: both requests, then only the second
    assert [value(s, "kvalloc_nwor_accepted_tokens_total", position=str(i))
            for i in range(3)] == list(nwor.accepted_per_position) == [2, 1, 1]


def test_nwor_families_are_absent_without_a_deferred_writes_object(manager, registry):
    AllocatorMetrics(registry, manager)
    names = {name for name, _ in scrape(registry)}
    assert not any(n.startswith(("kvalloc_nwor_", "kvalloc_scv_")) for n in names)


def test_names_follow_prometheus_rules_and_the_global_registry_is_untouched(manager, registry):
    before = set(REGISTRY._names_to_collectors)
    AllocatorMetrics(registry, manager, SimpleNamespace(), scv=SimpleNamespace())
    assert set(REGISTRY._names_to_collectors) == before
    assert_names_follow_prometheus_rules(registry)


def test_once_published_a_scrape_serves_the_writers_copy(manager, registry):
    """A writer that calls state_changed() under its lock is the only reader of live state: a
    scrape sees its last copy, and a copy within min_interval_s of the last is deferred."""
    metrics = AllocatorMetrics(registry, manager, min_interval_s=3600)
    metrics.state_changed()
    manager.add_request("unseen", 4)
    assert value(scrape(registry), "kvalloc_live_requests") == 0
    metrics.state_changed()  # within the interval: deferred
    assert value(scrape(registry), "kvalloc_live_requests") == 0
    metrics.min_interval_s = 0
    metrics.state_changed()
    assert value(scrape(registry), "kvalloc_live_requests") == 1


OPS = st.lists(st.tuples(st.sampled_from(["add", "grant", "pad", "update", "revert", "free"]),
                         st.integers(0, 3), st.integers(0, D)), max_size=40)


@settings(max_examples=40, deadline=None)
@given(OPS)
def test_any_sequence_of_calls_exports_the_managers_state(ops):
    m = small_manager()
    registry = CollectorRegistry()
    AllocatorMetrics(registry, m)
    for op, who, n in ops:
        req = f"r{who}"
        pending = req in m and m.pending_draft_len(req) is not None
        try:
            if op == "add" and req not in m:
                m.add_request(req, 1 + 7 * n)
            elif op == "grant" and req in m and not pending:
                m.try_allocate_generation(req, n)
            elif op == "pad" and pending and n >= m.pending_draft_len(req):
                m.extend_capacity_for_tokens(req, n)
            elif op == "update" and pending:
                m.update_resources(req, min(n, m.pending_draft_len(req)))
            elif op == "revert" and pending:
                m.revert_allocate_generation(req)
            elif op == "free" and req in m:
                m.free(req)
        except (OutOfBlocks, BlockTableOverflow):
            pass  # refusals are counted; the state must still match
        assert_matches_manager(registry, m)
