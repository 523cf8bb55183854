"""The compiled step (numba) is not built yet: the manager runs the numpy step."""

from __future__ import annotations


def available() -> bool:
    return False
