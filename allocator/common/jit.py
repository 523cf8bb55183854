"""numba's compiler for the hot loops of the manager and the service. Each compiled loop has a
numpy reference that states what it computes (tests compare the two); where numba is missing,
the references run.

Compiled code is cached on disk, so only the first process on a machine pays the compile. numba
keys that cache on the compiled function's own file: a constant or a compiled helper it takes
from another module (the step's error codes, its slack rule) is baked in, and changing only that
module leaves the old code cached. Delete the ``*.nbi`` / ``*.nbc`` files after such a change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

try:
    import numba
except ImportError:  # the references run instead
    numba = None


def jit(function: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``function`` compiled (``options`` go to ``numba.njit``), its code cached on disk."""
    try:
        return numba.njit(cache=True, nogil=True, **options)(function)
    except RuntimeError:  # no writable cache directory: compile in every process
        return numba.njit(nogil=True, **options)(function)


def views(values: np.ndarray, sizes: Iterable[int]) -> list[np.ndarray]:
    """``values`` cut into consecutive views of ``sizes`` values each, then one of the rest: how
    a caller takes apart one array that stands for several (a compiled loop's result, where
    numba converts each array it returns, most of a microsecond apiece; a message's packed
    columns). A view costs a fraction of a copy."""
    out, end = [], 0
    for size in sizes:
        start, end = end, end + size
        out.append(values[start:end])
    out.append(values[end:])
    return out
