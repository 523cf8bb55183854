"""`ServiceMetrics`: step latency by transport and expired leases, served beside the allocator's
metrics; and ``/metrics`` never waits for the step lock: the core publishes what scrapes read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from kvalloc.allocator import KVCacheManager, PoolConfig
from kvalloc.allocator.metrics import AllocatorMetrics
from kvalloc.server import serve
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.metrics import ServiceMetrics
from kvalloc.server.service.settings import ServiceConfig
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_scrape import assert_names_follow_prometheus_rules, scrape, value


def live_requests(body: bytes) -> float:
    return next(s.value for f in text_string_to_metric_families(body.decode())
                for s in f.samples if s.name == "kvalloc_live_requests")


def test_a_scrape_answers_while_a_step_holds_the_lock(make_config: Callable[..., object]) -> None:
    core = ServiceCore(ServiceConfig(pool=make_config(), max_step_tokens=64))
    try:
        render = serve._metrics(core)
        assert render is not None
        reg = core.register(wire.RegisterRequest(worker_id="w"))
        core.step(StepCall.build("w", reg.session, reg.epoch, 0, new_req_ids=["a"],
                                 prompt_lens=[4]))
        time.sleep(0.3)  # past min_interval_s: the lease check publishes what it held back
        core.expire_leases()
        bodies: list[bytes] = []
        with core.lock:  # a step in progress, as long as it likes
            scraper = threading.Thread(target=lambda: bodies.append(render()[0]))
            scraper.start()
            scraper.join(timeout=30)
            assert not scraper.is_alive(), "the scrape waited for the step lock"
        assert live_requests(bodies[0]) == 1
    finally:
        core.close()


def test_expired_leases_step_latency_and_invariant_violations(
        make_manager: Callable[..., KVCacheManager]) -> None:
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, AllocatorMetrics(registry, make_manager()))
    metrics.invariant_violation()
    metrics.lease_expired(2)
    metrics.observe_step("ipc", 40e-6)
    metrics.observe_step("ipc", 3e-3)
    metrics.observe_step("rest", 0.2)
    s = scrape(registry)
    assert value(s, "kvalloc_invariant_violations_total") == 1
    assert value(s, "kvalloc_leases_expired_total") == 2
    assert value(s, "kvalloc_step_latency_seconds_count", transport="ipc") == 2
    assert value(s, "kvalloc_step_latency_seconds_sum", transport="ipc") == pytest.approx(3.04e-3)
    assert value(s, "kvalloc_step_latency_seconds_bucket", transport="ipc", le="5e-05") == 1
    assert value(s, "kvalloc_step_latency_seconds_bucket", transport="ipc", le="0.005") == 2
    assert value(s, "kvalloc_step_latency_seconds_bucket", transport="rest", le="0.1") == 0
    assert value(s, "kvalloc_step_latency_seconds_bucket", transport="rest", le="+Inf") == 1


def test_service_names_follow_prometheus_rules_and_the_global_registry_is_untouched(
        make_manager: Callable[..., KVCacheManager]) -> None:
    before = set(REGISTRY._names_to_collectors)
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry, AllocatorMetrics(registry, make_manager()))
    metrics.observe_step("ipc", 1e-3)
    assert set(REGISTRY._names_to_collectors) == before
    assert_names_follow_prometheus_rules(registry)


def test_the_wire_and_the_metrics_count_used_and_parked_blocks_alike() -> None:
    """A finished request leaves its cached prompt blocks parked: `PoolState` and ``/metrics``
    both count them as parked, not used, and pool = free + used + parked on both."""
    pool = PoolConfig(num_layers=2, num_kv_heads=2, head_dim=8, device="cpu", num_blocks=64,
                      tokens_per_block=4, max_seq_len=64, max_draft_len=2, max_batch_size=8)
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=64, prefix_caching=True))
    try:
        render = serve._metrics(core)
        assert render is not None
        kv = Client.in_process(core, worker_id="w")
        kv.register()
        first = kv.step(new=(["a", "b"], [16, 9]), prompt_token_ids=np.arange(25))
        kv.step(grants=(first.admitted, [0, 0]))  # commits the prompts: their blocks cached
        kv.step(results=(first.admitted, [0, 0]), finished=[first.admitted[0]])
        time.sleep(0.3)  # past min_interval_s: the lease check publishes what it held back
        core.expire_leases()
        state = kv.get_pool()
        samples = {s.name: s.value for f in text_string_to_metric_families(render()[0].decode())
                   for s in f.samples}
        assert state.parked_blocks == samples["kvalloc_prefix_parked_blocks"] == 4
        assert state.used_blocks == samples["kvalloc_pool_used_blocks"] == 3  # "b": 9 + 1 + 0
        assert state.free_blocks == samples["kvalloc_pool_free_blocks"]
        assert state.free_blocks + state.used_blocks + state.parked_blocks == 64
    finally:
        core.close()
