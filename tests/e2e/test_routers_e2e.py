"""kvalloc's KV events read by routers kvalloc did not write: NVIDIA Dynamo's standalone KV indexer
(``python -m dynamo.indexer`` from ai-dynamo-runtime, a process of its own) subscribed to each
worker's stream, and vLLM's own event classes as its current release ships them (`vllm_events`).
``make routers`` installs both. The service runs in this process, over real ZeroMQ sockets, so the
test can hold the router's index against the service's own cache."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import vllm_events
import zmq
from dynamo_indexer import DynamoIndexer, wait_until
from kvalloc.allocator import PoolConfig
from kvalloc.server.client import Client
from kvalloc.server.contract.routing import worker_salt
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.ranks import RankedService
from kvalloc.server.service.settings import ServiceConfig

TPB = 4
GROUPS = {"team": ["carol", "dave"]}
# The indexer applies a batch within milliseconds of its arrival; a loaded two-core machine may
# hold its thread for seconds.
SETTLE_S = 30.0


def make_config(tmp_path: Path, **service: object) -> ServiceConfig:
    pool = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="cpu", num_blocks=48,
                      tokens_per_block=TPB, max_seq_len=64, max_draft_len=2, max_batch_size=8)
    return ServiceConfig(pool=pool, max_step_tokens=128, prefix_caching=True,
                         kv_events=f"ipc://{tmp_path}/events-{{worker}}",
                         kv_events_replay=f"ipc://{tmp_path}/replay-{{worker}}",
                         cache_groups=GROUPS, **service)


def held(core: ServiceCore, worker_id: str) -> set[int]:
    """The blocks a worker can hit, as its stream names them: its namespace's registered
    blocks."""
    cache = core.manager.cache
    return {h for e in cache.stored_events(worker_salt(worker_id, GROUPS))
            for h in e.block_hashes}


def hit_tokens(core: ServiceCore, worker_id: str, prompt: np.ndarray) -> int:
    """The tokens of ``prompt`` the service holds for ``worker_id``: its leading full blocks
    registered in the worker's namespace."""
    manager = core.manager
    hashes = manager.prompt(prompt, worker_salt(worker_id, GROUPS)).hashes
    found = [h in manager.cache.block_of for h in hashes] + [False]
    return found.index(False) * TPB


def run_prompts(kv: Client, prompts: list[np.ndarray], finish: bool) -> None:
    """Each prompt prefilled and committed (its full blocks cached), finished when asked."""
    for prompt in prompts:
        admitted = kv.step(new=([f"r{prompt.sum()}"], [prompt.size]),
                           prompt_token_ids=prompt).admitted
        kv.step()  # commits the prefill: its full blocks are cached
        if finish:
            kv.step(finished=admitted)


@pytest.mark.parametrize(("shared_system_prompt", "host_tier"), [
    (False, False),
    # Each engine's copy of one system prompt: Dynamo keys a node by the first hash it saw for
    # its tokens, so every stream must name equal content alike (hashes over content alone).
    (True, False),
    # Every cached block also stored, and some evicted, in the host tier ("CPU" medium): Dynamo
    # keeps those apart and scores the pool's alone.
    (True, True),
])
def test_dynamos_indexer_holds_each_engines_blocks_and_scores_the_engine_that_cached_a_prompt(
        tmp_path: Path, shared_system_prompt: bool, host_tier: bool) -> None:
    rng = np.random.default_rng(7)
    system = rng.integers(0, 5000, 16)
    prompts = {name: [np.concatenate([system if shared_system_prompt
                                      else rng.integers(0, 5000, 16), rng.integers(0, 5000, n)])
                      for n in (12, 9, 20)] for name in ("alice", "bob", "carol")}
    core = ServiceCore(make_config(tmp_path, host_tier_bytes=(
        24 * 2 * TPB * 8 * 2 if host_tier else 0)))  # 24 blocks of one bf16 head of 8
    clients = {name: Client.in_process(core, worker_id=name)
               for name in ("alice", "bob", "carol", "dave")}
    ids = {name: i + 1 for i, name in enumerate(clients)}
    try:
        with DynamoIndexer(tmp_path / "indexer.log") as indexer:
            for name, kv in clients.items():
                kv.register()
                indexer.register(ids[name], f"ipc://{tmp_path}/events-{name}",
                                 f"ipc://{tmp_path}/replay-{name}", TPB)
            for name, kv in clients.items():
                if name in prompts:  # dave only shares carol's group
                    run_prompts(kv, prompts[name], finish=name != "carol")
            # Eviction: a long request takes parked blocks back from the cache.
            run_prompts(clients["bob"], [rng.integers(0, 5000, 60)], finish=True)
            # Held against the service twice: the blocks its index holds for each engine, and
            # for every prompt, cached or evicted since, the tokens each engine can hit.
            expected = {(ids[name], 0): held(core, name) for name in clients}
            expected = {key: blocks for key, blocks in expected.items() if blocks}
            assert expected and core.manager.counters.evicted_blocks
            assert wait_until(lambda: indexer.dump() == expected, timeout_s=SETTLE_S)
            every = [p for name in prompts for p in prompts[name]]

            def scores_match() -> bool:
                return all(indexer.query(prompt.tolist()) == {
                    (ids[name], 0): tokens for name in clients
                    if (tokens := hit_tokens(core, name, prompt))} for prompt in every)

            assert wait_until(scores_match, timeout_s=SETTLE_S)
            assert indexer.warnings() == []
            tier = core.manager.tier
            assert tier is None or tier.counters.evicted_blocks > 0
    finally:
        core.close()


