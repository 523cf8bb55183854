"""A grouped pool's look-alike for the worker tests, until a service serves grouped pools: two
services of the same model called in lockstep, each standing in for one group.

``full`` is a pool of every layer with no window, ``windowed`` the same pool giving back the
blocks behind ``window`` (`PoolConfig.window`): both get every call, make the same decisions
(the tests give them blocks enough that neither refuses what the other serves) and keep their
own blocks and block tables, so one row is the same request in both, as in a grouped pool. The
client the worker drives is ``full``'s, its pool replaced by a grouped `AttachedPool` whose group
``full`` is ``full``'s pool at the full-attention layers and whose group ``window<W>`` is
``windowed``'s pool at the sliding layers (views of each pool's own layers, in place), with
``PoolLayout.groups`` saying so. Each service commits its whole staging buffer: a layer's
staging rows that its group does not hold are never written by the worker, so each pool holds
poison (NaN, the caller's) at the layers of the other group, and a layer read through the wrong
group's pool or table gives NaN.
"""

from __future__ import annotations

import msgspec
import numpy as np
from kvalloc.server.client import AttachedPool, Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepResult

# The reply's columns both services must agree on: the same decisions, rows and positions.
FIELDS = ("admitted", "cached_tokens")
SCHEDULED = ("handles", "rows", "token_offsets", "num_tokens", "num_drafts", "start_positions")
REFUSED = ("kinds", "indices")


def lockstep_groups(full: Client, windowed: Client, windows: tuple[int | None, ...]) -> Client:
    """``full``, now the client of a grouped pool over both services (see above) for a model
    whose layer ``i`` slides over ``windows[i]`` (None: full attention), every window the
    ``windowed`` pool's; its steps call both services."""
    window = windowed.registration.layout.window
    assert window is not None and full.registration.layout.window is None
    parts = [(full, "full", None, [i for i, w in enumerate(windows) if w is None]),
             (windowed, f"window{window}", window,
              [i for i, w in enumerate(windows) if w is not None])]
    groups, layouts = [], []
    for client, name, group_window, layers in parts:
        pool = client.pool
        # Each group's layers are consecutive here, so its tensors are views of its pool.
        first, last = layers[0], layers[-1] + 1
        assert layers == list(range(first, last))
        groups.append(AttachedPool(pool.kv[first:last], pool.block_table,
                                   pool.staging[first:last], None, pool.protected,
                                   layers=tuple(layers), window=group_window))
        layouts.append(wire.GroupLayout(name=name, layers=layers, window=group_window,
                                        num_blocks=client.registration.layout.num_blocks))
    top = full.pool
    full.pool = AttachedPool(groups[0].kv, groups[0].block_table, groups[0].staging, top.fence,
                             groups[0].protected, groups=groups, writer_fence=top.writer_fence)
    registration = full.registration
    full.registration = msgspec.structs.replace(
        registration, layout=msgspec.structs.replace(registration.layout, groups=layouts))
    step_full, step_windowed = full.step, windowed.step

    def stepping(**call: object) -> StepResult:
        reply = step_full(**call)
        other = step_windowed(**call)
        pairs = [(reply, other, FIELDS), (reply.scheduled, other.scheduled, SCHEDULED),
                 (reply.refused, other.refused, REFUSED)]
        for mine, theirs, names in pairs:
            for name in names:
                assert np.array_equal(getattr(mine, name), getattr(theirs, name)), name
        return reply

    full.step = stepping  # type: ignore[method-assign]
    return full
