"""The graphs of a host-slot commit, captured ahead of the first window from a staging buffer.

Rules:
- a window of n tokens from a buffer of ``capacity`` tokens replays the bucket of the smallest
  power of two at least n (and at least ``MIN_ROWS``), never past ``max_tokens`` nor the buffer;
  ``row_buckets`` lists exactly the buckets some window replays;
- graphs captured ahead are kept until dropped: graphs captured on first use only compete among
  themselves for ``max_graphs``, so they never evict the ones captured ahead;
- ``graphs.capture_host_writes(staging)`` refuses a buffer ``stage_from`` would refuse, and a
  call inside a window, changing nothing; on a CPU pool it captures nothing and says so;
- on CUDA it captures every bucket, writing nothing into the pool; each window's commit then
  captures nothing, never waits for the device, and writes what the eager path writes, bit for
  bit, protected blocks or not, however many buffers hold graphs;
- a buffer's graphs go when it is dropped; a commit from it then captures on first use again;
- a capture that fails ahead turns graphs off for good (one attempt, one warning) and every
  commit writes eagerly;
- the service captures a worker's graphs when it registers, and drops them when the worker
  deregisters or its lease expires.

The rules on buckets, the store and bad input run on CPU; the rest, marked ``gpu``, on CUDA.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from cuda_checks import counted_captures, failing_captures, no_host_sync
from kvalloc.allocator.common.pinned_graphs import GraphStore, bucket_sizes
from kvalloc.allocator.errors import NworInputError, WindowStateError
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.host_write_graphs import MIN_ROWS, row_buckets, rows_for
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.window import WindowLayout
from nwor_scenarios import Window, bits, expected_after, poisoned_storage, pool_config

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])]

TOKENS = 200  # buckets 64, 128 and 200
HOST_WRITE_FAILURE = "committing without a graph"


@pytest.mark.parametrize("max_tokens", [1, 50, 64, 65, 100, 128, 200, 4096])
@pytest.mark.parametrize("capacity", [1, 63, 64, 100, 256, 4096, 5000])
def test_row_buckets_are_exactly_the_buckets_some_window_replays(
        max_tokens: int, capacity: int) -> None:
    largest = min(max_tokens, capacity)
    replayed = {rows_for(n, max_tokens, capacity) for n in range(1, largest + 1)}
    listed = row_buckets(max_tokens, capacity)
    assert listed == sorted(replayed)
    assert all(rows_for(n, max_tokens, capacity) >= n for n in range(1, largest + 1))


def test_a_service_worker_of_the_default_step_size_has_seven_buckets() -> None:
    assert row_buckets(4096, 4096) == [64, 128, 256, 512, 1024, 2048, 4096]
    assert row_buckets(4096, 4096) == bucket_sizes(MIN_ROWS, 4096)


def test_bucket_sizes_grow_by_doubling_from_the_smallest() -> None:
    assert bucket_sizes(64, 63) == []
    assert bucket_sizes(64, 64) == [64]
    assert bucket_sizes(64, 1000) == [64, 128, 256, 512]
    assert bucket_sizes(1, 8) == [1, 2, 4, 8]


def test_graphs_captured_ahead_are_never_evicted_by_graphs_captured_on_first_use() -> None:
    store: GraphStore[str] = GraphStore(max_graphs=2)
    ahead = [("worker", w, rows) for w in range(6) for rows in (64, 128, 256)]
    for key in ahead:  # more than max_graphs of them
        store.add(key, f"graph {key}", ahead=True)
    for i in range(50):  # first-use captures, cycling through more keys than there is room for
        store.add(("lazy", i % 5), f"lazy {i}", ahead=False)
        assert len(store) == len(ahead) + min(i + 1, 2)
    assert all(store.get(key) == f"graph {key}" for key in ahead)
    assert ("lazy", 4) in store and ("lazy", 3) in store and ("lazy", 2) not in store


def test_the_least_recently_used_first_use_graph_goes_first() -> None:
    store: GraphStore[str] = GraphStore(max_graphs=2)
    store.add("a", "A", ahead=False)
    store.add("b", "B", ahead=False)
    assert store.get("a") == "A"  # "a" is now the most recently used
    store.add("c", "C", ahead=False)
    assert "b" not in store and store.get("a") == "A" and store.get("c") == "C"
    assert store.get("b") is None


def test_capturing_ahead_a_graph_first_captured_on_use_moves_it_out_of_the_lru() -> None:
    store: GraphStore[str] = GraphStore(max_graphs=1)
    store.add("a", "A", ahead=False)
    store.add("a", "A", ahead=True)
    store.add("b", "B", ahead=False)
    store.add("c", "C", ahead=False)
    assert len(store) == 2 and store.get("a") == "A" and "b" not in store


def test_dropping_forgets_the_matching_graphs_of_both_kinds() -> None:
    store: GraphStore[str] = GraphStore(max_graphs=4)
    for rows in (64, 128):
        store.add(("x", rows), "x", ahead=True)
        store.add(("y", rows), "y", ahead=True)
    store.add(("x", 256), "x", ahead=False)
    store.add(("z", 64), "z", ahead=False)
    assert store.drop(lambda key: key[0] == "x") == 3
    assert len(store) == 3 and ("x", 64) not in store and ("x", 256) not in store
    assert store.get(("y", 128)) == "y" and store.get(("z", 64)) == "z"
    assert store.drop(lambda key: key[0] == "x") == 0


def _cpu_manager() -> tuple[DeferredWriteManager, torch.Tensor]:
    storage = poisoned_storage(pool_config("cpu"))
    mgr = DeferredWriteManager(storage, max_tokens=TOKENS)
    cfg = storage.config
    staging = torch.zeros((cfg.num_layers, 2, TOKENS, cfg.num_kv_heads, cfg.head_dim),
                          dtype=mgr.spec.stage_dtype)
    return mgr, staging


def test_on_a_cpu_pool_capturing_ahead_captures_nothing_and_says_so() -> None:
    mgr, staging = _cpu_manager()
    assert mgr.graphs.capture_host_writes(staging) is False
    assert mgr.graphs.captured.host is None
    assert mgr.graphs.drop_host_writes(staging) == 0


@pytest.mark.parametrize("bad", ["not a tensor", "layers", "empty", "strided", "dtype"])
def test_capturing_ahead_refuses_a_buffer_stage_from_refuses(bad: str) -> None:
    mgr, staging = _cpu_manager()
    staging = {
        "not a tensor": lambda: staging.float().numpy(),
        "layers": lambda: staging[:1],
        "empty": lambda: staging[:, :, :0],
        "strided": lambda: staging.transpose(3, 4),
        "dtype": lambda: staging.float(),
    }[bad]()
    for call in (mgr.graphs.capture_host_writes, mgr.graphs.drop_host_writes):
        with pytest.raises(NworInputError, match="staging") as raised:
            call(staging)
        assert raised.value.field == "staging"
    assert mgr.graphs.captured.host is None and not mgr.window_open


def test_capturing_ahead_inside_a_window_is_refused_and_the_window_still_commits() -> None:
    mgr, staging = _cpu_manager()
    mgr.begin_window(WindowLayout([3], [2]))
    with pytest.raises(WindowStateError, match="between windows"):
        mgr.graphs.capture_host_writes(staging)
    assert mgr.window_open and mgr.graphs.captured.host is None
    mgr.stage_from(staging, np.array([0, 1, 2], dtype=np.int64))
    mgr.commit([1])
    assert mgr.last_window.committed == 2 and mgr.metrics().fallbacks == {}


# ---- on CUDA ---------------------------------------------------------------------------------


def _twins(protected: bool = False) -> tuple[list[KVStorage], DeferredWriteManager,
                                             DeferredWriteManager, Callable[[], torch.Tensor]]:
    """Two identical poisoned CUDA pools: one manager writes eagerly (the torch path), the
    other replays graphs; and a maker of staging buffers of ``TOKENS`` tokens."""
    cfg = pool_config("cuda")
    storages = [poisoned_storage(cfg) for _ in range(2)]
    eager = DeferredWriteManager(storages[0], max_tokens=TOKENS, max_requests=TOKENS,
                                 backend="torch")
    graphed = DeferredWriteManager(storages[1], max_tokens=TOKENS, max_requests=TOKENS)
    assert graphed.backend == "triton"
    if protected:
        blocks = (torch.rand(cfg.total_blocks, generator=torch.Generator().manual_seed(3))
                  < 0.3).cuda()
        eager.protect(blocks)
        graphed.protect(blocks)

    def staging() -> torch.Tensor:
        """A buffer of finite values: a write from any of its rows would show in the pool."""
        return torch.randn((cfg.num_layers, 2, TOKENS, cfg.num_kv_heads, cfg.head_dim),
                           device="cuda").to(graphed.spec.stage_dtype)

    return storages, eager, graphed, staging


def _window(rng: np.random.Generator, n: int, num_slots: int) -> tuple[WindowLayout, np.ndarray,
                                                                         list[int]]:
    """A window of exactly ``n`` tokens (decodes of 0 to 4 drafts), its slots (a few -1) and
    accepted counts."""
    tokens: list[int] = []
    drafts: list[int] = []
    while sum(tokens) < n:
        size = min(1 + int(rng.integers(0, 5)), n - sum(tokens))
        tokens.append(size)
        drafts.append(size - 1)
    slots = rng.permutation(num_slots)[:n].astype(np.int64)
    slots[rng.random(n) < 0.1] = -1
    return WindowLayout(tokens, drafts), slots, [int(rng.integers(0, d + 1)) for d in drafts]


def _sizes(rng: np.random.Generator) -> list[int]:
    """One window size in each bucket, smallest bucket first."""
    buckets = row_buckets(TOKENS, TOKENS)
    return [int(rng.integers(low + 1, high + 1))
            for low, high in zip([0, *buckets[:-1]], buckets, strict=True)]


def _commit_both(eager: DeferredWriteManager, graphed: DeferredWriteManager,
                 staging: torch.Tensor, window: tuple[WindowLayout, np.ndarray, list[int]],
                 *, sync_free: bool) -> None:
    """The same window committed by both; the graphed commit checked never to wait for the
    device (a capture would: it synchronises)."""
    layout, slots, accepted = window
    eager.begin_window(layout)
    eager.stage_from(staging, slots)
    eager.commit(accepted)
    with no_host_sync() if sync_free else contextlib.nullcontext():
        graphed.begin_window(layout)
        graphed.stage_from(staging, slots)
        graphed.commit(accepted)


def _source(staging: torch.Tensor) -> torch.Tensor:
    """The buffer as the commit reads it (what its graphs are keyed by)."""
    return staging.flatten(3)


@gpu
@needs_cuda
@pytest.mark.parametrize("protected", [False, True])
def test_capturing_ahead_covers_every_bucket_writes_nothing_and_the_commits_then_replay(
        protected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    captures = counted_captures(monkeypatch)
    storages, eager, graphed, make_staging = _twins(protected)
    staging = make_staging()
    before = bits(storages[1].kv).clone()
    assert graphed.graphs.capture_host_writes(staging)
    torch.cuda.synchronize()
    assert torch.equal(bits(storages[1].kv), before)  # the warm-ups wrote nothing
    assert graphed.metrics() == eager.metrics()  # and counted nothing (no refusal either)
    graphs = graphed.graphs.captured.host
    assert graphs is not None and not graphs.failed
    buckets = row_buckets(TOKENS, TOKENS)
    assert len(captures) == graphs.captured == len(buckets) == 3
    blocks = graphed._protection.blocks
    variant = None if blocks is None else blocks.data_ptr()
    assert all(graphs.holds(_source(staging), rows, variant) for rows in buckets)
    assert graphed.graphs.capture_host_writes(staging)  # again: nothing new to capture
    assert len(captures) == 3

    rng = np.random.default_rng(11)
    num_slots = storages[0].num_slots
    for round_ in range(3):
        for n in _sizes(rng):
            window = _window(rng, n, num_slots)
            _commit_both(eager, graphed, staging, window, sync_free=True)
            assert torch.equal(bits(storages[0].kv), bits(storages[1].kv)), (round_, n)
            assert eager.last_window == graphed.last_window
    assert len(captures) == 3 and graphs.captured == 3
    assert eager.metrics() == graphed.metrics() and graphed.metrics().fallbacks == {}
    assert graphed.metrics().rejected_tokens > 0
    if protected:
        assert graphed.metrics().protected_refusals > 0


@gpu
@needs_cuda
def test_graphs_captured_ahead_for_more_buffers_than_max_graphs_all_stay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Six buffers of three buckets each, 18 graphs against room for 16 captured on first use:
    round after round of commits from every buffer captures nothing. A dropped buffer's graphs
    go, and its next commit captures on first use again, still writing what the eager path
    writes."""
    captures = counted_captures(monkeypatch)
    storages, eager, graphed, make_staging = _twins()
    stagings = [make_staging() for _ in range(6)]
    for staging in stagings:
        assert graphed.graphs.capture_host_writes(staging)
    graphs = graphed.graphs.captured.host
    assert graphs is not None and graphs.captured == len(captures) == 18 > 16
    rng = np.random.default_rng(12)
    num_slots = storages[0].num_slots
    for _ in range(2):
        for staging in stagings:
            for n in _sizes(rng):
                _commit_both(eager, graphed, staging, _window(rng, n, num_slots), sync_free=True)
                assert torch.equal(bits(storages[0].kv), bits(storages[1].kv))
    assert len(captures) == 18 and graphs.captured == 18

    assert graphed.graphs.drop_host_writes(stagings[0]) == 3
    assert graphs.captured == 15 and not graphs.holds(_source(stagings[0]), MIN_ROWS)
    _commit_both(eager, graphed, stagings[0], _window(rng, 10, num_slots), sync_free=False)
    assert len(captures) == 19 and graphs.holds(_source(stagings[0]), MIN_ROWS)
    assert torch.equal(bits(storages[0].kv), bits(storages[1].kv))
    assert eager.metrics() == graphed.metrics()


