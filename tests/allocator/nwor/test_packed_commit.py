"""The one device commit, from both of its callers: the service's `DeferredWriteManager` (a
window of draft indices and accepted counts) and an overlap worker's `PackedCommit` (each token's
index in its entry and each entry's kept tokens) leave the same pool bytes and count the same
committed and refused tokens, for random windows with protected blocks, on every backend (on a
GPU too)."""

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

LAYERS, TPB, BLOCKS = 2, 4, 24
# Per layout: (planes, heads, head_dim): K and V of two heads, or one MLA latent of 12.
LAYOUTS = {"kv": (2, 2, 4), "latent": (1, 1, 12)}


def _storage(device: str, layout: str = "kv") -> KVStorage:
    _, heads, dim = LAYOUTS[layout]
    cfg = PoolConfig(num_blocks=BLOCKS, tokens_per_block=TPB, num_layers=LAYERS,
                     num_kv_heads=heads, head_dim=dim, kv_layout=layout, max_seq_len=64,
                     dtype="float32", device=device)
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
    on = storage.kv.device
    mgr = DeferredWriteManager(storage, max_tokens=32, backend=backend)
    mgr.protect(torch.from_numpy(protected).to(on))
    mgr.begin_window(WindowLayout.of_arrays(num_tokens, drafts))
    mgr.stage_from(staged, torch.from_numpy(slots).to(on))
    mgr.commit(torch.from_numpy(accepted).to(on))
    metrics = mgr.metrics()
    mgr.check_invariants()
    return metrics.committed_tokens, metrics.protected_refusals


def _worker(storage: KVStorage, window: tuple[np.ndarray, ...], staged: torch.Tensor,
            backend: str) -> tuple[int, int]:
    num_tokens, drafts, accepted, slots, protected = window
    entry = np.repeat(np.arange(num_tokens.size), num_tokens)
    index = np.arange(entry.size) - (np.cumsum(num_tokens) - num_tokens)[entry]
    kept = num_tokens - drafts + accepted
    capacity, on = staged.shape[2], storage.kv.device
    _, planes, _, row = storage.rows().shape
    commit = PackedCommit(storage.rows(), staged.view(LAYERS, planes, capacity, row), TPB,
                          protected=torch.from_numpy(protected).to(on), backend=backend)
    commit.commit(*(torch.from_numpy(a).to(on) for a in (slots, index, entry, kept, num_tokens)))
    return int(commit.committed), commit.refused


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(("backend", "device"), [
    ("torch", "cpu"), pytest.param("triton", "cpu", marks=needs_triton_interpreter),
    pytest.param("triton", "cuda", marks=GPU), pytest.param("torch", "cuda", marks=GPU)])
@settings(max_examples=25, deadline=None)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@given(window=windows())
def test_both_callers_leave_the_same_pool_and_counts(window: tuple[np.ndarray, ...],
                                                     backend: str, device: str,
                                                     layout: str) -> None:
    planes, heads, dim = LAYOUTS[layout]
    staged = torch.randn(LAYERS, planes, 32, heads, dim, device=device)
    service, worker = _storage(device, layout), _storage(device, layout)
    counts = _service(service, window, staged, backend)
    assert _worker(worker, window, staged, backend) == counts
    assert torch.equal(service.kv.view(torch.int32), worker.kv.view(torch.int32))
    num_tokens, drafts, accepted, _, protected = window
    assert counts[0] == int((num_tokens - drafts + accepted).sum())
    written = ~service.kv.isnan().view(LAYERS, planes, BLOCKS * TPB, -1).all(-1).cpu()
    assert not written[:, :, protected.repeat(TPB)].any()  # never into a protected block
