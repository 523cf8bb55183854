"""Switching a model's modules of some classes to a forward of kvalloc's, per instance: how the
worker's fused kernels (`worker.norm`, `worker.attention.rotary`) take over transformers'
modules without changing their classes, so every other model of the process keeps them."""

from __future__ import annotations

import types
from collections.abc import Callable, Collection
from typing import Any


def switch_forwards(model: Any, class_names: Collection[str],
                    forward: Callable[..., Any]) -> int:
    """Bind ``forward`` as the ``forward`` of every module of ``model`` whose class is named in
    ``class_names`` and that has no forward of its own yet; returns how many it switched (none
    the second time)."""
    switched = 0
    for module in model.modules():
        if type(module).__name__ in class_names and "forward" not in vars(module):
            module.forward = types.MethodType(forward, module)
            switched += 1
    return switched
