"""RMSNorm in one launch: the reference is transformers' own arithmetic, the kernel (Triton's
interpreter on CPU, compiled on a GPU) equals it to the float32 sum's order, and a model's
switch to it touches only the classes it computes and only the calls it takes.

The interpreter rounds a float32 to bfloat16 by truncation where a GPU rounds to nearest, so on
CPU bfloat16 rows agree to three bfloat16 steps; on a GPU all but a few elements in a thousand
are equal."""

from __future__ import annotations

import pytest
import torch
from cuda_checks import replayed
from float_steps import steps_apart
from fused_forwards import DTYPES, FAMILIES, twin_models
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from worker.norm.rms_norm import (
    RmsNormError,
    fuse_rms_norms,
    kernel_takes,
    rms_norm,
    rms_norm_triton,
)


def _norm(cls: type, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    module = cls(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(hidden) * 2)
    return module


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_reference_is_each_familys_own_norm_bit_for_bit(cls: type,
                                                            dtype: torch.dtype) -> None:
    module = _norm(cls, 96, dtype)
    x = (torch.randn(3, 5, 96) * 4).to(dtype)
    assert torch.equal(rms_norm(x, module.weight, module.variance_epsilon), module(x))


@pytest.mark.parametrize("hidden", [1, 64, 100, 2048])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_in_the_interpreter_matches_the_reference(hidden: int,
                                                            dtype: torch.dtype) -> None:
    module = _norm(LlamaRMSNorm, hidden, dtype, seed=hidden)
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


def test_the_kernel_takes_only_cuda_rows_of_a_supported_width_and_dtype() -> None:
    assert not kernel_takes(torch.ones(2, 64), torch.ones(64))  # CPU: the module's forward
    assert not kernel_takes(torch.ones(2, 64, dtype=torch.float64), torch.ones(64))


@pytest.mark.parametrize("config", FAMILIES, ids=lambda c: c.model_type)
def test_a_model_switches_every_norm_once_and_keeps_its_output_on_cpu(config: object) -> None:
    model, plain = twin_models(config)
    ids = torch.randint(0, 96, (1, 12))
    # Two norms a layer and the final one.
    assert fuse_rms_norms(model) == 2 * 2 + 1
    assert fuse_rms_norms(model) == 0
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_a_norm_of_another_arithmetic_is_left_alone() -> None:
    class ScaledRMSNorm(torch.nn.Module):  # a Gemma-style 1 + weight, say
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (1 + self.weight) * x

    model = torch.nn.Sequential(ScaledRMSNorm(), LlamaRMSNorm(8))
    assert fuse_rms_norms(model) == 1
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [64, 2048, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_kernel_matches_the_reference_on_gpu(cuda_device: str, hidden: int,
                                                         dtype: torch.dtype) -> None:
    module = _norm(LlamaRMSNorm, hidden, dtype).to(cuda_device)
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


@pytest.mark.gpu
def test_a_fused_norm_replays_in_a_cuda_graph(cuda_device: str) -> None:
    module = _norm(LlamaRMSNorm, 2048, torch.bfloat16).to(cuda_device)
    fuse_rms_norms(module)
    static, fresh = (torch.randn(64, 2048, device=cuda_device).to(torch.bfloat16)
                     for _ in range(2))
    out = replayed(module, static, fresh)
    assert torch.equal(out, rms_norm_triton(fresh, module.weight, module.variance_epsilon))
    assert int(steps_apart(out, type(module).forward(module, fresh)).max()) <= 1
