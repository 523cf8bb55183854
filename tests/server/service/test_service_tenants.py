"""Tenants of one prefix cache: each worker's prompts are hashed in its own namespace unless the
operator groups workers (``cache_groups``). A worker can then neither learn whether another sent
a prompt (the cached-token count it is answered) nor make another read K/V it staged: only
grouped workers share blocks."""

from __future__ import annotations

import numpy as np
import pytest
from kvalloc.allocator import PoolConfig
from kvalloc.server.client import Client
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from pydantic import ValidationError
from service_harness import stage_pattern

TPB = 4
PROMPT = np.arange(1000, 1068)  # 17 full blocks: a probe may hit 16 (64 tokens)
HIT = 64


def make_core(**service: object) -> ServiceCore:
    pool = PoolConfig(num_layers=2, num_kv_heads=2, head_dim=8, device="cpu", num_blocks=128,
                      tokens_per_block=TPB, max_seq_len=128, max_draft_len=2, max_batch_size=8)
    return ServiceCore(ServiceConfig(pool=pool, max_step_tokens=128, prefix_caching=True,
                                     **service))


def worker(core: ServiceCore, worker_id: str) -> Client:
    client = Client.in_process(core, worker_id=worker_id)
    client.register()
    return client


def cache_prompt(client: Client, req_id: str, tag: int) -> int:
    """Send ``PROMPT``, stage its prefill as ``tag`` and commit it; returns its cached tokens."""
    reply = client.step(new=([req_id], [PROMPT.size]), prompt_token_ids=PROMPT)
    stage_pattern(client.pool.staging, int(reply.scheduled.num_tokens[0]), tag)
    client.step()
    return int(reply.cached_tokens[0])


@pytest.mark.parametrize(("groups", "probe"), [({}, 0), ({"team": ["a", "b"]}, HIT),
                                               ({"team": ["a"], "other": ["b"]}, 0)])
def test_a_probe_hits_only_inside_its_namespace(groups: dict[str, list[str]], probe: int):
    core = make_core(cache_groups=groups)
    try:
        a, b = worker(core, "a"), worker(core, "b")
        assert cache_prompt(a, "secret", tag=1) == 0
        reply = b.step(new=(["guess"], [PROMPT.size]), prompt_token_ids=PROMPT)
        assert reply.cached_tokens.tolist() == [probe]
        assert cache_prompt(a, "again", tag=1) == HIT  # a's own blocks still serve it
        core.check_invariants()
    finally:
        core.close()


def test_k_v_staged_by_another_namespace_never_reaches_a_worker():
    core = make_core()
    try:
        a, b = worker(core, "a"), worker(core, "b")
        assert cache_prompt(b, "poison", tag=9) == 0  # b writes wrong K/V for the prompt
        assert cache_prompt(a, "first", tag=1) == 0  # a computes its own
        reply = a.step(new=(["second"], [PROMPT.size]), prompt_token_ids=PROMPT)
        assert reply.cached_tokens.tolist() == [HIT]
        row = int(reply.scheduled.rows[0])
        blocks = core.manager.table.host[row, : HIT // TPB].tolist()
        assert (core.pool.storage.kv[:, :, blocks][..., 0] == 1).all()
    finally:
        core.close()


@pytest.mark.parametrize(("groups", "message"), [
    ({"x": ["a"], "y": ["a"]}, "worker 'a' is in groups 'x' and 'y'"),
    ({"x": []}, "group 'x' needs a name and worker ids")])
def test_a_worker_is_in_one_group_at_most(groups: dict[str, list[str]], message: str):
    with pytest.raises(ValidationError, match=message):
        ServiceConfig(prefix_caching=True, cache_groups=groups)
