"""Switching a model's modules of some classes to a forward of kvalloc's, per instance: how the
worker's fused kernels (`worker.norm`, `worker.attention.rotary`, `worker.mlp`) take over
transformers' modules without changing their classes, so every other model of the process keeps
them; and merging linear projections that read the same input into one GEMM."""

from __future__ import annotations

import types
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch


def switch_forwards(model: Any, class_names: Collection[str], forward: Callable[..., Any], *,
                    prepare: Callable[[Any], bool] | None = None) -> int:
    """Bind ``forward`` as the ``forward`` of every module of ``model`` whose class is named in
    ``class_names``, that has no forward of its own yet and that ``prepare`` (if given) made
    ready for it (False: the module keeps its own); returns how many it switched (none the
    second time)."""
    switched = 0
    for module in model.modules():
        if type(module).__name__ not in class_names or "forward" in vars(module):
            continue
        if prepare is None or prepare(module):
            module.forward = types.MethodType(forward, module)
            switched += 1
    return switched


def merge_linears(module: torch.nn.Module, names: Sequence[str], merged: str) -> bool:
    """One projection for the linear submodules ``names`` of ``module``, which read the same
    input: their weights (and biases, where every one has one) concatenated into the buffers
    ``{merged}_weight`` and ``{merged}_bias`` (None without biases), and each linear's
    parameters pointed at its rows of them, so the weights are held once and the module's own
    forward reads the same values. The buffers are not persistent (state dicts are unchanged)
    and move with the module: a later ``.to()`` loses the sharing, not the values. False, and
    nothing changed, where they cannot be merged (not all ``nn.Linear``, unequal input widths,
    dtypes or devices, biases on some only)."""
    linears = [getattr(module, name, None) for name in names]
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return False
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears]
    first = weights[0]
    if any(w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device
           for w in weights) or len({b is None for b in biases}) != 1:
        return False
    weight = torch.cat([w.detach() for w in weights])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.weight.shape[0])
        linear.weight = torch.nn.Parameter(weight[rows], requires_grad=linear.weight.requires_grad)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[rows], requires_grad=linear.bias.requires_grad)
        start = rows.stop
    module.register_buffer(f"{merged}_weight", weight, persistent=False)
    module.register_buffer(f"{merged}_bias", bias, persistent=False)
    return True
