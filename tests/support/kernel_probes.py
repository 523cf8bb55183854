"""Kernels the ahead-of-time compile check (`tests/test_kernels_compile.py`) is itself checked
with. No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr``
annotations as objects, not strings."""

import triton.language as tl


def _doubled(x):  # a plain function: the interpreter calls it, a compiler cannot
    return x * 2


def calls_a_plain_function(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _doubled(tl.load(x_ptr + i)))
