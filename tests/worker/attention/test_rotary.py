"""The rotary embedding and staging in one launch: the reference is transformers' own
`apply_rotary_pos_emb` and copies; the kernel (Triton's interpreter on CPU, compiled on a GPU)
equals it; an attention module pointed at the fused forward gives its own forward's output and
staging rows, for Llama, Qwen2 (biased projections) and Mistral (a sliding window), and falls
back to its own forward for every call the kernels do not take.

The interpreter rounds float32 to bfloat16 by truncation, where a GPU rounds to nearest: on CPU
the half-precision cases agree to a few steps of their dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fused_forwards import DTYPES, SMALL
from pool_steps import random_step
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from worker.attention.hook import PoolStep
from worker.attention.rotary import (
    RotaryError,
    fuse_attention_modules,
    fused_attention,
    kernel_takes,
    rotate_and_stage,
    rotate_and_stage_reference,
)
from worker.model import random_model

FAMILIES = {"llama": LlamaConfig(**SMALL), "qwen2": Qwen2Config(**SMALL),
            "mistral": MistralConfig(**SMALL, sliding_window=8)}
# How far a case may differ, relative to the values rotated (a sum may cancel): float32 by one
# product's rounding (contraction into a fused multiply-add), the half types by the
# interpreter's truncating casts, three a value.
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}


def _assert_rotated_alike(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    """``|got - want|`` within the dtype's tolerance of ``scale``, the row's largest input."""
    error = (got.float() - want.float()).abs()
    assert bool((error <= TOLERANCE[got.dtype] * scale).all()), float(error.max())


def _rotary_inputs(n: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
                   seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(n, h, dim, generator=gen).to(dtype)
                         for h in (q_heads, kv_heads, kv_heads))
    angles = torch.rand(n, dim // 2, generator=gen) * 50
    emb = torch.cat([angles, angles], dim=-1)
    return query, key, value, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_reference_is_transformers_rotary_and_the_staging_copies(dtype: torch.dtype) -> None:
    query, key, value, cos, sin = _rotary_inputs(5, 4, 2, 16, dtype)
    staged_k, staged_v = torch.empty_like(key), torch.empty_like(value)
    rotated = rotate_and_stage_reference(query, key, value, cos, sin, staged_k, staged_v)
    # transformers' layout: [batch, heads, tokens, dim], cos / sin [batch, tokens, dim].
    want_q, want_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                          cos[None], sin[None])
    assert torch.equal(rotated, want_q[0].transpose(0, 1))
    assert torch.equal(staged_k, want_k[0].transpose(0, 1)) and torch.equal(staged_v, value)


@pytest.mark.parametrize(("n", "q_heads", "kv_heads", "dim"), [
    (1, 1, 1, 8), (7, 4, 2, 16), (3, 32, 8, 64), (2, 8, 8, 128), (4, 6, 3, 80)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_in_the_interpreter_matches_the_reference(n: int, q_heads: int,
                                                             kv_heads: int, dim: int,
                                                             dtype: torch.dtype) -> None:
    query, key, value, cos, sin = _rotary_inputs(n, q_heads, kv_heads, dim, dtype, seed=dim)
    want_k, want_v = torch.empty_like(key), torch.empty_like(value)
    want = rotate_and_stage_reference(query, key, value, cos, sin, want_k, want_v)
    # Staging rows are strided views of a larger buffer, as a layer's are.
    staging = torch.full((2, n + 3, kv_heads, dim), float("nan"), dtype=dtype)
    got = rotate_and_stage(query, key, value, cos, sin, staging[0, :n], staging[1, :n])
    assert got.shape == want.shape and got.dtype == dtype
    _assert_rotated_alike(got, want, query.float().abs().amax(-1, keepdim=True))
    _assert_rotated_alike(staging[0, :n], want_k, key.float().abs().amax(-1, keepdim=True))
    assert torch.equal(staging[1, :n], want_v)
    assert staging[:, n:].isnan().all()  # nothing written past the step's tokens


def test_input_the_kernel_does_not_take_is_refused_by_name() -> None:
    query, key, value, cos, sin = _rotary_inputs(3, 4, 2, 16, torch.float32)
    k, v = torch.empty_like(key), torch.empty_like(value)
    with pytest.raises(RotaryError, match=r"key: .* must be"):
        rotate_and_stage(query, key[:2], value, cos, sin, k, v)
    with pytest.raises(RotaryError, match=r"cos: .* must be"):
        rotate_and_stage(query, key, value, cos[:, :8], sin, k, v)
    q15, k15 = torch.zeros(3, 4, 15), torch.zeros(3, 2, 15)
    with pytest.raises(RotaryError, match="even head sizes"):
        rotate_and_stage(q15, k15, k15, torch.zeros(3, 15), torch.zeros(3, 15),
                         torch.empty_like(k15), torch.empty_like(k15))
    with pytest.raises(RotaryError, match="staged_k"):
        rotate_and_stage(query, key, value, cos, sin, k[:2], v)
    assert not kernel_takes(query, cos)  # CPU: the module's own forward


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
    step = PoolStep(kv, staging, rs.layout)
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
    with torch.inference_mode():
        want, _ = type(module).forward(module, hidden, embeddings, None, kvalloc_step=step)
        want_staging = step.staging[0].clone()  # layer 0's: the module's
        step.staging.fill_(float("nan"))
        got = fused_attention(module, hidden, embeddings, step)
    n = step.num_tokens
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 0.05, torch.float16: 0.01}[dtype]
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(step.staging[0, :, :n], want_staging[:, :n], atol=tolerance,
                               rtol=tolerance)
    assert step.staging[0, :, n:].isnan().all() and step.staging[1].isnan().all()


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
    moved = PoolStep(step.kv.to(cuda_device), step.staging.to(cuda_device),
                     _to(step.layout, cuda_device))
    hidden = hidden.to(cuda_device)
    embeddings = tuple(e.to(cuda_device) for e in embeddings)
    assert kernel_takes(hidden.new_empty(1, 16), embeddings[0])
    with torch.inference_mode():
        want, _ = type(module).forward(module, hidden, embeddings, None, kvalloc_step=moved)
        moved.staging.fill_(float("nan"))
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
