"""A block-table sync on CUDA replays a captured graph per bucket of changed cells.

Rules:
- a sync of n changed cells replays the bucket of the smallest power of two at least n (and at
  least ``MIN_ROWS``); past ``MAX_ROWS`` there is no graph;
- the packed input is ``[cells | values]``, padded to the bucket by repeating the first pair,
  so the scatter writes exactly the changed cells, whatever order it runs in;
- on CUDA, graph syncs leave the device table equal to the host mirror and to what the eager
  path leaves, bit for bit, over every bucket and past the largest; the table keeps its shape
  and address;
- a new table has every bucket captured, and the warm-ups wrote nothing: its syncs, the first of
  each bucket included, capture nothing and never make the host wait for the device;
- a capture that fails, when the table is made or later, turns graphs off for good (one attempt,
  one warning) and every sync runs the eager path;
- beyond ``max_graphs`` the least recently used graph captured on first use is dropped, and
  recaptured when needed; graphs captured ahead stay.

The rules on bucket and packing run on CPU; the rest, marked ``gpu``, on CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from cuda_checks import counted_captures, failing_captures, no_host_sync
from kvalloc.allocator import BlockTable, InvalidValue
from kvalloc.allocator.capacity.table_graphs import (
    MAX_ROWS,
    MIN_ROWS,
    TableUploadGraphs,
    pack,
    rows_for,
)
from kvalloc.allocator.common.pinned_graphs import bucket_sizes

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BATCH, WIDTH = 40, 257  # 10280 cells: syncs of every bucket, and past the largest
BUCKETS = [1 << k for k in range(MIN_ROWS.bit_length() - 1, MAX_ROWS.bit_length())]


def test_buckets_are_the_powers_of_two_from_the_smallest_to_the_largest() -> None:
    assert BUCKETS[0] == MIN_ROWS and BUCKETS[-1] == MAX_ROWS and len(BUCKETS) > 2
    for cells in range(1, 2 * MAX_ROWS + 2):
        rows = rows_for(cells)
        if cells > MAX_ROWS:
            assert rows is None, cells
            continue
        assert rows in BUCKETS and rows >= cells, cells
        assert rows == MIN_ROWS or rows // 2 < cells, cells  # the smallest that fits
    assert rows_for(MIN_ROWS, max_rows=MIN_ROWS) == MIN_ROWS
    assert rows_for(MIN_ROWS + 1, max_rows=MIN_ROWS) is None
    assert rows_for(100, max_rows=100) is None  # the cap is a bucket, not a clamp


@pytest.mark.parametrize("max_rows", [1, 63, 64, 100, 128, 1000, MAX_ROWS])
def test_the_buckets_captured_ahead_are_exactly_those_some_sync_replays(max_rows: int) -> None:
    replayed = {rows_for(cells, max_rows) for cells in range(1, 2 * max_rows + 2)} - {None}
    assert bucket_sizes(MIN_ROWS, max_rows) == sorted(replayed)
    assert bucket_sizes(MIN_ROWS, MAX_ROWS) == BUCKETS


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.full((4, 3), -1, dtype=torch.int32), id="cpu"),
    pytest.param(lambda: torch.full((4, 3), -1, dtype=torch.int64, device="cuda"),
                 id="cuda_int64", marks=[gpu, needs_cuda]),
    pytest.param(lambda: torch.full((3, 4), -1, dtype=torch.int32, device="cuda").t(),
                 id="cuda_strided", marks=[gpu, needs_cuda]),
])
def test_graphs_refuse_anything_but_a_contiguous_int32_cuda_table(
        make: Callable[[], torch.Tensor]) -> None:
    with pytest.raises(InvalidValue, match="contiguous int32 CUDA tensor") as raised:
        TableUploadGraphs(make())
    assert raised.value.field == "block_table"


def _random_changes(rng: np.random.Generator, cells: int, size: int) -> np.ndarray:
    """``cells`` flat indices into a table of ``size`` cells, some repeated."""
    return rng.integers(0, size, cells)


def test_pack_lays_out_cells_then_values_padded_with_the_first_pair() -> None:
    rng = np.random.default_rng(1)
    table = rng.integers(-2**31, 2**31, BATCH * WIDTH, dtype=np.int64).astype(np.int32)
    for cells in (1, 2, 63, 64, 65, 1000, MAX_ROWS):
        rows = rows_for(cells)
        assert rows is not None
        changed = _random_changes(rng, cells, table.size)
        out = np.full(12 * MAX_ROWS + 16, 0xAB, dtype=np.uint8)
        pack(out, rows, changed, table)
        index = out[: 8 * rows].view(np.int64)
        values = out[8 * rows: 12 * rows].view(np.int32)
        np.testing.assert_array_equal(index[:cells], changed)
        np.testing.assert_array_equal(values[:cells], table[changed])
        assert (index[cells:] == changed[0]).all() and (values[cells:] == table[changed[0]]).all()
        assert (out[12 * rows:] == 0xAB).all()  # nothing past the bucket's bytes


def test_a_packed_scatter_in_any_order_writes_exactly_the_changed_cells() -> None:
    """Padding and repeated cells carry the value the host holds: a scatter that runs them in
    any order writes the changed cells and nothing else."""
    rng = np.random.default_rng(2)
    table = rng.integers(-2**31, 2**31, BATCH * WIDTH, dtype=np.int64).astype(np.int32)
    poison = np.int32(-7)
    for cells in (1, 5, 64, 300, 2500):
        rows = rows_for(cells)
        assert rows is not None
        changed = _random_changes(rng, cells, table.size)
        out = np.empty(12 * rows, dtype=np.uint8)
        pack(out, rows, changed, table)
        index = out[: 8 * rows].view(np.int64)
        values = out[8 * rows:].view(np.int32)
        want = np.full(table.size, poison)
        want[changed] = table[changed]
        for order in (np.arange(rows), np.arange(rows)[::-1], rng.permutation(rows)):
            device = np.full(table.size, poison)
            for i in order:
                device[index[i]] = values[i]
            np.testing.assert_array_equal(device, want)


def _step(rng: np.random.Generator, tables: list[BlockTable], cells: int) -> None:
    """The same ``cells`` random cell writes (full int32 range, some cells twice, marked in one
    to three pieces) on each of ``tables``' hosts, then a sync of each."""
    changed = _random_changes(rng, cells, BATCH * WIDTH)
    values = rng.integers(-2**31, 2**31, cells, dtype=np.int64).astype(np.int32)
    pieces = np.array_split(changed, rng.integers(1, 4))
    for table in tables:
        table.host.reshape(-1)[changed] = values
        for piece in pieces:
            table.mark_cells(piece)
        table.sync()


