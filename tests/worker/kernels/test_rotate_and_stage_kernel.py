"""The rotary embedding and staging in one launch: the reference is transformers' own
`apply_rotary_pos_emb` and copies; the kernel (Triton's interpreter on CPU, compiled on a GPU)
equals it, and refuses by name what it does not take.

The interpreter rounds float32 to bfloat16 by truncation, where a GPU rounds to nearest: on CPU
the half-precision cases agree to a few steps of their dtype."""

from __future__ import annotations

import pytest
import torch
from fused_forwards import DTYPES
from kvalloc.worker.attention.rotary import (
    kernel_takes,
    rotate_and_stage,
    rotate_and_stage_reference,
)
from kvalloc.worker.errors import RotaryError
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

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
