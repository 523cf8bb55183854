"""Whether Triton is installed. The kernels' dispatch rules (the NWOR commit, the worker's
attention and norms) ask this before they import a kernel module, which imports Triton."""

from __future__ import annotations

import importlib.util
from functools import cache


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
