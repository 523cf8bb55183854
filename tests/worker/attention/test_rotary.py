"""The attention forward with the rotary embedding and staging in one launch: an attention module
pointed at the fused forward gives its own forward's output and staging rows, for Llama, Qwen2
(biased projections) and Mistral (a sliding window), and falls back to its own forward for every
call the kernels do not take (the kernel against its reference: tests/worker/kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fused_forwards import DTYPES, SMALL
from kvalloc.worker.attention.hook import PoolStep
from kvalloc.worker.attention.rotary import (
    fuse_attention_modules,
    fused_attention,
    kernel_takes,
)
from kvalloc.worker.model import random_model
from pool_steps import random_step
from transformers import LlamaConfig, MistralConfig, Qwen2Config

FAMILIES = {"llama": LlamaConfig(**SMALL), "qwen2": Qwen2Config(**SMALL),
            "mistral": MistralConfig(**SMALL, sliding_window=8)}


def _module_step(model: torch.nn.Module, dtype: torch.dtype, seed: int
                 ) -> tuple[torch.nn.Module, PoolStep, torch.Tensor, tuple[torch.Tensor, ...]]:
    """``model``'s first attention module, a random step over a poisoned pool for it, the
    step's hidden states and its rotary embeddings."""
    module = model.model.layers[0].self_attn
    rs = random_step(seed, entries=5, kv_heads=2, group=2, dim=16, tokens_per_block=4,
                     max_history=20, max_query=6, dtype=dtype, device="cpu")
    kv = torch.stack([rs.pool_k, rs.pool_v])[None].expand(2, -1, -1, -1, -1, -1).clone()
    n = rs.layout.num_tokens
    staging = torch.full((2, 2, n + 4, 2, 16), float("nan"), dtype=dtype)
    step = PoolStep.of(kv, staging, rs.layout)
    hidden = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)
    index = torch.arange(n) - rs.layout.query_starts[rs.layout.token_entry]
    positions = (rs.layout.history[rs.layout.token_entry] + index)[None]
    return module, step, hidden, model.model.rotary_emb(hidden, positions)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_fused_attention_module_gives_its_own_forwards_output_and_staging(
        family: str, dtype: torch.dtype) -> None:
    model = random_model(FAMILIES[family], seed=11, dtype=dtype)
    assert fuse_attention_modules(model) == 2  # the merged q/k/v projection, the reference kept
    module, step, hidden, embeddings = _module_step(model, dtype, seed=11)
    staging = step.groups[0].staging
    with torch.inference_mode():
        want, _ = type(module).forward(module, hidden, embeddings, None, kvalloc_step=step)
        want_staging = staging[0].clone()  # layer 0's: the module's
        staging.fill_(float("nan"))
        got = fused_attention(module, hidden, embeddings, step)
    n = step.num_tokens
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 0.05, torch.float16: 0.01}[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(staging[0, :, :n], want_staging[:, :n], atol=tolerance,
                               rtol=tolerance)
    assert staging[0, :, n:].isnan().all() and staging[1].isnan().all()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_switched_model_keeps_its_own_forward_where_the_kernels_do_not_run(
        family: str) -> None:
    """On CPU every call falls back: the switched model's output is the plain one, bit for
    bit, with the pool step and without it."""
    model = random_model(FAMILIES[family], seed=0)
    plain = random_model(FAMILIES[family], seed=0)
    assert fuse_attention_modules(model) == 2 and fuse_attention_modules(model) == 0
    module, step, hidden, embeddings = _module_step(model, torch.float32, seed=3)
    with torch.inference_mode():
        want, _ = type(module).forward(module, hidden, embeddings, None, kvalloc_step=step)
        got, _ = module(hidden, embeddings, None, kvalloc_step=step)
        assert torch.equal(got, want)
        for m in (model, plain):
            m.set_attn_implementation("sdpa")
        ids = torch.randint(0, 96, (1, 12))
        assert torch.equal(model(ids).logits, plain(ids).logits)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_fused_module_matches_its_own_forward_on_gpu(
        cuda_device: str, family: str, dtype: torch.dtype) -> None:
    model = random_model(FAMILIES[family], seed=5, dtype=dtype)
    assert fuse_attention_modules(model) == 2
    module, step, hidden, embeddings = _module_step(model, dtype, seed=5)
    module.to(cuda_device)
    (group,) = step.groups
    moved = PoolStep.of(group.kv.to(cuda_device), group.staging.to(cuda_device),
                        _to(group.layout, cuda_device))
    hidden = hidden.to(cuda_device)
    embeddings = tuple(e.to(cuda_device) for e in embeddings)
    assert kernel_takes(hidden.new_empty(1, 16), embeddings[0])
    with torch.inference_mode():
        want, _ = type(module).forward(module, hidden, embeddings, None, kvalloc_step=moved)
        moved.groups[0].staging.fill_(float("nan"))
        got = fused_attention(module, hidden, embeddings, moved)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 0.05, torch.float16: 0.01}[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def _to(layout: object, device: str) -> object:
    import dataclasses

    return dataclasses.replace(layout, block_table=layout.block_table.to(device),
                               rows=layout.rows.to(device),
                               query_starts=layout.query_starts.to(device),
                               query_lens=layout.query_lens.to(device),
                               history=layout.history.to(device),
                               token_entry=layout.token_entry.to(device))


_ = np  # the pool steps draw with numpy
