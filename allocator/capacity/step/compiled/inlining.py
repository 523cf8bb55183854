"""How the compiled step's functions are compiled: each is inlined into `driver._step`, so the
step is one native routine with one compiled signature.

Those called with constants (`loops.fail`'s codes, ``first_marked``'s value) or with arrays of
two types (``copy_into``) must be: compiled on their own, they would be compiled again for each.
The rest are too: the step runs a few per cent faster so (benchmarks/bench_step.py) and compiles
no slower. Inlined, a tuple argument that stays alive across a loop costs a reference count taken
and dropped per array in it: so each function takes the arrays it uses from its tuples at its
top, and the helpers called per row take arrays, not `State`.

Invariants: without numba, `inlined` returns the function as it is, so every module here still
imports (and `driver.available` says the step cannot run compiled).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvalloc.allocator.common.jit import jit, numba

Function = TypeVar("Function", bound=Callable[..., Any])


def inlined(function: Function) -> Function:
    """``function`` compiled into each compiled function that calls it (numba's
    ``inline="always"``); ``function`` itself where numba is missing."""
    return function if numba is None else jit(function, inline="always")
