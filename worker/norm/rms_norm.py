"""RMSNorm, one launch a call: the reference, the kernel's launch and the model's switch to it.

transformers' Llama / Qwen2 / Mistral RMSNorm runs about eight kernels a call (a float32 copy,
square, mean, add, rsqrt, two multiplies, a cast back), two calls a layer. Inside a captured
decode step each is a launch of a few microseconds over a few hundred tokens: on a ~1B shape
they add up to a large share of the forward without attention. `fuse_rms_norms` points those
modules at one launch of `worker.kernels.rms_norm` for CUDA tensors; everything else (CPU tensors, a
dtype or width the kernel does not take) keeps the module's own forward.
"""

from __future__ import annotations

import torch
from kvalloc.worker.errors import RmsNormError
from kvalloc.worker.kernels.helpers import KERNEL_DTYPES, kernel_for, kernel_may_take, pow2
from kvalloc.worker.module_forwards import switch_forwards

# The classes whose forward is exactly `rms_norm`'s arithmetic (Gemma's ``1 + weight``, for
# one, is not).
FUSED_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})
MAX_HIDDEN = 16384


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: ``weight * (x / rms(x)).to(x.dtype)``, the mean in float32."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x``'s norm goes to the kernel rather than the module's own forward."""
    return (kernel_may_take(x) and weight.dtype in KERNEL_DTYPES and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] <= MAX_HIDDEN)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` in one launch (Triton's interpreter for CPU tensors): same result to the
    float32 sum's order and ``rsqrt``'s last bit."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise RmsNormError(f"weight: a norm over {x.shape[-1]} features needs a weight of that "
                           f"length, got shape {tuple(weight.shape)}")
    if x.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        raise RmsNormError(f"dtype: the kernel takes float32, bfloat16 and float16, got "
                           f"{x.dtype} rows and a {weight.dtype} weight")
    if x.device != weight.device:
        raise RmsNormError(f"device: rows on {x.device}, weight on {weight.device}")
    from kvalloc.worker.kernels import rms_norm as kernels

    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if rows.shape[0]:
        block = pow2(hidden)
        kernel = kernel_for(kernels.rms_norm_jit, x)
        kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0),
                                 1.0 / hidden, float(eps), HIDDEN=hidden, BLOCK=block,
                                 num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return out.view(*x.shape[:-1], hidden)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Point every RMSNorm of ``model`` whose class computes `rms_norm` at the kernel (for the
    calls it takes); returns how many it switched. Calling it again switches nothing more."""
    return switch_forwards(model, FUSED_CLASSES, _fused_forward)


def _fused_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if kernel_takes(hidden_states, module.weight):
        return rms_norm_triton(hidden_states, module.weight, module.variance_epsilon)
    return type(module).forward(module, hidden_states)
