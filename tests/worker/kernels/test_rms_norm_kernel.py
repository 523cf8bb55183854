"""The RMSNorm kernel (Triton's interpreter on CPU, compiled on a GPU) equals its reference,
`worker.norm.rms_norm.rms_norm`, to the float32 sum's order, and refuses by name what it does
not take.

The interpreter rounds a float32 to bfloat16 by truncation where a GPU rounds to nearest, so on
CPU bfloat16 rows agree to three bfloat16 steps; on a GPU all but a few elements in a thousand
are equal."""

from __future__ import annotations

import pytest
import torch
from float_steps import steps_apart
from fused_forwards import DTYPES, rms_norm_module
from kvalloc.worker.errors import RmsNormError
from kvalloc.worker.norm.rms_norm import kernel_takes, rms_norm, rms_norm_triton
from transformers.models.llama.modeling_llama import LlamaRMSNorm


@pytest.mark.parametrize("hidden", [1, 64, 100, 2048])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_in_the_interpreter_matches_the_reference(hidden: int,
                                                            dtype: torch.dtype) -> None:
    module = rms_norm_module(LlamaRMSNorm, hidden, dtype, seed=hidden)
    x = (torch.randn(1, 9, hidden) * 3).to(dtype)
    want = rms_norm(x, module.weight, 1e-5)
    got = rms_norm_triton(x, module.weight, 1e-5)
    assert got.shape == want.shape and got.dtype == want.dtype
    # float32: the sum's order over up to 2048 squares and rsqrt; float16: those, through two
    # roundings; bfloat16: the interpreter's truncating cast too, twice.
    allowed = {torch.float32: 32, torch.float16: 2, torch.bfloat16: 3}[dtype]
    assert int(steps_apart(got, want).max()) <= allowed


def test_rows_of_any_stride_and_none_at_all() -> None:
    weight = torch.randn(64)
    wide = torch.randn(7, 128)
    strided = wide[:, ::2]  # every other column: not contiguous
    assert torch.allclose(rms_norm_triton(strided, weight, 1e-6),
                          rms_norm(strided, weight, 1e-6), rtol=1e-6, atol=1e-6)
    empty = torch.empty(0, 5, 64)
    assert rms_norm_triton(empty, weight, 1e-6).shape == (0, 5, 64)


def test_a_float32_weight_over_bfloat16_rows_promotes_like_torch() -> None:
    weight = torch.randn(64)
    x = torch.randn(4, 64).to(torch.bfloat16)
    want = rms_norm(x, weight, 1e-6)
    got = rms_norm_triton(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    # The rows are rounded to bfloat16 before the product in both.
    assert torch.allclose(got, want, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize(("weight", "x", "message"), [
    (torch.ones(32), torch.ones(2, 64), "weight: a norm over 64 features"),
    (torch.ones(2, 32), torch.ones(2, 32), "weight: a norm over 32 features"),
    (torch.ones(64), torch.ones(2, 64, dtype=torch.int32), "dtype: the kernel takes"),
    (torch.ones(64, dtype=torch.float64), torch.ones(2, 64), "dtype: the kernel takes"),
])
def test_input_the_kernel_does_not_take_is_refused_by_name(weight: torch.Tensor,
                                                           x: torch.Tensor, message: str) -> None:
    with pytest.raises(RmsNormError, match=message):
        rms_norm_triton(x, weight, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [64, 2048, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_kernel_matches_the_reference_on_gpu(cuda_device: str, hidden: int,
                                                         dtype: torch.dtype) -> None:
    module = rms_norm_module(LlamaRMSNorm, hidden, dtype).to(cuda_device)
    x = (torch.randn(1, 256, hidden, device=cuda_device) * 3).to(dtype)
    assert kernel_takes(x, module.weight)
    want = module(x)
    got = rms_norm_triton(x, module.weight, module.variance_epsilon)
    apart = steps_apart(got, want)
    # Rounded to nearest as torch does: only the sum's order and rsqrt's last bit differ, which
    # now and then moves a normalised element one step; the product with the weight can turn
    # that into two steps of its own binade.
    assert int(apart.max()) <= (32 if dtype == torch.float32 else 2)
    if dtype != torch.float32:
        assert float((apart > 0).float().mean()) < 0.01
