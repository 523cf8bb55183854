"""NWOR and SCV on the GPU: the fused Triton commit equals the torch path bit for bit, device
commits write exactly the committed tokens, CUDA-graph replays (commit, acceptance + commit, SCV
buckets) equal eager, and commits make no host synchronisation."""

from __future__ import annotations

import contextlib
import random

import kvalloc.allocator.nwor.acceptance as acceptance
import numpy as np
import pytest
import torch
from cuda_checks import no_host_sync
from kvalloc.allocator.nwor.acceptance import ScvAcceptor, ScvMode, acceptance_mask
from kvalloc.allocator.nwor.commit_kernel import write_staged
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.window import WindowLayout
from nwor_scenarios import bits, expected_after, poisoned_storage, pool_config, random_window, stage

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(("pool_dtype", "stage_dtype"), [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (FP8, torch.bfloat16), (FP8, torch.float16), (FP8, torch.float32)])
def test_triton_kernel_equals_torch_path_bit_for_bit_on_gpu(pool_dtype, stage_dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, num_slots, capacity, row = 4, 4096, 1000, 8 * 128
    magnitude = 10.0 ** (torch.rand(layers, 2, capacity, row, device="cuda", generator=gen) * 8
                         - 5)
    staged = (torch.randn(layers, 2, capacity, row, device="cuda", generator=gen)
              * magnitude).to(stage_dtype)
    slots = torch.stack([torch.randperm(num_slots, device="cuda", generator=gen)[:capacity]
                         for _ in range(layers)])
    slots[torch.rand(layers, capacity, device="cuda", generator=gen) < 0.3] = -1
    layer_rows = torch.tensor([capacity, 700, 0, 999], device="cuda")
    inv = None
    if pool_dtype == FP8:
        inv = 1.0 / (torch.rand(layers, 2, device="cuda", generator=gen) * 4 + 0.05)
    pool = torch.zeros(layers, 2, num_slots, row, device="cuda", dtype=pool_dtype)
    ref = pool.clone()
    write_staged(ref, staged, slots, layer_rows, capacity, inv, backend="torch")
    write_staged(pool, staged, slots, layer_rows, capacity, inv, backend="triton")
    assert torch.equal(bits(pool), bits(ref))
    assert bits(pool).count_nonzero() > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_random_windows_commit_exactly_the_accepted_tokens_on_gpu(dtype):
    storage = poisoned_storage(pool_config("cuda", dtype=dtype, scales=dtype == "fp8_e4m3"))
    mgr = DeferredWriteManager(storage, max_tokens=48)
    assert mgr.backend == "triton"
    rng = np.random.default_rng(21)
    for i in range(16):
        window = random_window(rng, storage, max_tokens=48, stage_dtype=mgr.spec.stage_dtype)
        want = expected_after(storage.kv, window, window.keep(), mgr._scales.inv)
        mgr.begin_window(window.layout)
        stage(mgr, window)
        if i % 2:
            accepted = torch.tensor(window.accepted, device="cuda")
            with no_host_sync():
                mgr.commit(accepted)
        else:
            mgr.commit(window.accepted)
        assert torch.equal(bits(storage.kv), bits(want))
        assert mgr.last_window.committed == int(window.keep().sum())
    m = mgr.metrics()
    assert m.fallbacks == {} and m.rejected_tokens > 0
    assert m.staged_tokens == m.committed_tokens + m.rejected_tokens


@pytest.mark.parametrize("known_on", ["device", "host"])
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_stage_from_a_worker_buffer_commits_exactly_the_accepted_tokens_on_gpu(dtype, known_on):
    """Every layer committed straight from a worker's staging buffer, with no host
    synchronisation, in as many launches for 2 layers as for 32: slots and counts as device
    tensors (an engine), or both on the host (the service: the keep mask applied there, the
    commit one graph replay, captured by the first window)."""
    storage = poisoned_storage(pool_config("cuda", dtype=dtype, scales=dtype == "fp8_e4m3"))
    mgr = DeferredWriteManager(storage, max_tokens=48)
    rng = np.random.default_rng(31)
    heads, dim = storage.config.num_kv_heads, storage.config.head_dim
    staging = torch.zeros((storage.config.num_layers, 2, 48, heads, dim),
                          dtype=mgr.spec.stage_dtype, device="cuda")
    for i in range(8):
        window = random_window(rng, storage, max_tokens=48, stage_dtype=mgr.spec.stage_dtype)
        window.staged_layers = list(range(storage.config.num_layers))
        want = expected_after(storage.kv, window, window.keep(), mgr._scales.inv)
        n = window.layout.total_tokens
        staging[:, 0, :n] = window.keys
        staging[:, 1, :n] = window.values
        accepted = torch.tensor(window.accepted, device="cuda")
        slots = window.slots
        if known_on == "host":
            accepted, slots = np.array(window.accepted), slots.cpu().numpy()
        mgr.begin_window(window.layout)
        # The graph's capture synchronises, once: the first window is outside the check.
        with no_host_sync() if i or known_on == "device" else contextlib.nullcontext():
            mgr.stage_from(staging, slots)
            mgr.commit(accepted)
        assert torch.equal(bits(storage.kv), bits(want))
    assert mgr.metrics().fallbacks == {}
    if known_on == "host":
        host = mgr.graphs.captured.host
        assert host is not None and host.captured == 1


@pytest.mark.parametrize("protected", [False, True])
def test_a_host_slot_commit_replays_a_graph_that_writes_what_the_eager_path_writes(protected):
    """Windows of every size bucket, from two staging buffers in turn, with and without
    protected blocks: the pool a manager's graphs write equals, bit for bit, the pool of one
    writing eagerly (the torch path), and so do the window's and the cumulative counts."""
    cfg = pool_config("cuda")
    storages = [poisoned_storage(cfg) for _ in range(2)]
    eager = DeferredWriteManager(storages[0], max_tokens=200, max_requests=64, backend="torch")
    graphed = DeferredWriteManager(storages[1], max_tokens=200, max_requests=64)
    if protected:
        blocks = torch.rand(cfg.total_blocks, generator=torch.Generator().manual_seed(3)) < 0.3
        eager.protect(blocks.cuda())
        graphed.protect(blocks.cuda())
    rng = np.random.default_rng(5)
    stagings = [torch.zeros((cfg.num_layers, 2, 200, cfg.num_kv_heads, cfg.head_dim),
                            dtype=graphed.spec.stage_dtype, device="cuda") for _ in range(2)]
    sizes = set()
    for i in range(24):
        window = random_window(rng, storages[0], max_tokens=200,
                               stage_dtype=graphed.spec.stage_dtype, max_requests=64)
        n = window.layout.total_tokens
        sizes.add(graphed_rows := min(200, max(64, 1 << max(0, n - 1).bit_length())))
        staging = stagings[i % 2]
        staging[:, 0, :n] = window.keys
        staging[:, 1, :n] = window.values
        for mgr in (eager, graphed):
            mgr.begin_window(window.layout)
            mgr.stage_from(staging, window.slots.cpu().numpy())
            mgr.commit(np.array(window.accepted))
        assert torch.equal(bits(storages[0].kv), bits(storages[1].kv)), (i, n, graphed_rows)
        assert eager.last_window == graphed.last_window
    assert eager.graphs.captured.host is None
    host = graphed.graphs.captured.host
    assert host is not None and host.captured >= len(sizes) > 1
    assert eager.metrics() == graphed.metrics()
    if protected:
        assert graphed.metrics().protected_refusals > 0


def _twin_managers():
    """Two identical poisoned pools: one commits eagerly, the other replays a captured graph."""
    storages = [poisoned_storage(pool_config("cuda")) for _ in range(2)]
    eager, graphed = (DeferredWriteManager(s, max_tokens=64) for s in storages)
    return storages, eager, graphed


def test_commit_graph_replay_equals_eager_and_never_syncs():
    (s_eager, s_graph), eager, graphed = _twin_managers()
    graphed.graphs.capture_commit(48)
    rng = np.random.default_rng(22)
    for _ in range(12):
        window = random_window(rng, s_eager, max_tokens=48, stage_dtype=torch.bfloat16)
        want = expected_after(s_eager.kv, window, window.keep(), None)
        for mgr in (eager, graphed):
            mgr.begin_window(window.layout)
            stage(mgr, window)
        accepted = torch.tensor(window.accepted, device="cuda")
        with no_host_sync():
            eager.commit(accepted)
            graphed.commit(accepted)
        assert graphed.last_window.path == "graph" and eager.last_window.path == "device"
        assert torch.equal(bits(s_graph.kv), bits(want))
        assert torch.equal(bits(s_eager.kv), bits(want))
    assert graphed.metrics() == eager.metrics()


def _verify_inputs(rng: np.random.Generator, layout: WindowLayout, accepted: list[int],
                   width: int, flat: bool):
    """Drafts and a rejection sampler's output that accepts exactly ``accepted`` per request."""
    drafts = [rng.integers(0, 1000, d).tolist() for d in layout.num_draft]
    sampled = []
    for d, a in zip(drafts, accepted, strict=True):
        row = d[:a] + ([1000 + a] if a < len(d) else [7])  # recovered (mismatching) or bonus
        sampled.append(row + [-1] * (width - len(row)))
    sampled_t = torch.tensor(sampled, device="cuda")
    if flat:
        return torch.tensor([t for d in drafts for t in d], device="cuda",
                            dtype=torch.int64), sampled_t
    padded = torch.full((len(drafts), width - 1), -3, device="cuda")
    for r, d in enumerate(drafts):
        padded[r, : len(d)] = torch.tensor(d, device="cuda")
    return padded, sampled_t


@pytest.mark.parametrize("flat", [False, True])
def test_verify_graph_captures_acceptance_and_commit_in_one_replay(flat):
    (s_eager, s_graph), eager, graphed = _twin_managers()
    graphed.graphs.capture_verify(48, max_requests=8, width=6, flat_drafts=flat)
    rng = np.random.default_rng(23)
    for _ in range(10):
        window = random_window(rng, s_eager, max_tokens=48, stage_dtype=torch.bfloat16)
        want = expected_after(s_eager.kv, window, window.keep(), None)
        draft_ids, sampled_ids = _verify_inputs(rng, window.layout, window.accepted, 6, flat)
        for mgr in (eager, graphed):
            mgr.begin_window(window.layout)
            stage(mgr, window)
        with no_host_sync():
            counts_eager = eager.verify_and_commit(draft_ids, sampled_ids)
            counts_graph = graphed.verify_and_commit(draft_ids, sampled_ids)
        assert counts_graph.tolist() == counts_eager.tolist() == window.accepted
        assert graphed.last_window.path == "graph"
        assert torch.equal(bits(s_graph.kv), bits(want))
        assert torch.equal(bits(s_eager.kv), bits(want))
    assert graphed.metrics() == eager.metrics()


def _random_batch(rng: random.Random, batch: int, max_drafts: int, flat: bool):
    drafts = [[rng.randrange(3) for _ in range(rng.randint(0, max_drafts))]
              for _ in range(batch)]
    sampled = torch.tensor(
        [[rng.randrange(3) for _ in range(max_drafts + 1)] for _ in range(batch)], device="cuda")
    n = [len(d) for d in drafts]
    if flat:
        draft_ids = torch.tensor([t for d in drafts for t in d], device="cuda",
                                 dtype=torch.int64)
    else:
        draft_ids = torch.full((batch, max_drafts), -1, device="cuda")
        for r, d in enumerate(drafts):
            draft_ids[r, : len(d)] = torch.tensor(d, device="cuda", dtype=torch.int64)
    return draft_ids, sampled, n


@pytest.mark.parametrize("mode", [ScvMode.GRAPH, ScvMode.ADAPTIVE])
def test_scv_graph_and_adaptive_equal_eager_exactly(mode):
    acceptor = ScvAcceptor(mode, max_graphs=3)
    rng = random.Random(24)
    for i in range(60):
        batch = rng.choice([1, 5, 33, 64, 200, 256])
        draft_ids, sampled, n = _random_batch(rng, batch, rng.choice([1, 3, 4, 7]), i % 2 == 0)
        want_mask, want_counts = acceptance_mask(draft_ids, sampled, n)
        mask, counts = acceptor(draft_ids, sampled, torch.tensor(n, device="cuda"))
        assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)
    stats = acceptor.stats
    assert stats.fallbacks == {}
    assert stats.evictions > 0 and acceptor.num_graphs <= 3
    if mode is ScvMode.GRAPH:
        assert stats.graph_replays > 0
    else:
        assert stats.adaptive_choice and set(stats.adaptive_choice.values()) <= {"graph", "eager"}


