"""What a rank of a tensor-parallel worker runs in the tests: the oracle's tiny Llama sharded for
its rank (`worker.parallel.sharding`), an engine over a `ShardClient` of a real tensor-parallel
``kvalloc serve``, the oracle's prompts. The ranks import this module by name (spawned children
get the parent's ``sys.path``), so it holds module-level functions only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from kvalloc.server.client import Client
from kvalloc.worker.drafters import DeviceOracleDrafter
from kvalloc.worker.engine import Engine
from kvalloc.worker.model import random_model
from kvalloc.worker.parallel.sharding import shard_model
from kvalloc.worker.requests import NamedPrompt
from kvalloc.worker.shard_client import ShardClient
from worker_oracle import CONFIGS, MAX_NEW_TOKENS

ORACLE_SEED = 3


def generate(rank: int, world: int, address: str, prompts: Sequence[NamedPrompt],
             expected: Mapping[str, Sequence[int]], overlap: bool, draft_len: int,
             rate: float, devices: Sequence[str] = ("cpu", "cpu")
             ) -> tuple[dict[str, list[int]], dict[str, float], tuple[int, int]]:
    """This rank's outputs, its run's figures and the KV heads its pool shard holds; the model
    runs on ``devices[rank]``, where the rank's shard of the pool is. The shard is poisoned
    with NaN first: a read of anything not committed shows in the tokens."""
    torch.set_num_threads(1)
    config = CONFIGS["llama"]
    model = shard_model(random_model(config, seed=0, device=devices[rank]), rank, world)
    shards = ShardClient(rank, world, Client(address, worker_id="tp") if rank == 0 else None)
    shards.register(overlap=overlap)
    assert shards.pool is not None and shards.pool.heads is not None
    shards.pool.kv.fill_(float("nan"))
    heads = shards.pool.heads
    drafter = DeviceOracleDrafter(expected, rate, vocab_size=config.vocab_size,
                                  device=shards.pool.kv.device, seed=ORACLE_SEED)
    eos = model.generation_config.eos_token_id
    engine = Engine(model, shards, drafter, draft_len=draft_len, overlap=overlap, validate=True,
                    stop_token_ids=[] if eos is None else [eos])
    outputs = engine.run(list(prompts), MAX_NEW_TOKENS)
    shards.deregister()
    return outputs, engine.stats.as_dict(), heads


def refused(rank: int, world: int, address: str) -> str:
    """What registering this rank against ``address`` raises."""
    shards = ShardClient(rank, world, Client(address, worker_id="tp") if rank == 0 else None)
    try:
        shards.register()
    except Exception as exc:  # the test reads which, on every rank
        return f"{type(exc).__name__}: {exc}"
    return ""
