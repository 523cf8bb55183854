"""What the worker's kernel launches and dispatch rules share: which tensors a kernel may take,
the kernel a tensor's device runs (compiled for CUDA, Triton's interpreter for CPU), and the
powers of two that block sizes round to.

Imports no Triton at import time: the dispatch rules ask `kernel_may_take` where Triton may be
missing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from kvalloc.allocator.common.triton_support import triton_available

# The dtypes every kernel of the worker computes in (each rounds where transformers rounds).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_may_take(x: torch.Tensor) -> bool:
    """What every kernel's dispatch rule asks first of ``x``: a CUDA tensor of a kernel dtype,
    with Triton installed. Each rule adds the shapes its own kernel takes."""
    return x.is_cuda and triton_available() and x.dtype in KERNEL_DTYPES


def kernel_for(jitted: Any, tensor: torch.Tensor) -> Any:
    """``jitted`` (a ``triton.jit`` function, a kernel or a helper passed as a constexpr) as
    ``tensor``'s device runs it: compiled on CUDA, in Triton's interpreter on the CPU (the
    CPU tests' way to compare a kernel with its reference)."""
    return jitted if tensor.is_cuda else interpreted(jitted.fn)


@cache
def interpreted(fn: Callable[..., Any]) -> Any:
    """The plain function ``fn`` in Triton's interpreter: one wrapper per function."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def pow2(n: int) -> int:
    """The least power of two at least ``n`` (1 for ``n`` <= 1): a block of ``n`` lanes."""
    return 1 << max(n - 1, 0).bit_length()


def floor_pow2(n: int) -> int:
    """The greatest power of two at most ``n`` (>= 1)."""
    return 1 << (n.bit_length() - 1)
