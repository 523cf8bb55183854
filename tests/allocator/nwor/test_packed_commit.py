"""The one device commit, from both of its callers: the service's `DeferredWriteManager` (a
window of draft indices and accepted counts) and an overlap worker's `PackedCommit` (each token's
index in its entry and each entry's kept tokens) leave the same pool bytes and count the same
committed and refused tokens, for random windows with protected blocks, on every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator import (
    DeferredWriteManager,
    KVStorage,
    PackedCommit,
    PoolConfig,
    WindowLayout,
)
from triton_interpreter import needs_triton_interpreter

LAYERS, HEADS, DIM, TPB, BLOCKS = 2, 2, 4, 4, 24


def _storage() -> KVStorage:
    cfg = PoolConfig(num_blocks=BLOCKS, tokens_per_block=TPB, num_layers=LAYERS,
                     num_kv_heads=HEADS, head_dim=DIM, max_seq_len=64, dtype="float32",
                     device="cpu")
    storage = KVStorage(cfg)
    storage.kv.fill_(float("nan"))
    return storage


@st.composite
def windows(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    """Per request: tokens, drafts among them, accepted drafts; per token a distinct slot or -1;
    per block whether it is protected."""
    requests = draw(st.integers(1, 6))
    num_tokens = np.array([draw(st.integers(1, 5)) for _ in range(requests)])
    drafts = np.array([draw(st.integers(0, n)) for n in num_tokens])
    accepted = np.array([draw(st.integers(0, d)) for d in drafts])
    total = int(num_tokens.sum())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    slots = rng.permutation(BLOCKS * TPB)[:total]
    slots[rng.random(total) < 0.15] = -1
    protected = rng.random(BLOCKS) < 0.3
    return num_tokens, drafts, accepted, slots, protected


def _service(storage: KVStorage, window: tuple[np.ndarray, ...], staged: torch.Tensor,
             backend: str) -> tuple[int, int]:
    num_tokens, drafts, accepted, slots, protected = window
    mgr = DeferredWriteManager(storage, max_tokens=32, backend=backend)
    mgr.protect(torch.from_numpy(protected))
    mgr.begin_window(WindowLayout.of_arrays(num_tokens, drafts))
    mgr.stage_from(staged, torch.from_numpy(slots))
    mgr.commit(torch.from_numpy(accepted))
    metrics = mgr.metrics()
    mgr.check_invariants()
    return metrics.committed_tokens, metrics.protected_refusals


def _worker(storage: KVStorage, window: tuple[np.ndarray, ...], staged: torch.Tensor,
            backend: str) -> tuple[int, int]:
    num_tokens, drafts, accepted, slots, protected = window
    entry = np.repeat(np.arange(num_tokens.size), num_tokens)
    index = np.arange(entry.size) - (np.cumsum(num_tokens) - num_tokens)[entry]
    kept = num_tokens - drafts + accepted
    capacity = staged.shape[2]
    commit = PackedCommit(storage.rows(), staged.view(LAYERS, 2, capacity, HEADS * DIM), TPB,
                          protected=torch.from_numpy(protected), backend=backend)
    commit.commit(torch.from_numpy(slots), torch.from_numpy(index), torch.from_numpy(entry),
                  torch.from_numpy(kept), torch.from_numpy(num_tokens))
    return int(commit.committed), commit.refused


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton",
                                                           marks=needs_triton_interpreter)])
@settings(max_examples=25, deadline=None)
@given(window=windows())
def test_both_callers_leave_the_same_pool_and_counts(window: tuple[np.ndarray, ...],
                                                     backend: str) -> None:
    staged = torch.randn(LAYERS, 2, 32, HEADS, DIM)
    service, worker = _storage(), _storage()
    counts = _service(service, window, staged, backend)
    assert _worker(worker, window, staged, backend) == counts
    assert torch.equal(service.kv.view(torch.int32), worker.kv.view(torch.int32))
    num_tokens, drafts, accepted, _, protected = window
    assert counts[0] == int((num_tokens - drafts + accepted).sum())
    written = ~service.kv.isnan().view(LAYERS, 2, BLOCKS * TPB, -1).all(-1)
    assert not written[:, :, protected.repeat(TPB)].any()  # never into a protected block