def test_scv_graph_replay_is_sync_free_with_device_counts():
    acceptor = ScvAcceptor(ScvMode.GRAPH)
    draft_ids, sampled, n = _random_batch(random.Random(25), 256, 3, False)
    counts_dev = torch.tensor(n, device="cuda")
    acceptor(draft_ids, sampled, counts_dev)  # capture outside the check
    with no_host_sync():
        mask, counts = acceptor(draft_ids, sampled, counts_dev)
    assert torch.equal(mask, acceptance_mask(draft_ids, sampled, n)[0])
    assert torch.equal(counts, acceptance_mask(draft_ids, sampled, n)[1])
    assert acceptor.stats.graph_replays == 2


def test_scv_capture_failure_falls_back_to_eager_once_per_bucket(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("capture not supported")

    monkeypatch.setattr(acceptance, "capture_graph", broken)
    acceptor = ScvAcceptor(ScvMode.GRAPH)
    draft_ids, sampled, n = _random_batch(random.Random(26), 20, 3, True)
    for _ in range(3):
        _, counts = acceptor(draft_ids, sampled, n)
        assert torch.equal(counts, acceptance_mask(draft_ids, sampled, n)[1])
    assert acceptor.stats.fallbacks == {"capture_failed": 1}
    assert acceptor.stats.eager_calls == 3 and acceptor.num_graphs == 0
