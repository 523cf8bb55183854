"""``needs_triton_interpreter``: the mark of the tests that run a Triton kernel in Triton's
interpreter on CPU and compare it bit for bit with the torch path. torch pins its own Triton, so
whichever release it brought is the one tested; a release older than ``TRITON_OLDEST_CHECKED``
was never checked against these tests, and they skip there with a reason rather than fail.

A module of its own rather than part of a conftest: tests import it by name, and a name that
several folders' conftest files share would import whichever was loaded last.
"""

from __future__ import annotations

import re
from importlib import metadata

import pytest

TRITON_OLDEST_CHECKED = (3, 6)


def triton_interpreter_gap(oldest_checked: tuple[int, int] = TRITON_OLDEST_CHECKED) -> str | None:
    """Why the Triton-interpreter tests cannot run here, or None when they can."""
    try:
        version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "triton is not installed"
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if release < oldest_checked:
        oldest = ".".join(map(str, oldest_checked))
        return f"triton {version}: its interpreter predates {oldest}, the oldest checked"
    return None


needs_triton_interpreter = pytest.mark.skipif(triton_interpreter_gap() is not None,
                                              reason=triton_interpreter_gap() or "")

# A kernel whose loop bounds are loaded values (the pool attention's device-side histories)
# needs 3.7's interpreter: 3.6's cannot turn a loaded scalar into a range bound under numpy 2.
LOADED_BOUNDS_OLDEST = (3, 7)
needs_triton_interpreter_with_loaded_bounds = pytest.mark.skipif(
    triton_interpreter_gap(LOADED_BOUNDS_OLDEST) is not None,
    reason=triton_interpreter_gap(LOADED_BOUNDS_OLDEST) or "")
