"""The worker tests' oracle: tiny random Llama, Qwen2, Mistral and DeepSeek-V3 models, prompts
of varied lengths, and transformers' own answers for them (``generate`` and a plain forward's
K/V), which are the oracle every worker run is checked against.

`WINDOWED` adds the families only the windowed tests run: a Qwen2 model of one full and one
sliding layer (``layer_types``), and a DeepSeek-V3-shaped model whose config carries a sliding
window, a look-alike of DeepSeek-V4's windowed latent cache: transformers' DeepSeek-V3 has no
window, so its answers come from transformers' own sdpa attention with the window added to
the mask (`windowed_sdpa`, in `REFERENCE_ATTENTION`), every layer alike, as the worker's latent
attention applies it.

Pool shape: 4 tokens per block, so the longest prompt crosses many block boundaries, and
``max_step_tokens`` 48, so the 70-token prompt is prefilled in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from kvalloc.allocator import PoolConfig
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.model import kv_layout, kv_shape, random_model, sized_groups
from kvalloc.worker.requests import NamedPrompt
from kvalloc.worker.run_stats import RunStats
from transformers import (
    AttentionInterface,
    DeepseekV3Config,
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

MAX_NEW_TOKENS = 10
PROMPT_LENS = (1, 3, 6, 13, 17, 26, 41, 70)
TOKENS_PER_BLOCK = 4
MAX_STEP_TOKENS = 48
MAX_DRAFT_LEN = 3

TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
# MLA: three layers, the first dense and two of mixture-of-experts (4 routed, 2 a token, one
# shared), latent 16 + rope 8 over 4 heads whose no-rope, rope and value widths differ.
DEEPSEEK = {**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4, "first_k_dense_replace": 1,
            "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 12, "v_head_dim": 10, "eos_token_id": None}
CONFIGS = {
    # Llama's default eos id (2) stays: a prompt that samples it stops early, as generate does.
    "llama": LlamaConfig(**TINY),
    "qwen2": Qwen2Config(**TINY, eos_token_id=None),
    # A window of 16 positions: most prompts and every output slide out of it.
    "mistral": MistralConfig(**TINY, eos_token_id=None, sliding_window=16),
    # With a q LoRA rank (q_a_proj, q_a_layernorm, q_b_proj), as DeepSeek-V3 has it, and without
    # (q_proj, as the Lite models have it), the latter with DeepSeek's yarn scaling from 64
    # positions (the longer prompts pass them; the softmax scale takes yarn's mscale squared)
    # and rotary halves instead of DeepSeek's interleaved pairs.
    "deepseek_v3": DeepseekV3Config(**DEEPSEEK, q_lora_rank=12),
    "deepseek_v3_q_proj": DeepseekV3Config(**DEEPSEEK, q_lora_rank=None, rope_interleave=False,
                                           rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1}),
}


WINDOWED = {
    # Layer 0 full, layer 1 sliding over 16 positions (layers from max_window_layers slide).
    "qwen2_mixed": Qwen2Config(**TINY, eos_token_id=None, use_sliding_window=True,
                               sliding_window=16, max_window_layers=1),
    "deepseek_v3_window": DeepseekV3Config(**DEEPSEEK, q_lora_rank=12, sliding_window=16),
}
WINDOWED_SDPA = "kvalloc_test_windowed_sdpa"
# Families whose reference is not transformers' sdpa: the model slides its layers by a window
# transformers' class ignores.
REFERENCE_ATTENTION = {"deepseek_v3_window": WINDOWED_SDPA}


def windowed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' sdpa, each query seeing only the last ``config.sliding_window`` positions:
    one unpadded sequence, so the ``q`` queries are the last ``q`` of the ``kv`` positions."""
    window = module.config.sliding_window
    q_len, kv_len = query.shape[2], key.shape[2]
    at = torch.arange(q_len, device=query.device)[:, None] + kv_len - q_len
    keys = torch.arange(kv_len, device=query.device)[None, :]
    band = (keys <= at) & (keys > at - window)
    if attention_mask is None:
        mask = band
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask & band
    else:
        mask = attention_mask.masked_fill(~band, torch.finfo(attention_mask.dtype).min)
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


