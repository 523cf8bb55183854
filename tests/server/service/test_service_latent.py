"""A service over a latent (MLA) pool: one plane of one head a layer, the latent's width as its
head_dim. The worker is told the layout at registration and attaches ``[L, 1, blocks, T, 1, D]``
and a one-plane staging buffer; grants, the commit of accepted tokens only, prefix hits and KV
events are those of a K/V pool, block for block."""

from __future__ import annotations

import math

import numpy as np
import torch
import zmq
from kvalloc.allocator.capacity.kv_events import router_hashes
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.routing import worker_salt
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from service_harness import nwor_scenario, replayed_events, stage_pattern

WIDTH = 72  # a small latent: 64 of compressed KV and a rope key of 8 (DeepSeek-V3: 512 + 64)
LATENT = {"kv_layout": "latent", "num_kv_heads": 1, "head_dim": WIDTH}
SYSTEM = np.arange(700, 716)  # four full blocks of 4 tokens


def test_a_worker_attaches_a_one_plane_pool_and_its_layout_says_latent(make_core) -> None:
    core = make_core(**LATENT)
    client = Client.in_process(core, worker_id="w")
    client.register()
    assert client.registration.layout.kv_layout == "latent"
    assert client.pool.kv.shape == (2, 1, core.config.pool.total_blocks, 4, 1, WIDTH)
    assert client.pool.staging.shape == (2, 1, 64, 1, WIDTH)


def test_the_next_step_commits_exactly_the_accepted_latents(make_core) -> None:
    """The NWOR scenario over a NaN-poisoned latent pool: afterwards it holds the committed
    tokens' latents and NaN in every other slot (a rejected draft, a reverted forward)."""
    core = make_core(**LATENT)
    client = Client.in_process(core, worker_id="w")
    client.register()
    outcome = nwor_scenario(client, poison=math.nan)
    assert not outcome.mismatches, outcome.mismatches
    assert outcome.commit == wire.CommitSummary(tokens=13, written=5)
    assert client.pool.kv.isnan().any()  # the poison is still there where nothing was written


def test_a_latent_prompt_reuses_a_written_prefix_and_publishes_its_blocks(zmq_context) -> None:
    core = ServiceCore(ServiceConfig(
        pool={"num_layers": 2, "device": "cpu", "num_blocks": 64, "tokens_per_block": 4,
              "max_seq_len": 64, "max_draft_len": 2, "max_batch_size": 8, **LATENT},
        max_step_tokens=64, prefix_caching=True, kv_events="tcp://127.0.0.1:*",
        kv_events_replay="tcp://127.0.0.1:*", kv_events_plaintext=True))
    replay = zmq_context.socket(zmq.DEALER)
    try:
        replay.connect(core.kv_events.endpoints()[""].replay)
        kv = Client.in_process(core, worker_id="w")
        kv.register()
        first = kv.step(new=(["a"], [20]), prompt_token_ids=np.concatenate([SYSTEM, [1] * 4]))
        stage_pattern(kv.pool.staging, 20, tag=1)
        kv.step()  # commits "a"'s prompt: its blocks hold its latents and are cached
        again = kv.step(new=(["c"], [19]), prompt_token_ids=np.concatenate([SYSTEM, [3] * 3]))
        assert again.cached_tokens.tolist() == [16]
        row_a, row_c = int(first.scheduled.rows[0]), int(again.scheduled.rows[0])
        shared = core.manager.table.host[row_a, :4].tolist()
        assert core.manager.table.host[row_c, :4].tolist() == shared
        assert (core.pool.storage.kv[:, 0, shared][..., 0] == 1).all()
        events = replayed_events(replay)
        stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
        prompt = core.manager.cache.prompts[row_a]
        assert stored == router_hashes(prompt.tokens, 4, namespace=worker_salt("w", {}))
    finally:
        replay.close(linger=0)
        core.close()


def test_an_fp8_latent_pool_commits_with_its_one_scale_per_layer(make_core) -> None:
    core = make_core(dtype="fp8_e4m3", k_scales=(0.5, 2.0), **LATENT)
    client = Client.in_process(core, worker_id="w")
    client.register()
    assert client.registration.layout.k_scales == [0.5, 2.0]
    assert client.registration.layout.v_scales is None
    reply = client.step(new=(["a"], [3]))
    slots = client.pool.slot_mapping(reply).numpy()
    stage_pattern(client.pool.staging, 3, tag=4)
    client.step()
    stored = client.pool.kv.view(2, -1, WIDTH)[:, slots].float()
    staged = client.pool.staging[:, 0, :3, 0].float()
    assert torch.equal(stored, staged / torch.tensor([0.5, 2.0]).view(2, 1, 1))
