"""`BlockTable`: int32 ``[max_batch_size, max_blocks_per_seq]`` on the device with a host mirror.

Rules (docs/design.md "Words": block table and slot):
- entries past a row's blocks are -1, on the host and on the device;
- ``sync()`` uploads only the cells changed since the last sync, and afterwards the device copy
  equals the host mirror;
- ``slot_mapping`` turns token positions into int64 slots ``block_id * tokens_per_block + offset``
  for a whole batch on the device, with -1 for padding (position < 0) and for positions past the
  row's blocks (so a bad position skips its write instead of reading -1 as a block ordinal).

Every test runs on "cpu" and, marked ``gpu`` (skipped without CUDA), on "cuda".
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator import (
    BatchFull,
    BlockTable,
    InvalidValue,
    InvariantViolation,
    KVCacheManager,
    PoolConfig,
    StepPlan,
)
from kvalloc.allocator.capacity.slots import slots_reference
from kvalloc.allocator.common.placement import plain_tensor

on_each_device = pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])

POISON = -7  # written straight into the device copy to see which rows a sync overwrites


def make_table(device: str, batch: int = 6, width: int = 5) -> BlockTable:
    return BlockTable(batch, width, torch.device(device))


def device_rows(table: BlockTable) -> np.ndarray:
    return table.device_table.cpu().numpy()


def fill_row(table: BlockTable, row: int, ids: list[int]) -> None:
    table.append(np.array([row]), np.array([0]), np.array([len(ids)]),
                 np.array(ids, dtype=np.int32))


@on_each_device
def test_fresh_table_is_all_minus_one_on_host_and_device(device):
    t = make_table(device)
    assert t.host.shape == (6, 5) and t.host.dtype == np.int32
    assert tuple(t.device_table.shape) == (6, 5)
    assert t.device_table.dtype == torch.int32
    assert t.device_table.device.type == torch.device(device).type
    assert (t.host == -1).all()
    assert (device_rows(t) == -1).all()


@on_each_device
def test_append_fills_ragged_ranges_and_leaves_minus_one_beyond(device):
    """append writes each row's ids into its own columns; nothing else changes; sync mirrors it."""
    t = make_table(device)
    t.append(np.array([1, 3]), np.array([0, 2]), np.array([2, 3]),
             np.array([10, 11, 20, 21, 22], dtype=np.int32))
    expected = np.full((6, 5), -1, dtype=np.int32)
    expected[1, :2] = [10, 11]
    expected[3, 2:5] = [20, 21, 22]
    np.testing.assert_array_equal(t.host, expected)
    t.sync()
    np.testing.assert_array_equal(device_rows(t), expected)


@on_each_device
def test_truncate_returns_the_removed_ids_and_clears_them_to_minus_one(device):
    t = make_table(device)
    fill_row(t, 2, [5, 6, 7, 8])
    fill_row(t, 4, [1, 2])
    removed = t.truncate(np.array([2, 4]), np.array([1, 1]), np.array([3, 1]))
    assert removed.tolist() == [6, 7, 8, 2]
    assert t.host[2].tolist() == [5, -1, -1, -1, -1]
    assert t.host[4].tolist() == [1, -1, -1, -1, -1]
    t.sync()
    np.testing.assert_array_equal(device_rows(t), t.host)


@on_each_device
def test_sync_uploads_only_the_cells_touched_since_the_last_sync(device):
    """Poison the device copy, change cells on the host, sync: exactly those cells are
    overwritten (not their whole rows)."""
    t = make_table(device)
    assert [t.acquire_row() for _ in range(3)] == [0, 1, 2]
    fill_row(t, 0, [3, 4])
    t.sync()
    t.device_table.fill_(POISON)

    t.append(np.array([2]), np.array([1]), np.array([2]), np.array([9, 8], dtype=np.int32))
    t.sync()
    expected = np.full((6, 5), POISON, dtype=np.int32)
    expected[2, 1:3] = [9, 8]
    np.testing.assert_array_equal(device_rows(t), expected)

    # Nothing changed: a sync uploads nothing at all.
    t.device_table.fill_(POISON)
    t.sync()
    assert (device_rows(t) == POISON).all()

    # truncate and release_row mark exactly the cells they clear, too.
    t.truncate(np.array([0]), np.array([1]), np.array([1]))
    t.release_row(2)
    t.sync()
    expected = np.full((6, 5), POISON, dtype=np.int32)
    expected[0, 1] = -1
    expected[2, :3] = -1  # release_row clears up to the last id it held
    np.testing.assert_array_equal(device_rows(t), expected)


@on_each_device
def test_sync_of_changes_since_several_writes_lands_every_one(device):
    """Changes accumulate until the next sync, overlapping ones included; afterwards the device
    equals the host wherever the host changed."""
    t = make_table(device, batch=4, width=3)
    for r in range(4):
        fill_row(t, r, list(range(r * 3, r * 3 + 1 + r % 3)))
    t.truncate(np.array([2]), np.array([1]), np.array([2]))
    fill_row(t, 2, [11, 10])
    t.device_table.fill_(POISON)
    t.sync()
    dev = device_rows(t)
    touched = np.zeros((4, 3), dtype=bool)
    for r in range(4):
        touched[r, : 1 + r % 3] = True
    touched[2, :3] = True
    np.testing.assert_array_equal(dev[touched], t.host[touched])
    assert (dev[~touched] == POISON).all()


