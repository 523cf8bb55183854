"""The placement hook: `KVStorage`, `BlockTable` and the manager's table take every tensor from
the `TensorAllocator` they are given, by name, and fill it (zeros for the pool, -1 for the table)
whatever memory it hands back."""

from __future__ import annotations

import numpy as np
import torch
from kvalloc.allocator import BlockTable, KVCacheManager, KVStorage, StepPlan, plain_tensor


class Recording:
    """An allocator that hands out garbage-filled tensors and records what was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, tuple[int, ...], torch.dtype, str]] = []
        self.made: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        self.asked.append((name, tuple(shape), dtype, device.type))
        tensor = torch.full(shape, 7, dtype=dtype, device=device)
        self.made[name] = tensor
        return tensor


def test_plain_tensor_is_an_ordinary_tensor_of_the_shape_asked_for():
    t = plain_tensor("anything", (2, 3), torch.int32, torch.device("cpu"))
    assert t.shape == (2, 3) and t.dtype == torch.int32 and t.device.type == "cpu"


def test_kv_storage_asks_for_kv_and_zero_fills_it(make_config):
    cfg = make_config()
    alloc = Recording()
    storage = KVStorage(cfg, allocate=alloc)
    shape = (cfg.num_layers, 2, cfg.total_blocks, cfg.tokens_per_block, cfg.num_kv_heads,
             cfg.head_dim)
    assert alloc.asked == [("kv", shape, cfg.torch_dtype, "cpu")]
    assert storage.kv is alloc.made["kv"]
    assert (storage.kv == 0).all()


def test_block_table_asks_for_block_table_and_fills_minus_one():
    alloc = Recording()
    table = BlockTable(3, 5, torch.device("cpu"), allocate=alloc)
    assert alloc.asked == [("block_table", (3, 5), torch.int32, "cpu")]
    assert table.device_table is alloc.made["block_table"]
    assert (table.device_table == -1).all()


def test_manager_keeps_the_injected_table_in_sync_and_owns_no_pool(make_config):
    """The manager is host-only: it asks only for its block table, and steps write into the very
    tensor the allocator returned (another process mapping it sees the rows)."""
    alloc = Recording()
    m = KVCacheManager(make_config(), allocate=alloc)
    assert [name for name, *_ in alloc.asked] == ["block_table"]
    assert not hasattr(m, "storage")
    out = m.step(StepPlan(prompt_lens=[9, 4]))
    shared = alloc.made["block_table"].numpy()
    np.testing.assert_array_equal(shared, m.table.host)
    assert (shared[out.admitted_rows[0], :3] >= 0).all()
