"""What the kernels' launches share: powers of two for block sizes, the first question of every
dispatch rule, and a kernel run in Triton's interpreter for CPU tensors."""

from __future__ import annotations

import pytest
import torch
from kvalloc.worker.kernels.helpers import floor_pow2, kernel_for, kernel_may_take, pow2


@pytest.mark.parametrize(("n", "up", "down"), [(1, 1, 1), (2, 2, 2), (3, 4, 2), (64, 64, 64),
                                               (65, 128, 64), (100, 128, 64)])
def test_powers_of_two_round_up_and_down(n: int, up: int, down: int) -> None:
    assert (pow2(n), floor_pow2(n)) == (up, down)


def test_no_lanes_round_up_to_one() -> None:
    assert pow2(0) == 1


def test_cpu_tensors_and_other_dtypes_stay_with_the_reference() -> None:
    assert not kernel_may_take(torch.ones(2))
    assert not kernel_may_take(torch.ones(2, dtype=torch.float64))


def test_a_cpu_tensor_gets_the_kernel_in_the_interpreter_once() -> None:
    pytest.importorskip("triton")
    from kvalloc.worker.kernels import rms_norm
    from triton.runtime.interpreter import InterpretedFunction

    kernel = kernel_for(rms_norm.rms_norm_jit, torch.ones(1))
    assert isinstance(kernel, InterpretedFunction) and kernel.fn is rms_norm.rms_norm_jit.fn
    assert kernel_for(rms_norm.rms_norm_jit, torch.ones(1)) is kernel