@gpu
@needs_cuda
def test_a_capture_that_fails_ahead_turns_graphs_off_once_and_commits_write_eagerly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    attempts = failing_captures(monkeypatch)
    storages, eager, graphed, make_staging = _twins()
    staging = make_staging()
    before = bits(storages[1].kv).clone()
    with caplog.at_level(logging.WARNING, logger="kvalloc.allocator.nwor.host_write_graphs"):
        assert graphed.graphs.capture_host_writes(staging) is False
        assert graphed.graphs.capture_host_writes(make_staging()) is False  # no new attempt
        torch.cuda.synchronize()
        assert torch.equal(bits(storages[1].kv), before)  # the real warm-up wrote nothing
        graphs = graphed.graphs.captured.host
        assert graphs is not None and graphs.failed and graphs.captured == 0
        assert len(attempts) == 1
        rng = np.random.default_rng(13)
        for n in _sizes(rng) * 2:
            _commit_both(eager, graphed, staging, _window(rng, n, storages[0].num_slots),
                         sync_free=False)
            assert torch.equal(bits(storages[0].kv), bits(storages[1].kv)), n
    assert len(attempts) == 1 and graphs.captured == 0
    assert caplog.text.count(HOST_WRITE_FAILURE) == 1
    assert eager.metrics() == graphed.metrics() and graphed.metrics().fallbacks == {}


