"""`LayerGroup`: the layers of one kind (full attention, or one sliding window) that share a pool.

A pool of several groups (a service's ``ServiceConfig.groups``) gives each group its own pool of
``num_blocks`` blocks over its own layers, so a model that mixes full and windowed layers keeps
only its windows' blocks in a windowed group. The groups' layers partition ``pool.num_layers``;
every other field of a group's pool is ``pool``'s (`group_pools`), so one row means one request in
every group (`allocator.capacity.windows.groups`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.errors import InvalidValue
from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from kvalloc.allocator.capacity.windows.groups import GroupSpec


class LayerGroup(BaseModel):
    """One group: its name, the model layers whose KV it holds, their window (None: full
    attention) and the blocks of its pool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Group names name exported tensors too (`group_tensor_name`), hence the alphabet.
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_]{0,31}$")
    layers: tuple[int, ...] = Field(min_length=1, description="Model layers, in the order the "
                                                              "group's pool holds them.")
    window: int | None = Field(default=None, gt=0, description="Sliding window in tokens; "
                                                               "None: full attention.")
    num_blocks: int = Field(gt=0)


def group_pools(pool: PoolConfig, groups: list[LayerGroup]) -> list[GroupSpec]:
    """Each group's `GroupSpec`: ``pool`` over the group's layers (and their fp8 scales), with
    the group's window and blocks. `InvalidValue` naming ``groups`` where the groups do not
    partition ``pool``'s layers, a name repeats, ``pool`` sets a window of its own, or a group's
    pool cannot be (a row longer than its blocks: the message names the pool's field)."""
    # Imported here: `KVCacheGroups`' module imports torch, and a service's settings (read by
    # commands' --help) validate groups with this module alone.
    from kvalloc.allocator.capacity.windows.groups import GroupSpec

    _check_partition(pool, groups)
    specs = []
    for group in groups:
        fields = pool.model_dump(exclude={"memory_budget_bytes"})
        for scales in ("k_scales", "v_scales"):
            if fields[scales] is not None:
                fields[scales] = tuple(fields[scales][i] for i in group.layers)
        fields.update(num_layers=len(group.layers), window=group.window,
                      num_blocks=group.num_blocks)
        try:
            specs.append(GroupSpec(group.name, PoolConfig.model_validate(fields)))
        except ValidationError as exc:
            why = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            raise InvalidValue(f"groups: group {group.name}'s pool: {why}",
                               field="groups") from None
    return specs


def _check_partition(pool: PoolConfig, groups: list[LayerGroup]) -> None:
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise InvalidValue(f"groups: names repeat in {names}", field="groups")
    layers = sorted(layer for g in groups for layer in g.layers)
    if layers != list(range(pool.num_layers)):
        raise InvalidValue(f"groups: the groups' layers {layers} do not partition the pool's "
                           f"{pool.num_layers} layers (each layer in exactly one group)",
                           field="groups")
    if pool.window is not None:
        raise InvalidValue("groups: pool.window with groups; give each group its window",
                           field="groups")