def test_dynamo_scores_each_data_parallel_rank_by_its_own_blocks(tmp_path: Path) -> None:
    service = RankedService(make_config(tmp_path, devices=["cpu", "cpu"]))
    prompt = np.arange(100, 132)
    try:
        with DynamoIndexer(tmp_path / "indexer.log") as indexer:
            for rank in (0, 1):
                kv = Client.in_process(service, worker_id=f"w{rank}")
                kv.register(data_parallel_rank=rank)
                indexer.register(1, f"ipc://{tmp_path}/events-w{rank}",
                                 f"ipc://{tmp_path}/replay-w{rank}", TPB, dp_rank=rank)
                run_prompts(kv, [prompt[: 16 + 16 * rank]], finish=False)
            wait_until(lambda: indexer.query(prompt.tolist()) == {(1, 0): 16, (1, 1): 28},
                       timeout_s=SETTLE_S)
            assert indexer.warnings() == []
    finally:
        service.close()


@pytest.mark.parametrize(("shape", "host_tier"), [("maps", False), ("arrays", False),
                                                  ("maps", True)])
def test_vllms_own_classes_decode_every_live_and_replayed_frame(
        tmp_path: Path, shape: str, host_tier: bool, zmq_context: zmq.Context) -> None:
    vllm = vllm_events.load()
    decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch if shape == "maps" else LegacyBatch)
    core = ServiceCore(make_config(tmp_path, kv_events_shape=shape,
                                   host_tier_bytes=64 * 2 * TPB * 8 * 2 if host_tier else 0))
    kv = Client.in_process(core, worker_id="alice")
    try:
        kv.register()
        sub = zmq_context.socket(zmq.SUB)
        sub.subscribe(b"")
        sub.connect(f"ipc://{tmp_path}/events-alice")
        replay = zmq_context.socket(zmq.DEALER)
        replay.connect(f"ipc://{tmp_path}/replay-alice")
        prompts = [np.arange(10 * i, 10 * i + 24) for i in range(4)]
        wait_until(lambda: _live_after(kv, sub, prompts[0]), timeout_s=SETTLE_S)
        run_prompts(kv, prompts[1:], finish=True)
        live = _drain(sub)
        replayed = _replay(replay)
    finally:
        core.close()
    batches = [decoder.decode(frame) for frame in live + replayed]
    assert len(live) >= 3 and len(replayed) >= len(live)
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    hashes = {h for e in stored for h in e.block_hashes}
    assert hashes >= {origin.route for origin in core.manager.cache.origin.values()}
    if shape == "maps":
        media = {"GPU", "CPU"} if host_tier else {"GPU"}
        assert {(e.medium, e.group_idx, e.kv_cache_spec_kind, e.lora_name) for e in stored} == {
            (medium, 0, "full_attention", None) for medium in media}


def _live_after(kv: Client, sub: zmq.Socket, prompt: np.ndarray) -> bool:
    """Whether a live batch arrives after a prompt is cached (the subscription may reach the
    publisher after the first ones went out)."""
    run_prompts(kv, [prompt], finish=True)
    return bool(sub.poll(1000))


def _drain(sub: zmq.Socket) -> list[bytes]:
    frames = []
    while sub.poll(1000):
        frames.append(sub.recv_multipart()[2])
    return frames


def _replay(replay: zmq.Socket) -> list[bytes]:
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    frames = []
    while replay.poll(10_000):
        _, seq, payload = replay.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            return frames
        frames.append(payload)
    raise TimeoutError("the replay did not end")


# vLLM 0.23's array-like classes, written from that release's published shape (a look-alike: the
# current vllm release no longer ships them).
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(LegacyEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(LegacyEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(LegacyEvent):
    pass


class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