@gpu
@needs_cuda
def test_a_window_committed_from_a_buffer_captured_ahead_lands_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the independent expectation, not only the eager path: the committed tokens of a
    window of each bucket, and poison everywhere else."""
    captures = counted_captures(monkeypatch)
    storages, _, graphed, make_staging = _twins()
    staging = make_staging()
    assert graphed.graphs.capture_host_writes(staging)
    rng = np.random.default_rng(14)
    cfg = storages[1].config
    for n in _sizes(rng):
        layout, slots, accepted = _window(rng, n, storages[1].num_slots)
        keys = staging[:, 0, :n]
        window = Window(layout, torch.from_numpy(slots).cuda(), keys, staging[:, 1, :n],
                        list(range(cfg.num_layers)), [], accepted)
        want = expected_after(storages[1].kv, window, window.keep(), None)
        with no_host_sync():
            graphed.begin_window(layout)
            graphed.stage_from(staging, slots)
            graphed.commit(accepted)
        assert torch.equal(bits(storages[1].kv), bits(want)), n
    assert len(captures) == 3


# ---- through the service ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_the_service_captures_a_workers_graphs_at_registration_and_drops_them_with_it(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, registration captures every bucket of the worker's buffer; the worker's steps
    capture nothing (block-table syncs included: the table's graphs were captured with it) and
    commit exactly the accepted tokens; its graphs go when it deregisters or its lease expires.
    On CPU the same calls run and capture nothing."""
    captures = counted_captures(monkeypatch)
    from kvalloc.allocator import PoolConfig
    from kvalloc.server.client import Client
    from kvalloc.server.service.core import ServiceCore
    from kvalloc.server.service.settings import ServiceConfig
    from service_harness import nwor_scenario

    now = [1000.0]
    core = ServiceCore(ServiceConfig(pool=PoolConfig(
        device=device, num_blocks=64, tokens_per_block=16, num_layers=2, num_kv_heads=2,
        head_dim=64, max_batch_size=16, max_seq_len=256), max_step_tokens=256,
        lease_ttl_s=30.0), clock=lambda: now[0])
    made = len(captures)  # the block table's, with the core
    buckets = len(row_buckets(256, 256))
    writes = core.pool.committer.writes
    try:
        first = Client.in_process(core, worker_id="first")
        first.register()

        def captured() -> int:
            host = writes.graphs.captured.host
            return 0 if host is None else host.captured

        assert captured() == len(captures) - made == (buckets if device == "cuda" else 0)
        registered = len(captures)
        outcome = nwor_scenario(first, None)
        assert outcome.mismatches == [] and outcome.commit.written == 5
        assert len(captures) == registered  # the steps captured nothing
        now[0] += 20
        second = Client.in_process(core, worker_id="second")
        second.register()
        assert captured() == (2 * buckets if device == "cuda" else 0)
        now[0] += 15  # the first worker silent for 35 s, past its 30 s lease
        assert core.expire_leases() == 1
        assert captured() == (buckets if device == "cuda" else 0)
        second.deregister()
        assert captured() == 0
        core.check_invariants()
    finally:
        core.close()


@gpu
@needs_cuda
def test_a_manager_with_host_write_graphs_is_freed_by_reference_counting_alone() -> None:
    """The graphs take the write on each call and never keep it: kept, the manager's bound
    method would close a cycle through the graphs, and the cyclic collector would free them
    whenever it happens to run, in another stream's graph capture too (fatal to the process)."""
    import gc
    import weakref

    _, _, graphed, make_staging = _twins()
    staging = make_staging()
    del make_staging  # it reads the manager's staging dtype
    assert graphed.graphs.capture_host_writes(staging)
    graphs = weakref.ref(graphed.graphs.captured.host)
    gone = weakref.ref(graphed)
    gc.disable()
    try:
        del graphed
        assert gone() is None and graphs() is None
    finally:
        gc.enable()
