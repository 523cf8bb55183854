"""`KVStorage` of each layout: the pool's shape, its row view, its bytes and its fp8 scales."""

from __future__ import annotations

import pytest
import torch
from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.errors import NworInputError
from kvalloc.allocator.nwor.storage import KVStorage


def _config(**overrides: object) -> PoolConfig:
    fields = {"num_blocks": 3, "tokens_per_block": 16, "num_layers": 2, "num_kv_heads": 1,
              "head_dim": 576, "kv_layout": "latent", "device": "cpu", "max_seq_len": 16}
    return PoolConfig(**{**fields, **overrides})


def test_a_latent_pool_is_one_plane_of_one_head():
    storage = KVStorage(_config())
    assert storage.kv.shape == (2, 1, 3, 16, 1, 576)
    assert storage.rows().shape == (2, 1, 48, 576)
    assert storage.nbytes() == 3 * storage.config.bytes_per_block == 3 * 2 * 16 * 576 * 2
    assert storage.key_cache(1).shape == (3, 16, 1, 576)


def test_a_kv_pool_of_the_same_width_is_two_planes_and_twice_the_bytes():
    latent = KVStorage(_config())
    kv = KVStorage(_config(kv_layout="kv"))
    assert kv.kv.shape == (2, 2, 3, 16, 1, 576)
    assert kv.nbytes() == 2 * latent.nbytes()


def test_a_latent_pool_has_no_value_plane():
    with pytest.raises(NworInputError) as err:
        KVStorage(_config()).value_cache(0)
    assert err.value.field == "kv_layout"


def test_an_fp8_latent_pool_has_one_scale_per_layer():
    storage = KVStorage(_config(dtype="fp8_e4m3", k_scales=(0.5, 2.0)))
    assert storage.plane_scales().tolist() == [[0.5], [2.0]]
    both = KVStorage(_config(kv_layout="kv", dtype="fp8_e4m3", k_scales=(0.5, 2.0),
                             v_scales=(4.0, 8.0)))
    assert both.plane_scales().tolist() == [[0.5, 4.0], [2.0, 8.0]]


def test_over_checks_an_attached_pool_against_the_layout():
    cfg = _config()
    assert KVStorage.over(cfg, torch.zeros(2, 1, 3, 16, 1, 576, dtype=torch.bfloat16)).planes == 1
    with pytest.raises(NworInputError) as err:
        KVStorage.over(cfg, torch.zeros(2, 2, 3, 16, 1, 576, dtype=torch.bfloat16))
    assert err.value.field == "kv"
