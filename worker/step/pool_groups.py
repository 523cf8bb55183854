"""`PoolGroup`: one group of the attached pool as the worker's step reads and writes it.

A grouped pool (`PoolLayout.groups`, a model mixing full and windowed layers) gives each group
its own KV, staging and block table over some of the model's layers; a row is the same request
in every group. A pool of one group (no ``groups``) is the group of every layer, in order, with
the pool's window: the worker runs both the same way, one group or several.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvalloc.server.client import AttachedPool
from kvalloc.server.contract import wire
from kvalloc.worker.errors import LayoutMismatch


@dataclass(frozen=True)
class PoolGroup:
    """One group: its KV ``[Lg, P, num_blocks, T, H, D]`` and staging ``[Lg, P,
    max_step_tokens, H, D]`` hold the model layers ``layers`` (group layer ``i`` is model layer
    ``layers[i]``), read through its own ``block_table``; ``window`` is the one its blocks are
    given back behind (None: full attention); ``protected`` its cached prefix blocks."""

    kv: torch.Tensor
    staging: torch.Tensor
    block_table: torch.Tensor
    layers: tuple[int, ...]
    window: int | None
    protected: torch.Tensor | None = None

    @property
    def tokens_per_block(self) -> int:
        return self.kv.shape[3]


def pool_groups(pool: AttachedPool, layout: wire.PoolLayout) -> tuple[PoolGroup, ...]:
    """``pool``'s groups in group order; a pool without groups is one group of every layer with
    the layout's window. `LayoutMismatch` naming ``groups`` where the attached groups are not
    the layout's or a group's tensors do not hold its layers."""
    if not layout.groups:
        return (PoolGroup(pool.kv, pool.staging, pool.block_table,
                          tuple(range(layout.num_layers)), layout.window, pool.protected),)
    described = [(list(g.layers), g.window) for g in layout.groups]
    attached = [(list(g.layers or ()), g.window) for g in pool.groups]
    if attached != described:
        raise LayoutMismatch(f"groups: the pool attached groups of (layers, window) {attached}, "
                             f"its layout describes {described}")
    for name, group in zip((g.name for g in layout.groups), pool.groups, strict=True):
        held = {group.kv.shape[0], group.staging.shape[0]}
        if held != {len(group.layers or ())}:
            raise LayoutMismatch(f"groups: group {name} holds layers {list(group.layers or ())} "
                                 f"but its kv and staging hold {sorted(held)} layers")
    return tuple(PoolGroup(g.kv, g.staging, g.block_table, tuple(g.layers or ()), g.window,
                           g.protected) for g in pool.groups)


def layer_places(groups: Sequence[PoolGroup]) -> tuple[tuple[int, int], ...]:
    """Per model layer: ``(its group, its layer in the group)``, for groups whose layers are
    the model's, each once (`groups_mismatch` says where they are not)."""
    places = {layer: (g, at) for g, group in enumerate(groups)
              for at, layer in enumerate(group.layers)}
    return tuple(places[layer] for layer in range(len(places)))


def groups_mismatch(groups: Sequence[wire.GroupLayout],
                    windows: Sequence[int | None]) -> list[str]:
    """Why ``groups`` cannot serve a model whose layer ``i`` reads the last ``windows[i]``
    positions (None: its whole history): a layer in no group or in two, and a layer that reads
    further back than its group keeps (a full-attention layer in a windowed group, or a window
    wider than its group's), which would read blocks given back to other requests."""
    wrong, seen = [], {}
    for group in groups:
        for layer in group.layers:
            if not 0 <= layer < len(windows):
                wrong.append(f"groups: group {group.name} holds layer {layer}, but the model "
                             f"has {len(windows)} layers")
            elif layer in seen:
                wrong.append(f"groups: layer {layer} is in groups {seen[layer]} and "
                             f"{group.name}")
            else:
                seen[layer] = group.name
                wrong += _reach_mismatch(group, layer, windows[layer])
    missing = sorted(set(range(len(windows))) - set(seen))
    if missing:
        wrong.append(f"groups: layers {missing} of the model are in no group")
    return wrong


def reads_further(window: int | None, kept: int | None) -> bool:
    """Whether a layer reading the last ``window`` positions (None: its whole history) reads
    blocks a pool that gives back the blocks behind ``kept`` (None: none) has given back."""
    return kept is not None and (window is None or window > kept)


def _reach_mismatch(group: wire.GroupLayout, layer: int, window: int | None) -> list[str]:
    if not reads_further(window, group.window):
        return []
    reads = "its whole history" if window is None else f"a window of {window}"
    return [f"groups: group {group.name} gives back blocks behind a window of {group.window}, "
            f"but layer {layer} of the model reads {reads}"]
