"""RMSNorm in one launch: the reference is transformers' own arithmetic, the dispatch rule takes
only CUDA rows, and a model's switch to the kernel touches only the classes it computes and only
the calls it takes (the kernel against the reference: tests/worker/kernels)."""

from __future__ import annotations

import pytest
import torch
from cuda_checks import replayed
from float_steps import steps_apart
from fused_forwards import DTYPES, FAMILIES, rms_norm_module, twin_models
from kvalloc.worker.norm.rms_norm import (
    fuse_rms_norms,
    kernel_takes,
    rms_norm,
    rms_norm_triton,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_reference_is_each_familys_own_norm_bit_for_bit(cls: type,
                                                            dtype: torch.dtype) -> None:
    module = rms_norm_module(cls, 96, dtype)
    x = (torch.randn(3, 5, 96) * 4).to(dtype)
    assert torch.equal(rms_norm(x, module.weight, module.variance_epsilon), module(x))


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
def test_a_fused_norm_replays_in_a_cuda_graph(cuda_device: str) -> None:
    module = rms_norm_module(LlamaRMSNorm, 2048, torch.bfloat16).to(cuda_device)
    fuse_rms_norms(module)
    static, fresh = (torch.randn(64, 2048, device=cuda_device).to(torch.bfloat16)
                     for _ in range(2))
    out = replayed(module, static, fresh)
    assert torch.equal(out, rms_norm_triton(fresh, module.weight, module.variance_epsilon))
    assert int(steps_apart(out, type(module).forward(module, fresh)).max()) <= 1