@on_each_device
def test_sync_through_the_pinned_buffers_grows_them_for_a_large_change(device):
    """A change larger than any before (every cell of a wide table) still lands exactly."""
    t = make_table(device, batch=8, width=64)
    fill_row(t, 0, [1])
    t.sync()
    ids = np.arange(8 * 64, dtype=np.int32)
    t.append(np.arange(8), np.zeros(8, dtype=np.int64), np.full(8, 64), ids)
    t.sync()
    np.testing.assert_array_equal(device_rows(t), ids.reshape(8, 64))


@on_each_device
def test_released_row_goes_back_to_minus_one_and_is_reused(device):
    t = make_table(device, batch=2)
    a = t.acquire_row()
    b = t.acquire_row()
    assert {a, b} == {0, 1}
    with pytest.raises(BatchFull):
        t.acquire_row()
    fill_row(t, a, [1, 2, 3])
    t.sync()
    t.release_row(a)
    t.sync()
    assert (t.host[a] == -1).all() and (device_rows(t)[a] == -1).all()
    assert t.acquire_row() == a
    t.release_row(b)
    with pytest.raises(InvalidValue):
        t.release_row(b)  # not held any more
    assert t.num_free_rows == 1


@on_each_device
def test_slot_mapping_basic_cases(device):
    """slot = block * tpb + offset (int64, on the table's device); -1 for padding and for
    positions past the row's blocks."""
    tpb = 4
    t = make_table(device, batch=3, width=3)
    fill_row(t, 0, [7, 2])     # row 0: positions 0..7 are backed
    fill_row(t, 1, [5])        # row 1: positions 0..3
    t.sync()
    dev = torch.device(device)
    rows = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 0, 0], device=dev)
    pos = torch.tensor([0, 3, 4, 7, 3, -1, 4, 0, 8, 100], device=dev)
    slots = t.slot_mapping(rows, pos, tpb)
    assert slots.dtype == torch.int64
    assert slots.device.type == dev.type
    assert slots.cpu().tolist() == [
        7 * 4 + 0, 7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 3,  # row 0 across its block boundary
        5 * 4 + 3,                                   # row 1
        -1,                                          # padding position
        -1,                                          # row 1 past its single block
        -1,                                          # row 2 holds no blocks
        -1,                                          # row 0 past its blocks (-1 entry)
        -1,                                          # past max_blocks_per_seq entirely
    ]


@on_each_device
def test_slot_mapping_matches_the_numpy_reference_on_random_batches(device):
    rng = np.random.default_rng(7)
    dev = torch.device(device)
    for tpb in (1, 3, 16):
        t = make_table(device, batch=8, width=6)
        counts = rng.integers(0, 7, size=8)
        ids = rng.permutation(200)[: counts.sum()].astype(np.int32)
        t.append(np.arange(8), np.zeros(8, dtype=np.int64), counts, ids)
        t.sync()
        n = 500
        rows = rng.integers(0, 8, size=n)
        positions = rng.integers(-5, 6 * tpb + 10, size=n)
        got = t.slot_mapping(torch.from_numpy(rows).to(dev),
                             torch.from_numpy(positions).to(dev), tpb)
        assert got.dtype == torch.int64
        np.testing.assert_array_equal(got.cpu().numpy(),
                                      slots_reference(t.host, rows, positions, tpb))


@on_each_device
def test_slot_mapping_accepts_int32_inputs(device):
    t = make_table(device, batch=1, width=2)
    fill_row(t, 0, [3, 1])
    t.sync()
    dev = torch.device(device)
    got = t.slot_mapping(torch.zeros(3, dtype=torch.int32, device=dev),
                         torch.tensor([1, 5, -1], dtype=torch.int32, device=dev), 4)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == [13, 5, -1]


@on_each_device
@pytest.mark.parametrize("corrupt", ["minus_one_inside", "id_beyond", "out_of_range",
                                     "free_row_holds_id", "device_differs"])
def test_check_invariants_catches_each_kind_of_corruption(device, corrupt):
    t = make_table(device)
    fill_row(t, 1, [4, 5, 6])
    t.sync()
    live, counts = np.array([1]), np.array([3])
    t.check_invariants(live, counts, 10, synced=True)
    if corrupt == "minus_one_inside":
        t.host[1, 1] = -1
    elif corrupt == "id_beyond":
        t.host[1, 3] = 2
    elif corrupt == "out_of_range":
        t.host[1, 0] = 10
    elif corrupt == "free_row_holds_id":
        t.host[4, 0] = 0
    else:
        t.device_table[1, 0] = 9
    with pytest.raises(InvariantViolation):
        t.check_invariants(live, counts, 10, synced=True)


