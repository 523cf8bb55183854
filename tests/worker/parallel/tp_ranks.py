"""What the tensor-parallel tests run, in the ranks and in the parent alike: tiny random models
of each family (random biases too, which transformers initialises to zero), a batch of random
tokens, and each rank's whole programme, whose results the parent checks against the full
model.

The ranks import this module by name (spawned children get the parent's ``sys.path``), so it
holds module-level functions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvalloc.worker.attention.hook import PoolStep, kvalloc_attention
from kvalloc.worker.attention.pool_attention import PagedLayout
from kvalloc.worker.errors import ShardingError
from kvalloc.worker.model import kv_shape, random_model
from kvalloc.worker.parallel.sharding import shard_model
from transformers import (
    AttentionInterface,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "eos_token_id": None}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**TINY),
    # o_proj and down_proj with a bias: a row-split layer must add it once, not world times.
    "llama-biased": LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "qwen2": Qwen2Config(**TINY),  # q/k/v with a bias
    # A window of 8 positions: the prompts and the generated tokens slide out of it.
    "mistral": MistralConfig(**TINY, sliding_window=8),
}
BATCH, PROMPT_LEN, NEW_TOKENS = 3, 13, 10
FIRST_STEP = 7  # the kvalloc path's first step prefills this many tokens, the second the rest
TOKENS_PER_BLOCK = 4
RECORDING = "kvalloc-recording"
# One call of the attention function: its layer and the shapes of query, key and value.
AttentionCall = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def tiny_model(family: str) -> PreTrainedModel:
    """The same weights in every process, under transformers' sdpa attention."""
    model = random_model(CONFIGS[family], seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model.set_attn_implementation("sdpa")
    return model


def prompts() -> torch.Tensor:
    """int64 ``[BATCH, PROMPT_LEN]``."""
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, TINY["vocab_size"], (BATCH, PROMPT_LEN), generator=gen)


@dataclass(frozen=True)
class Answers:
    """What a model (a shard, or the full model) says about `prompts`."""

    logits: torch.Tensor  # [BATCH, PROMPT_LEN, vocab]
    generated: torch.Tensor  # greedy, [BATCH, NEW_TOKENS]
    pool_logits: torch.Tensor  # the first prompt through the kvalloc path, [PROMPT_LEN, vocab]
    pool: torch.Tensor  # its K/V in the pool afterwards, [L, 2, PROMPT_LEN, Hkv, D]
    attention_calls: list[AttentionCall]
    kv_shape: tuple[int, int, int]
    # (num_attention_heads, num_key_value_heads, intermediate_size) of its config and of the
    # parts that read them: query and KV heads of every layer's attention, its MLP's width
    sizes: list[tuple[int, int, int]]


def answers(model: PreTrainedModel) -> Answers:
    ids = prompts()
    with torch.inference_mode():
        logits = model(ids).logits
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=NEW_TOKENS)[:, PROMPT_LEN:]
    pool_logits, pool, calls = through_the_pool(model, ids[0])
    return Answers(logits, generated, pool_logits, pool, calls, kv_shape(model.config),
                   _sizes(model))


def _sizes(model: PreTrainedModel) -> list[tuple[int, int, int]]:
    config = model.config
    found = [(config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        kv_heads = attn.k_proj.out_features // attn.head_dim
        found.append((kv_heads * attn.num_key_value_groups, kv_heads, mlp.intermediate_size))
    return found


def through_the_pool(model: PreTrainedModel,
                     ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[AttentionCall]]:
    """One request in two steps through the kvalloc attention, recording what each of its calls
    sees: a prefill of `FIRST_STEP` tokens whose K/V is then committed into a pool shaped by
    the model's config, and the rest of the prompt over that history."""
    calls: list[AttentionCall] = []

    def recording(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append((module.layer_idx, tuple(query.shape), tuple(key.shape),
                      tuple(value.shape)))
        return kvalloc_attention(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(RECORDING, recording)
    layers, kv_heads, head_dim = kv_shape(model.config)
    blocks = -(-len(ids) // TOKENS_PER_BLOCK)
    kv = torch.zeros(layers, 2, blocks, TOKENS_PER_BLOCK, kv_heads, head_dim)
    staging = torch.zeros(layers, 2, len(ids), kv_heads, head_dim)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    model.set_attn_implementation(RECORDING)
    try:
        logits = [_pool_step(model, ids, start, stop, kv, staging, table)
                  for start, stop in ((0, FIRST_STEP), (FIRST_STEP, len(ids)))]
    finally:
        model.set_attn_implementation("sdpa")
    pool = kv.flatten(2, 3)[:, :, :len(ids)]  # the table maps position p to slot p
    return torch.cat(logits), pool, calls


def _pool_step(model: PreTrainedModel, ids: torch.Tensor, start: int, stop: int,
               kv: torch.Tensor, staging: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Positions ``[start, stop)`` over a history of ``start`` tokens, then their commit."""
    n = stop - start
    layout = PagedLayout.build(table, TOKENS_PER_BLOCK, rows=np.array([0]),
                               query_starts=np.array([0]), query_lens=np.array([n]),
                               starts=np.array([start]), group_width=n)
    with torch.inference_mode():
        logits = model(input_ids=ids[None, start:stop],
                       position_ids=torch.arange(start, stop)[None], use_cache=False,
                       kvalloc_step=PoolStep.of(kv, staging, layout)).logits[0]
    kv.flatten(2, 3)[:, :, layout.slots()] = staging[:, :, :n]
    return logits


def shard_answers(rank: int, world: int, families: list[str]) -> dict[str, Answers]:
    """A rank's programme: each family's shard and what it says."""
    return {family: answers(shard_model(tiny_model(family), rank, world))
            for family in families}


def shard_as_other_rank(rank: int, world: int) -> tuple[str, bool]:
    """The error of sharding for the next rank's shard, and whether the weights stayed whole."""
    model = tiny_model("llama")
    before = {name: p.clone() for name, p in model.state_dict().items()}
    try:
        shard_model(model, (rank + 1) % world, world)
    except ShardingError as exc:
        after = model.state_dict()
        return str(exc), all(torch.equal(before[name], after[name]) for name in before)
    return "", False


def rank_programme(rank: int, world: int,
                   families: list[str]) -> tuple[dict[str, Answers], tuple[str, bool]]:
    """Everything the sharding tests ask of a rank, in one run: starting ranks is the slow part."""
    return shard_answers(rank, world, families), shard_as_other_rank(rank, world)
