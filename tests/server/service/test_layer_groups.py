"""`ServiceConfig.groups`: KV cache groups whose layers partition the pool's, each pool derived
from the service's; bad group specs are errors naming the field; what groups do not serve
is refused."""

from __future__ import annotations

import pytest
from kvalloc.allocator import KVCacheGroups, LayerGroup, PoolConfig, group_pools
from kvalloc.allocator.errors import InvalidValue
from kvalloc.server.service.settings import ServiceConfig
from pydantic import ValidationError

POOL = PoolConfig(num_blocks=64, tokens_per_block=4, num_layers=3, num_kv_heads=1, head_dim=8,
                  dtype="fp8_e4m3", k_scales=(1.0, 2.0, 3.0), device="cpu", max_batch_size=4,
                  max_seq_len=128, max_draft_len=2)


def group(name: str, layers: list[int], window: int | None, num_blocks: int) -> dict:
    return {"name": name, "layers": layers, "window": window, "num_blocks": num_blocks}


MIXED = [group("full", [0, 2], None, 64), group("sliding", [1], 8, 12)]


def test_each_group_s_pool_is_the_service_s_over_its_layers() -> None:
    config = ServiceConfig(pool=POOL, groups=MIXED)
    full, sliding = group_pools(config.pool, config.groups)
    assert (full.name, full.config.num_layers, full.config.window) == ("full", 2, None)
    assert full.config.k_scales == (1.0, 3.0) and sliding.config.k_scales == (2.0,)
    assert (sliding.config.num_blocks, sliding.config.window) == (12, 8)
    assert sliding.config.max_live_blocks_per_seq < full.config.max_live_blocks_per_seq
    KVCacheGroups([full, sliding]).check_invariants()  # the pools agree where rows must


@pytest.mark.parametrize(("groups", "says"), [
    ([group("full", [0, 1], None, 64)], "do not partition"),
    ([group("full", [0, 1], None, 64), group("sliding", [1, 2], 8, 12)], "do not partition"),
    ([group("full", [0, 1, 3], None, 64)], "do not partition"),
    ([group("a", [0, 2], None, 64), group("a", [1], 8, 12)], "names repeat"),
    ([group("full", [0, 2], None, 64), group("sliding", [1], 8, 2)],
     "group sliding's pool: max_seq_len"),
])
def test_groups_that_make_no_pools_name_the_field(groups: list[dict], says: str) -> None:
    with pytest.raises(ValidationError, match=f"groups: .*{says}"):
        ServiceConfig(pool=POOL, groups=groups)


def test_the_allocator_names_the_groups_field() -> None:
    with pytest.raises(InvalidValue, match="do not partition") as info:
        group_pools(POOL, [LayerGroup(**MIXED[0])])
    assert info.value.field == "groups"


@pytest.mark.parametrize(("group_fields", "field"), [
    ({"name": "bad-name"}, "name"), ({"name": ""}, "name"), ({"layers": []}, "layers"),
    ({"window": 0}, "window"), ({"num_blocks": 0}, "num_blocks")])
def test_a_bad_group_field_is_named(group_fields: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ServiceConfig(pool=POOL, groups=[{**MIXED[0], **group_fields}, MIXED[1]])
    assert info.value.errors()[0]["loc"][-1] == field


@pytest.mark.parametrize(("changes", "field"), [
    ({"tensor_parallel": 2}, "tensor_parallel: not with groups"),
    ({"devices": ["cpu", "cpu"]}, "devices: not with groups"),
    ({"pool": POOL.model_copy(update={"window": 8})}, "groups: pool.window"),
])
def test_what_groups_do_not_serve_is_refused(changes: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        ServiceConfig(**{"pool": POOL, "groups": MIXED, **changes})
