"""What the fused forwards' tests share: the float dtypes every kernel takes, the tiny model
shape their modules and models are built at, the families a model switch is checked on, a
model with a plain twin to compare it with, and an RMSNorm module of random weights."""

from __future__ import annotations

from typing import Any

import torch
from kvalloc.worker.model import random_model
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = (LlamaConfig(**SMALL), Qwen2Config(**SMALL), MistralConfig(**SMALL))


def twin_models(config: PretrainedConfig) -> tuple[Any, Any]:
    """Two models of the same random weights on SDPA: one to switch, one to keep as it is."""
    models = tuple(random_model(config, seed=0) for _ in range(2))
    for model in models:
        model.set_attn_implementation("sdpa")
    return models


def rms_norm_module(cls: type, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """An RMSNorm of class ``cls`` over ``hidden`` features, its weight random (from ``seed``,
    which also seeds what the test draws next)."""
    torch.manual_seed(seed)
    module = cls(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(hidden) * 2)
    return module
