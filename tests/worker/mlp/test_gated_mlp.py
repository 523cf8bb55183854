"""A gated MLP in two GEMMs and one launch: the reference is transformers' own arithmetic, the
dispatch rule takes only CUDA inputs of a kernel dtype, the merged projection holds the weights
once and changes no value, and a model's switch touches only the MLPs it computes and only the
calls it takes (the kernel against the reference: tests/worker/kernels)."""

from __future__ import annotations

import pytest
import torch
from cuda_checks import replayed
from fused_forwards import DTYPES, FAMILIES, SMALL, twin_models
from kvalloc.worker.mlp.gated_mlp import (
    fuse_gated_mlps,
    fused_mlp,
    kernel_takes,
    silu_and_mul,
)
from kvalloc.worker.module_forwards import merge_linears
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mistral.modeling_mistral import MistralMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

CONFIGS = {"llama": (LlamaMLP, LlamaConfig), "qwen2": (Qwen2MLP, Qwen2Config),
           "mistral": (MistralMLP, MistralConfig)}


def _mlp(family: str, dtype: torch.dtype, **config: object) -> torch.nn.Module:
    cls, config_cls = CONFIGS[family]
    torch.manual_seed(0)
    return cls(config_cls(**{**SMALL, **config})).to(dtype).eval()


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_reference_is_each_familys_own_mlp_bit_for_bit(family: str,
                                                           dtype: torch.dtype) -> None:
    module = _mlp(family, dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    gate_up = torch.cat([module.gate_proj(x), module.up_proj(x)], dim=-1)
    assert torch.equal(module.down_proj(silu_and_mul(gate_up)), module(x))


def test_only_cuda_inputs_of_a_kernel_dtype_go_to_the_kernel() -> None:
    assert not kernel_takes(torch.ones(2, 64))  # CPU: the module's own forward
    assert not kernel_takes(torch.ones(2, 64, dtype=torch.float64))


@pytest.mark.parametrize("bias", [False, True])
def test_merged_projections_hold_the_weights_once_and_change_no_value(bias: bool) -> None:
    module = _mlp("llama", torch.float32, mlp_bias=bias)
    x = torch.randn(4, 64)
    before, state = module(x), {k: v.clone() for k, v in module.state_dict().items()}
    assert merge_linears(module, ("gate_proj", "up_proj"), "gate_up")
    merged = module.gate_up_weight
    assert module.gate_proj.weight.data_ptr() == merged.data_ptr()
    assert module.up_proj.weight.data_ptr() == merged[128:].data_ptr()
    assert (module.gate_up_bias is not None) == bias
    assert torch.equal(module(x), before)
    after = module.state_dict()
    assert after.keys() == state.keys()  # the merged buffers are not persistent
    assert all(torch.equal(after[k], v) for k, v in state.items())
    with torch.no_grad():
        assert torch.allclose(fused_mlp(module, x), before, rtol=1e-5, atol=1e-6)


def test_projections_that_cannot_merge_are_left_as_they_are() -> None:
    module = _mlp("llama", torch.float32)
    module.up_proj.bias = torch.nn.Parameter(torch.zeros(128))  # a bias on one only
    weight = module.gate_proj.weight
    assert not merge_linears(module, ("gate_proj", "up_proj"), "gate_up")
    assert module.gate_proj.weight is weight and not hasattr(module, "gate_up_weight")
    assert not merge_linears(module, ("gate_proj", "act_fn"), "gate_up")


@pytest.mark.parametrize("config", FAMILIES, ids=lambda c: c.model_type)
def test_a_model_switches_every_mlp_once_and_keeps_its_output_on_cpu(config: object) -> None:
    model, plain = twin_models(config)
    ids = torch.randint(0, 96, (1, 12))
    assert fuse_gated_mlps(model) == 2
    assert fuse_gated_mlps(model) == 0
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_an_mlp_of_another_activation_is_left_alone() -> None:
    model = torch.nn.Sequential(_mlp("llama", torch.float32, hidden_act="gelu"),
                                _mlp("llama", torch.float32))
    assert fuse_gated_mlps(model) == 1
    assert "forward" not in vars(model[0]) and "forward" in vars(model[1])
    assert not hasattr(model[0], "gate_up_weight")


@pytest.mark.gpu
def test_a_fused_mlp_replays_in_a_cuda_graph_and_matches_its_own_forward(
        cuda_device: str) -> None:
    module = _mlp("llama", torch.bfloat16, hidden_size=2048, intermediate_size=8192)
    module = module.to(cuda_device)
    assert fuse_gated_mlps(module) == 1
    static, fresh = (torch.randn(256, 2048, device=cuda_device).to(torch.bfloat16)
                     for _ in range(2))
    out = replayed(module, static, fresh)
    # One GEMM for gate and up may sum in another order than two: a bfloat16 step or two.
    torch.testing.assert_close(out, type(module).forward(module, fresh), rtol=2 ** -6,
                               atol=2 ** -6)
