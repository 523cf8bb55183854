"""numba's compiler for the hot loops of the manager and the service. Each compiled loop has a
numpy reference that states what it computes (tests compare the two); where numba is missing,
the references run.

Compiled code is cached on disk, so only the first process on a machine pays the compile. numba
keys that cache on the compiled function's own file: a constant or a compiled helper it takes
from another module (the step's error codes, its slack rule) is baked in, and changing only that
module leaves the old code cached. Delete the ``*.nbi`` / ``*.nbc`` files after such a change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
