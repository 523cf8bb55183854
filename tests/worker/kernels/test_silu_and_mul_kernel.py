"""The SiLU-and-multiply kernel (Triton's interpreter on CPU, compiled on a GPU) equals its
reference, `worker.mlp.gated_mlp.silu_and_mul`, to ``exp``'s last bits, and refuses by name
what it does not take.

The interpreter rounds a float32 to bfloat16 by truncation where a GPU rounds to nearest, so on
CPU bfloat16 agrees to a step or two."""

from __future__ import annotations

import pytest
import torch
from float_steps import steps_apart
from fused_forwards import DTYPES
from kvalloc.worker.errors import GatedMlpError
from kvalloc.worker.mlp.gated_mlp import silu_and_mul, silu_and_mul_triton


@pytest.mark.parametrize("width", [1, 100, 1024, 3000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_in_the_interpreter_matches_the_reference(width: int,
                                                            dtype: torch.dtype) -> None:
    gate_up = (torch.randn(1, 7, 2 * width, generator=torch.Generator().manual_seed(width))
               * 4).to(dtype)
    want, got = silu_and_mul(gate_up), silu_and_mul_triton(gate_up)
    assert got.shape == want.shape == (1, 7, width) and got.dtype == dtype
    # float32: exp's last bits; float16: those, through two roundings; bfloat16: the
    # interpreter's truncating cast too, twice.
    allowed = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 3}[dtype]
    assert int(steps_apart(got, want).max()) <= allowed


def test_rows_of_any_stride_and_none_at_all() -> None:
    wide = torch.randn(6, 2 * 64 + 10)
    strided = wide[:, 10:]  # rows that do not start where a contiguous tensor's would
    assert torch.allclose(silu_and_mul_triton(strided), silu_and_mul(strided), rtol=1e-6,
                          atol=1e-6)
    assert silu_and_mul_triton(torch.empty(0, 3, 8)).shape == (0, 3, 4)


@pytest.mark.parametrize(("gate_up", "message"), [
    (torch.ones(2, 7), "gate_up: 7 columns do not split"),
    (torch.ones(2, 8, dtype=torch.float64), "dtype: the kernel takes"),
    (torch.ones(2, 8, dtype=torch.int32), "dtype: the kernel takes"),
])
def test_input_the_kernel_does_not_take_is_refused_by_name(gate_up: torch.Tensor,
                                                           message: str) -> None:
    with pytest.raises(GatedMlpError, match=message):
        silu_and_mul_triton(gate_up)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [128, 8192, 14336])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_kernel_matches_the_reference_on_gpu(cuda_device: str, width: int,
                                                         dtype: torch.dtype) -> None:
    gate_up = (torch.randn(256, 2 * width, device=cuda_device) * 4).to(dtype)
    want, got = silu_and_mul(gate_up), silu_and_mul_triton(gate_up)
    apart = steps_apart(got, want)
    if dtype == torch.float32:
        # The compiled exp and division are the GPU's approximate ones (a few float32 steps
        # each, and the product with up may double them: up to 15 steps were seen), and exp
        # is exp2 of x * log2(e) rounded to float32, which alone moves exp, and silu(x) ~
        # x * exp(x) for negative x, by up to |x| * 2^-24 relative. A wrong formula or a
        # rounding in the wrong place is off by far more than these bounds.
        gate = gate_up[:, :width]
        relative = (got - want).abs() / want.abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool((relative <= 2.0**-17 + gate.abs() * 2.0**-23).all())
        return
    # exp's last bits may move the rounded activation a step, and the product with it.
    assert int(apart.max()) <= 2
    assert float((apart > 0).float().mean()) < 0.01