@dataclass(repr=False)
class Oracle:
    """A tiny model (kvalloc attention), the same weights under transformers' sdpa, the prompts,
    and what transformers says about them."""

    model: PreTrainedModel
    reference: PreTrainedModel
    prompts: list[NamedPrompt]
    expected: dict[str, list[int]]  # generate(do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    # Per prompt: K and V of prompt + output from one plain forward, [layers, 2, tokens, H, D];
    # a latent model's [c | k_rope], [layers, 1, tokens, 1, R + P].
    kv: dict[str, torch.Tensor]

    def stop_tokens(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return [] if eos is None else [eos]


@cache
def make_oracle(family: str) -> Oracle:
    config = {**CONFIGS, **WINDOWED}[family]
    model = random_model(config, seed=0)
    reference = random_model(config, seed=0)
    AttentionInterface.register(WINDOWED_SDPA, windowed_sdpa)
    reference.set_attn_implementation(REFERENCE_ATTENTION.get(family, "sdpa"))
    rng = np.random.default_rng(1)
    prompts = [NamedPrompt(f"{family}-{i}", rng.integers(0, config.vocab_size, n).tolist())
               for i, n in enumerate(PROMPT_LENS)]
    expected, kv = {}, {}
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p.token_ids])
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_NEW_TOKENS)
            expected[p.req_id] = out[0, ids.shape[1]:].tolist()
            # A cache without a config keeps every position, sliding layers too.
            cache = reference(out, cache=DynamicCache(), use_cache=True).cache
            kv[p.req_id] = _pool_rows(cache, config)
    return Oracle(model, reference, prompts, expected, kv)


def _pool_rows(cache: DynamicCache, config: object) -> torch.Tensor:
    """A cache's entries as the pool holds them: transformers keeps an MLA layer's latent as
    its "keys" and its rotated rope key as its "values", one head each."""
    if kv_layout(config) == "latent":
        planes = [torch.cat([layer.keys[0], layer.values[0]], dim=-1)[None]
                  for layer in cache.layers]
    else:
        planes = [torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]
    return torch.stack(planes).transpose(2, 3)


def pool_config(model: PreTrainedModel, *, nwor: bool = True, grouped: bool = False,
                **overrides: object) -> ServiceConfig:
    """The tests' pool for ``model``; ``grouped``: in the groups `sized_groups` makes of a
    model that mixes layer kinds, as ``kvalloc worker --in-process`` serves it."""
    layers, kv_heads, head_dim = kv_shape(model.config)
    pool = {"num_blocks": 256, "tokens_per_block": TOKENS_PER_BLOCK, "num_layers": layers,
            "num_kv_heads": kv_heads, "head_dim": head_dim,
            "kv_layout": kv_layout(model.config), "dtype": "float32",
            "device": "cpu", "max_batch_size": 8, "max_seq_len": 96,
            "max_draft_len": MAX_DRAFT_LEN, "overlap_scheduler": True, **overrides}
    config = PoolConfig(**pool)
    groups = sized_groups(model.config, config, num_requests=len(PROMPT_LENS),
                          max_step_tokens=MAX_STEP_TOKENS) if grouped else []
    return ServiceConfig(pool=config, max_step_tokens=MAX_STEP_TOKENS, nwor=nwor, groups=groups)


def assert_acceptance(stats: RunStats, rate: object) -> None:
    """What an oracle drafter at ``rate`` (None: no drafts) must show in a run's figures."""
    if rate == 1.0:
        assert stats.proposed_drafts > 0 and stats.acceptance_rate == 1.0
    elif rate == 0.0:
        assert stats.proposed_drafts > 0 and stats.accepted_drafts == 0
    elif rate == 0.5:
        assert 0.1 < stats.acceptance_rate < 0.8
