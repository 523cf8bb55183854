"""The host tier through the service (CPU pool): a written prompt's blocks are copied to the tier
with the bytes the commit wrote, a prefix the pool evicted comes back with those bytes in fresh
blocks for any session of its namespace and for no other, what the tier holds and moved is on
/metrics, and a tier that cannot be had is refused before anything is made."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pytest
import torch
from kvalloc.allocator import PoolConfig
from kvalloc.server import serve
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import PoolTooLarge
from kvalloc.server.serve_arguments import add_arguments
from kvalloc.server.service import footprint
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from prometheus_scrape import samples_of, value
from pydantic import ValidationError
from service_harness import stage_pattern

# Five full blocks of 4 tokens; a hit leaves the last token to compute, so four come back.
PROMPT = np.arange(900, 920)


# Two heads of K and V, or an MLA latent: one plane of one head, 24 wide.
LAYOUTS = {"kv": {"num_kv_heads": 2, "head_dim": 8},
           "latent": {"kv_layout": "latent", "num_kv_heads": 1, "head_dim": 24}}


def make_config(layout: str = "kv", **service: object) -> ServiceConfig:
    pool = PoolConfig(num_layers=2, device="cpu", num_blocks=24, tokens_per_block=4,
                      max_seq_len=64, max_draft_len=2, max_batch_size=8, **LAYOUTS[layout])
    return ServiceConfig(pool=pool, max_step_tokens=64, **{
        "prefix_caching": True, "host_tier_bytes": 64 * pool.bytes_per_block, **service})


def cache_prompt(core: ServiceCore, worker_id: str) -> list[int]:
    """``worker_id`` prefills PROMPT and its commit writes it; returns its first four
    blocks."""
    kv = Client.in_process(core, worker_id=worker_id)
    kv.register()
    first = kv.step(new=(["a"], [PROMPT.size]), prompt_token_ids=PROMPT)
    stage_pattern(kv.pool.staging, PROMPT.size, tag=7)
    kv.step()  # the commit writes it
    blocks = core.manager.table.host[int(first.scheduled.rows[0]), :4].tolist()
    kv.step(finished=first.admitted)
    return blocks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_prefix_the_pool_evicted_comes_back_with_its_bytes_for_its_namespace_alone(layout):
    core = ServiceCore(make_config(layout, cache_groups={"team": ["a1", "a2"]}))
    try:
        blocks = cache_prompt(core, "a1")
        written = core.pool.storage.kv[:, :, blocks].clone()
        assert (written[..., 0] == 7).all()
        tier = core.manager.tier
        assert tier.counters.offloaded_blocks == 5
        with core.lock:
            core.manager.clear_prefix_cache()
            core.pipeline.sync_cache()
        core.pool.storage.kv[:, :, blocks] = float("nan")  # what the pool held is gone
        other = Client.in_process(core, worker_id="b")  # another namespace
        other.register()
        assert other.step(new=(["x"], [PROMPT.size]),
                          prompt_token_ids=PROMPT).cached_tokens.tolist() == [0]
        same = Client.in_process(core, worker_id="a2")  # the same namespace, another session
        same.register()
        reply = same.step(new=(["y"], [PROMPT.size]), prompt_token_ids=PROMPT)
        assert reply.cached_tokens.tolist() == [16] and tier.counters.onboarded_blocks == 4
        onboarded = core.manager.table.host[int(reply.scheduled.rows[0]), :4].tolist()
        assert torch.equal(core.pool.storage.kv[:, :, onboarded], written)
        core.check_invariants()
    finally:
        core.close()


def test_metrics_show_what_the_tier_holds_and_moved():
    core = ServiceCore(make_config(cache_groups={"team": ["w", "w2"]}))
    try:
        render = serve._metrics(core)
        assert render is not None
        cache_prompt(core, "w")
        with core.lock:
            core.manager.clear_prefix_cache()
            core.pipeline.sync_cache()
        again = Client.in_process(core, worker_id="w2")
        again.register()
        again.step(new=(["b"], [PROMPT.size]), prompt_token_ids=PROMPT)
        time.sleep(0.3)  # past min_interval_s: the lease check publishes what it held back
        core.expire_leases()
        body = samples_of(render()[0].decode())
        block = core.config.pool.bytes_per_block
        assert value(body, "kvalloc_host_tier_blocks") == 64
        assert value(body, "kvalloc_host_tier_bytes") == 64 * block
        assert value(body, "kvalloc_host_tier_held_blocks") == 5
        assert value(body, "kvalloc_host_tier_offloaded_bytes_total") == 5 * block
        assert value(body, "kvalloc_host_tier_onboarded_blocks_total") == 4
        assert value(body, "kvalloc_host_tier_copy_seconds_total") > 0
    finally:
        core.close()


def test_a_tier_without_caching_or_holding_no_block_is_refused():
    with pytest.raises(ValidationError, match="needs prefix_caching"):
        make_config(prefix_caching=False)
    with pytest.raises(ValidationError, match="holds no block"):
        make_config(host_tier_bytes=100)


def test_the_flag_takes_a_size_and_names_what_is_wrong(capsys: pytest.CaptureFixture[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--host-tier", "2GiB"]).host_tier_bytes == 2 << 30
    with pytest.raises(SystemExit):
        parser.parse_args(["--host-tier", "lots"])
    assert "'lots' is not a size in bytes" in capsys.readouterr().err


def test_a_tier_larger_than_the_ram_available_is_refused_before_anything_is_made(
        monkeypatch: pytest.MonkeyPatch):
    config = make_config()
    pool = footprint.footprint(config).total  # the CPU pool fits, with half the tier beside it
    monkeypatch.setattr(footprint, "_mem_available",
                        lambda: pool + 32 * config.pool.bytes_per_block)
    with pytest.raises(PoolTooLarge, match=r"host_tier: .* lower --host-tier"):
        footprint.check_fits(config)


def test_a_prefix_larger_than_a_steps_share_comes_back_over_steps_its_prompt_refused_meanwhile():
    block = make_config().pool.bytes_per_block
    core = ServiceCore(make_config(host_tier_onboard_bytes=2 * block,
                                   cache_groups={"team": ["a1", "a2"]}))
    try:
        cache_prompt(core, "a1")
        with core.lock:
            core.manager.clear_prefix_cache()
            core.pipeline.sync_cache()
        kv = Client.in_process(core, worker_id="a2")
        kv.register()
        # Four blocks to bring back, two a step: refused once, admitted with all four the next.
        reply = kv.step(new=(["y"], [PROMPT.size]), prompt_token_ids=PROMPT)
        assert reply.admitted.tolist() == [-1] and reply.refused.onboarding()
        assert reply.refused.reasons.tolist() == [3]
        reply = kv.step(new=(["y"], [PROMPT.size]), prompt_token_ids=PROMPT)
        assert reply.cached_tokens.tolist() == [16] and not reply.refused.onboarding()
        assert core.manager.tier.counters.deferred_requests == 1
        assert core.manager.tier.counters.onboarded_blocks == 4
        core.check_invariants()
    finally:
        core.close()