def _sizes(rng: np.random.Generator, rounds: int) -> list[int]:
    """Sync sizes that land in every bucket and past the largest, ``rounds`` times, shuffled."""
    sizes = []
    for _ in range(rounds):
        sizes += [int(rng.integers(b // 2 + 1, b + 1)) for b in BUCKETS]
        sizes += [1, int(rng.integers(MAX_ROWS + 1, 2 * MAX_ROWS))]
    return [int(s) for s in rng.permutation(sizes)]


def _device(table: BlockTable) -> np.ndarray:
    return table.device_table.cpu().numpy()


@gpu
@needs_cuda
def test_graph_syncs_equal_the_host_and_the_eager_path_over_every_bucket() -> None:
    graphed = BlockTable(BATCH, WIDTH, torch.device("cuda"))
    eager = BlockTable(BATCH, WIDTH, torch.device("cuda"), upload_graphs=False)
    assert eager.upload_graphs is None and graphed.upload_graphs is not None
    address, shape = graphed.device_table.data_ptr(), graphed.device_table.shape
    rng = np.random.default_rng(3)
    for i, cells in enumerate(_sizes(rng, rounds=4)):
        _step(rng, [graphed, eager], cells)
        assert torch.equal(graphed.device_table, eager.device_table), (i, cells)
        np.testing.assert_array_equal(_device(graphed), graphed.host, err_msg=f"{i}: {cells}")
    assert graphed.upload_graphs.captured == len(BUCKETS) and not graphed.upload_graphs.failed
    assert graphed.device_table.data_ptr() == address and graphed.device_table.shape == shape


@gpu
@needs_cuda
def test_a_new_table_has_every_bucket_captured_and_no_sync_captures_or_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bucket is captured when the table is made, so the first sync of each bucket
    replays like the rest: none captures, none waits for the device, and each leaves the table
    the eager path leaves."""
    captures = counted_captures(monkeypatch)
    table = BlockTable(BATCH, WIDTH, torch.device("cuda"))
    eager = BlockTable(BATCH, WIDTH, torch.device("cuda"), upload_graphs=False)
    graphs = table.upload_graphs
    assert graphs is not None and not graphs.failed
    assert len(captures) == graphs.captured == len(BUCKETS)
    assert all(graphs.holds(rows) for rows in BUCKETS)
    assert (_device(table) == -1).all()  # the warm-ups wrote nothing else
    sizes = np.random.default_rng(4)
    # The same changes on both tables, the graphed one's inside the check only.
    graphed_changes, eager_changes = np.random.default_rng(40), np.random.default_rng(40)
    for _ in range(3):
        for rows in BUCKETS:
            cells = int(sizes.integers(rows // 2 + 1, rows + 1))
            with no_host_sync():
                _step(graphed_changes, [table], cells)
            _step(eager_changes, [eager], cells)
            assert torch.equal(table.device_table, eager.device_table), rows
            np.testing.assert_array_equal(_device(table), table.host, err_msg=str(rows))
    assert len(captures) == graphs.captured == len(BUCKETS)


@gpu
@needs_cuda
def test_capturing_every_bucket_ahead_writes_nothing_into_a_full_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Straight on the graphs, over a table of random values the device holds too: capturing
    every bucket leaves it bit for bit as it was, and the uploads that follow capture nothing."""
    captures = counted_captures(monkeypatch)
    rng = np.random.default_rng(7)
    host = rng.integers(-2**31, 2**31, BATCH * WIDTH, dtype=np.int64).astype(np.int32)
    device = torch.from_numpy(host.reshape(BATCH, WIDTH)).cuda()
    graphs = TableUploadGraphs(device)
    assert graphs.buckets == BUCKETS
    assert graphs.capture_all(host)
    np.testing.assert_array_equal(device.cpu().numpy().reshape(-1), host)
    assert len(captures) == graphs.captured == len(BUCKETS)
    assert graphs.capture_all(host) and len(captures) == len(BUCKETS)  # again: nothing new
    for rows in BUCKETS:
        changed = _random_changes(rng, int(rng.integers(rows // 2 + 1, rows + 1)), host.size)
        host[changed] = rng.integers(-2**31, 2**31, changed.size, dtype=np.int64).astype(
            np.int32)
        with no_host_sync():
            assert graphs.upload(changed, host)
        np.testing.assert_array_equal(device.cpu().numpy().reshape(-1), host, err_msg=str(rows))
    assert len(captures) == len(BUCKETS)


@gpu
@needs_cuda
def test_a_failed_capture_falls_back_to_the_eager_path_for_good(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    attempts = failing_captures(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvalloc.allocator.capacity.table_graphs"):
        table = BlockTable(BATCH, WIDTH, torch.device("cuda"))
        # The first bucket's capture, when the table was made, failed; none was tried after it,
        # and its real warm-up wrote nothing.
        assert len(attempts) == 1 and table.upload_graphs is not None
        assert table.upload_graphs.failed and (_device(table) == -1).all()
        rng = np.random.default_rng(5)
        for cells in _sizes(rng, rounds=2):
            _step(rng, [table], cells)
            np.testing.assert_array_equal(_device(table), table.host, err_msg=str(cells))
    assert len(attempts) == 1
    assert table.upload_graphs is not None and table.upload_graphs.failed
    assert table.upload_graphs.captured == 0
    assert caplog.text.count("syncing without a graph") == 1


@gpu
@needs_cuda
def test_graphs_beyond_the_limit_are_dropped_and_recaptured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Directly on the graphs: three buckets in turn with room for two (each use recaptures the
    one dropped longest ago), each upload exact; an upload past the largest bucket is refused and
    writes nothing, and so does one of no cells."""
    captures = counted_captures(monkeypatch)
    host = np.full(BATCH * WIDTH, -1, dtype=np.int32)
    device = torch.full((BATCH, WIDTH), -1, dtype=torch.int32, device="cuda")
    graphs = TableUploadGraphs(device, max_rows=256, max_graphs=2)
    rng = np.random.default_rng(6)
    for cells in [64, 128, 256] * 3:
        changed = _random_changes(rng, cells, host.size)
        host[changed] = rng.integers(-2**31, 2**31, cells, dtype=np.int64).astype(np.int32)
        assert graphs.upload(changed, host)
        assert graphs.captured <= 2
        np.testing.assert_array_equal(device.cpu().numpy().reshape(-1), host)
    assert len(captures) == 9
    for cells in (256, 128):  # the two most recent: replayed, not captured again
        changed = _random_changes(rng, cells, host.size)
        host[changed] = 7
        assert graphs.upload(changed, host)
    assert len(captures) == 9
    np.testing.assert_array_equal(device.cpu().numpy().reshape(-1), host)
    before = device.clone()
    changed = _random_changes(rng, 257, host.size)
    host[changed] = 12345
    assert not graphs.upload(changed, host)
    assert graphs.upload(changed[:0], host)  # nothing to write, and nothing written
    assert torch.equal(device, before) and graphs.captured == 2 and len(captures) == 9