@on_each_device
def test_rows_left_to_their_worker_are_not_uploaded_until_a_change_outside(device):
    """Inside ``left_to_worker`` a sync uploads nothing and the rows it changed become the
    worker's to keep (their worker keeps its own device copy); what changed before is uploaded
    on entry, being anyone's. The next sync outside that touches a kept row uploads the whole
    row, so a shared copy nobody rewrote meanwhile (tampered, say) is exact again."""
    t = make_table(device)
    fill_row(t, 0, [3, 4])  # before: uploaded when the worker's step begins
    with t.left_to_worker():
        fill_row(t, 1, [5, 6, 7])
        t.sync()
    assert t.worker_kept.tolist() == [False, True, False, False, False, False]
    assert device_rows(t)[0, :2].tolist() == [3, 4] and (device_rows(t)[1] == -1).all()
    t.check_invariants(np.array([0, 1]), np.array([2, 3]), 10, synced=True)
    t.device_table[1, 4] = POISON  # a kept row's shared copy is read by nobody: not checked
    t.check_invariants(np.array([0, 1]), np.array([2, 3]), 10, synced=True)
    t.device_table[0, 4] = POISON
    with pytest.raises(InvariantViolation):
        t.check_invariants(np.array([0, 1]), np.array([2, 3]), 10, synced=True)
    t.device_table[0, 4] = -1

    t.truncate(np.array([1]), np.array([2]), np.array([1]))  # a change outside: the whole row
    t.sync()
    assert not t.worker_kept.any()
    np.testing.assert_array_equal(device_rows(t), t.host)


@on_each_device
def test_manager_keeps_the_device_table_exact_through_a_scheduler_run(device):
    """Through a KVCacheManager on `device`: after every step the device table equals the host,
    each live row holds exactly ceil(capacity / tpb) valid ids and -1 beyond, and every position a
    pending forward may write (history .. capacity - 1) maps to a real slot in its own blocks,
    while the first position past the row's blocks maps to -1."""
    tpb = 4
    cfg = PoolConfig(num_blocks=48, tokens_per_block=tpb, num_layers=1, num_kv_heads=1,
                     head_dim=8, device=device, max_batch_size=4, max_seq_len=40,
                     max_draft_len=3)
    m = KVCacheManager(cfg)
    rng = np.random.default_rng(3)
    ids = ["a", "b", "c"]
    for req, prompt in zip(ids, [5, 8, 13], strict=True):
        m.add_request(req, prompt)
    rows = m.rows_of(ids)
    m.step(StepPlan(grant_rows=rows, draft_lens=[3, 3, 3]))
    dev = torch.device(device)
    for _ in range(6):
        m.check_invariants()
        np.testing.assert_array_equal(device_rows(m.table), m.table.host)
        for req in ids:
            row, nb = m.row(req), m.num_blocks(req)
            assert nb == -(-m.capacity(req) // tpb)
            assert (m.table.host[row, nb:] == -1).all()
            pos = torch.arange(m.history(req), m.capacity(req) + 1, device=dev)
            slots = m.table.slot_mapping(torch.full_like(pos, row), pos, tpb).cpu().numpy()
            inside = np.arange(m.history(req), m.capacity(req) + 1) < nb * tpb
            blocks = m.block_ids(req)
            expect = np.array([blocks[p // tpb] * tpb + p % tpb if ok else -1
                               for p, ok in zip(range(m.history(req), m.capacity(req) + 1),
                                                inside, strict=True)])
            np.testing.assert_array_equal(slots, expect)
            assert (slots[:-1] >= 0).all()  # history .. capacity - 1 all writable
        acc = rng.integers(0, 4, size=3).tolist()
        m.step(StepPlan(result_rows=rows, num_accepted=acc, grant_rows=rows,
                        draft_lens=[3, 3, 3]))
    m.step(StepPlan(finished_rows=rows))
    m.check_invariants()
    assert m.free_blocks == 48
    assert (device_rows(m.table) == -1).all()


@on_each_device
def test_a_mirror_starts_as_the_host_and_every_sync_keeps_it_equal(device):
    table = make_table(device)
    row = table.acquire_row()
    table.append(np.array([row]), np.array([0]), np.array([2]), np.array([4, 9]))
    table.sync()
    mirror = table.mirror(torch.device(device), plain_tensor, "block_table-mirror")
    assert np.array_equal(mirror.cpu().numpy(), table.host)  # made after a sync: a copy of it
    other = table.acquire_row()
    table.append(np.array([other, row]), np.array([0, 2]), np.array([3, 1]),
                 np.array([1, 2, 3, 7]))
    table.release_row(row)
    table.sync()
    assert len(table.device_tables) == 2
    for copy in table.device_tables:
        assert np.array_equal(copy.cpu().numpy(), table.host)
    mirror[other, 0] = POISON  # a mirror the sync did not reach is caught
    with pytest.raises(InvariantViolation, match="a device block table differs"):
        table.check_invariants(np.array([other]), np.array([3]), 16, synced=True)
