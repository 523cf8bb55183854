"""A tensor-parallel shard computes what the full model computes: two gloo ranks, each holding
half of every layer's query and KV heads and MLP columns, give the full model's logits (float32
rounding: `torch.testing.assert_close`'s float32 defaults, rtol 1.3e-6 and atol 1e-5; the
differences measured were at most 1.8e-7, on logits under 0.6) and its greedy tokens, for
Llama (with and without biases on the row-split layers), Qwen2 (q/k/v biases) and Mistral (a
sliding window). Through the kvalloc attention each rank's calls see its own heads only, and
its pool shard ends up holding exactly its KV heads of the full model's pool
(`shard_kv_heads`). A model the world size does not divide is refused, untouched.
"""

from __future__ import annotations

import re

import pytest
import torch
from kvalloc.worker.errors import ModelLoadError, ShardingError
from kvalloc.worker.model import random_model
from kvalloc.worker.parallel.local_ranks import run_local_ranks
from kvalloc.worker.parallel.sharding import shard_model
from kvalloc.worker.parallel.split import shard_kv_heads
from tp_ranks import (
    CONFIGS,
    FIRST_STEP,
    PROMPT_LEN,
    TINY,
    Answers,
    answers,
    rank_programme,
    tiny_model,
)
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

WORLD = 2
FAMILIES = sorted(CONFIGS)
# One run of both ranks over every family took 5-15 s on the loaded two-core machine.
RUN_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(2 * RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def ranks() -> list[tuple[dict[str, Answers], tuple[str, bool]]]:
    return run_local_ranks(rank_programme, WORLD, FAMILIES, timeout_s=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def full() -> dict[str, Answers]:
    return {family: answers(tiny_model(family)) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_gives_the_full_models_logits(ranks: list, full: dict[str, Answers],
                                                 family: str) -> None:
    for shard, _ in ranks:
        torch.testing.assert_close(shard[family].logits, full[family].logits)
        torch.testing.assert_close(shard[family].pool_logits, full[family].logits[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_gives_the_full_models_tokens(ranks: list, full: dict[str, Answers],
                                                      family: str) -> None:
    for shard, _ in ranks:
        assert shard[family].generated.tolist() == full[family].generated.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kvalloc_attention_sees_the_ranks_heads_only(ranks: list, family: str) -> None:
    heads, kv_heads = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    head_dim = TINY["hidden_size"] // heads
    expected = [(layer, (1, heads // WORLD, n, head_dim), (1, kv_heads // WORLD, n, head_dim),
                 (1, kv_heads // WORLD, n, head_dim))
                for n in (FIRST_STEP, PROMPT_LEN - FIRST_STEP)
                for layer in range(TINY["num_hidden_layers"])]
    for shard, _ in ranks:
        assert shard[family].attention_calls == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shards_config_and_layers_say_the_shards_sizes(ranks: list, family: str) -> None:
    sizes = (TINY["num_attention_heads"] // WORLD, TINY["num_key_value_heads"] // WORLD,
             TINY["intermediate_size"] // WORLD)
    for shard, _ in ranks:
        assert shard[family].sizes == [sizes] * (1 + TINY["num_hidden_layers"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pool_shard_holds_the_ranks_kv_heads(ranks: list, full: dict[str, Answers],
                                                 family: str) -> None:
    layers, kv_heads, head_dim = full[family].kv_shape
    for rank, (shard, _) in enumerate(ranks):
        start, stop = shard_kv_heads(kv_heads, rank, WORLD)
        assert shard[family].kv_shape == (layers, kv_heads // WORLD, head_dim)  # kv_shape(config)
        torch.testing.assert_close(shard[family].pool, full[family].pool[:, :, :, start:stop])


def test_sharding_for_another_rank_is_refused_untouched(ranks: list) -> None:
    for rank, (_, (message, untouched)) in enumerate(ranks):
        assert message == (f"rank: rank {(rank + 1) % WORLD} of {WORLD} asked for, but this "
                           f"process is rank {rank} of {WORLD} in the process group")
        assert untouched


@pytest.mark.parametrize(("overrides", "rank", "world", "message"), [
    ({}, 0, 4, "num_key_value_heads: 2 is not divisible by the world size 4"),
    ({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}, 0, 2,
     "num_attention_heads: 3 is not divisible by the world size 2"),
    ({"num_key_value_heads": 3}, 0, 1,
     "num_attention_heads: 4 is not a multiple of num_key_value_heads 3"),
    ({"intermediate_size": 129}, 0, 2,
     "intermediate_size: 129 is not divisible by the world size 2"),
    ({}, 2, 2, "rank: 2 is outside 0..1 (world 2)"),
    ({}, 0, 0, "world: 0 ranks; a model needs at least 1"),
    # Shardable, but this process is in no process group: its sums would have no one to meet.
    ({}, 0, 2, "group: torch.distributed has no process group"),
])
def test_a_model_that_cannot_be_sharded_is_refused_untouched(
        overrides: dict[str, int], rank: int, world: int, message: str) -> None:
    model = random_model(LlamaConfig(**{**TINY, **overrides}), seed=0)
    before = ({n: p.clone() for n, p in model.state_dict().items()}, model.config.to_dict())
    with pytest.raises(ShardingError, match=f"^{re.escape(message)}"):
        shard_model(model, rank, world)
    assert model.config.to_dict() == before[1]
    after = model.state_dict()
    assert all(torch.equal(after[name], p) for name, p in before[0].items())
    assert issubclass(ShardingError, ModelLoadError)


def test_an_unsupported_family_is_refused() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ShardingError, match="model_type: 'gpt2' cannot be sharded"):
        shard_model(model, 0, 2)
