"""A gated MLP in two GEMMs and one launch: the reference, the kernel's launch and the model's
switch to it.

transformers' Llama / Qwen2 / Mistral MLP runs ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``:
three GEMMs and two elementwise kernels a layer. `fuse_gated_mlps` merges ``gate_proj`` and
``up_proj`` into one projection (`worker.module_forwards.merge_linears`: one GEMM, and no second
copy of the weights) and points the module at a forward that applies SiLU and the product in one
launch of `worker.kernels.silu_and_mul` on the merged output, for CUDA tensors it takes;
everything else (CPU tensors, another activation, a dtype the kernel does not take) keeps the
module's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvalloc.worker.errors import GatedMlpError
from kvalloc.worker.kernels.helpers import KERNEL_DTYPES, kernel_for, kernel_may_take
from kvalloc.worker.module_forwards import merge_linears, switch_forwards

FUSED_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})
BLOCK = 1024  # columns a program writes


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [..., 2I]`` (the gate's columns, then the up projection's) to ``silu(gate) *
    up`` ``[..., I]``: transformers' two kernels, each rounding to the input's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether a switched MLP's input ``x`` goes to `fused_mlp`."""
    return kernel_may_take(x)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` in one launch (Triton's interpreter for CPU tensors)."""
    if gate_up.shape[-1] % 2:
        raise GatedMlpError(f"gate_up: {gate_up.shape[-1]} columns do not split into a gate "
                            f"and an up half")
    if gate_up.dtype not in KERNEL_DTYPES:
        raise GatedMlpError(f"dtype: the kernel takes float32, bfloat16 and float16, got "
                            f"{gate_up.dtype}")
    from kvalloc.worker.kernels import silu_and_mul as kernels

    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows.numel():
        kernel = kernel_for(kernels.silu_and_mul_jit, gate_up)
        kernel[(rows.shape[0], -(-width // BLOCK))](rows, out, rows.stride(0), out.stride(0),
                                                     width, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], width)


def fuse_gated_mlps(model: torch.nn.Module) -> int:
    """Merge the gate and up projections of every Llama / Qwen2 / Mistral MLP of ``model`` with
    a SiLU activation and point it at `fused_mlp` (for the calls it takes); returns how many it
    switched. Calling it again switches none."""
    return switch_forwards(model, FUSED_CLASSES, _forward, prepare=_merge)


def fused_mlp(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's output: the merged projection, one SiLU-and-multiply launch, ``down_proj``."""
    gate_up = F.linear(x, module.gate_up_weight, module.gate_up_bias)
    return module.down_proj(silu_and_mul_triton(gate_up))


def _merge(module: torch.nn.Module) -> bool:
    return (getattr(module.config, "hidden_act", None) == "silu"
            and merge_linears(module, ("gate_proj", "up_proj"), "gate_up"))


def _forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not module.training and kernel_takes(x):
        return fused_mlp(module, x)
    return type(module).forward(module, x)
