"""The worker over a pool too small for its prompts' prefixes, with a host tier below it (float32,
CPU): the tokens equal `model.generate`'s, synchronous and one step ahead, in a first run that
evicts its own prefixes and in a second run by a new session of the same worker (the first one
killed), whose prompts are served from the tier. The pool and the tier start poisoned with NaN,
so a read of a block that was never committed, or onboarded from a slot that was never offloaded,
shows in the tokens."""

from __future__ import annotations

import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.service.core import ServiceCore
from kvalloc.worker.engine import Engine
from worker_oracle import MAX_NEW_TOKENS, Oracle, pool_config

pytest_plugins = ["worker_fixtures"]


def run(oracle: Oracle, core: ServiceCore, overlap: bool) -> Engine:
    client = Client.in_process(core, worker_id="worker")
    client.register(overlap=overlap, replace=True)
    engine = Engine(oracle.model, client, None, draft_len=0, overlap=overlap,
                    stop_token_ids=oracle.stop_tokens(), share_prefixes=True)
    assert engine.run(oracle.prompts, MAX_NEW_TOKENS) == oracle.expected
    return engine


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("bound", [None, 2], ids=["unbounded", "two-blocks-a-step"])
def test_prefixes_evicted_from_the_pool_come_back_from_the_tier_across_a_restart(
        llama_oracle: Oracle, overlap: bool, bound: int | None) -> None:
    """With a bound, a prefix comes back two blocks a step, its prompt waiting meanwhile."""
    oracle = llama_oracle
    # 40 blocks of 4 tokens for prompts of 177 tokens and their outputs: the pool evicts the
    # first prompts' blocks while the last ones run.
    config = pool_config(oracle.model, num_blocks=40)
    config = config.model_copy(update={
        "prefix_caching": True, "host_tier_bytes": 1 << 20,
        "host_tier_onboard_bytes": 0 if bound is None else bound * config.pool.bytes_per_block})
    core = ServiceCore(config)
    try:
        core.pool.storage.kv.fill_(float("nan"))
        core.pool.tier_stores[0].memory.view(torch.float32).fill_(float("nan"))
        run(oracle, core, overlap)
        tier = core.manager.tier
        assert core.manager.onboard_blocks_per_step == bound
        assert tier.counters.offloaded_blocks > 0 and core.manager.counters.evicted_blocks > 0
        core.drop_worker("worker")  # killed: its session ends, its requests are freed
        again = run(oracle, core, overlap)
        # Onboarded blocks a refused prompt does not take stay cached in the pool (and may be
        # evicted and onboarded again), so they bound nothing; they are there, and served.
        assert tier.counters.onboarded_blocks > 0 and again.stats.cached_prompt_tokens > 0
        assert (tier.counters.deferred_requests > 0) == (bound is not None)
        core.manager.check_invariants()
    finally:
        core.close()
