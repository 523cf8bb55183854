"""How far apart two float tensors are in representable steps: the measure the fused kernels'
tests bound their difference from transformers' arithmetic by."""

from __future__ import annotations

import torch

_INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b, elementwise (of one
    sign, floats order as their bits do; a sign flip reads as a huge distance)."""
    assert a.dtype == b.dtype
    return (a.view(_INTS[a.dtype]).to(torch.int64) - b.view(_INTS[b.dtype]).to(torch.int64)).abs()
