"""`mask_rejected`: counts -> keep mask -> rejected slots at -1 (and the window's counters), the
same from the torch path and the Triton kernel (interpreted on the CPU, compiled on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator.nwor.keep_mask import NEVER, mask_rejected
from triton_interpreter import needs_triton_interpreter

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
POSITIONS = 3


def _window(rng: np.random.Generator, *, invalid: bool, max_requests: int = 12,
            capacity: int = 64, layers: int = 3):
    """Buffers laid out as DeferredWriteManager lays them out, for a random window."""
    reqs = int(rng.integers(1, max_requests + 1))
    drafts = rng.integers(0, 5, reqs)
    tokens = drafts + 1 + rng.integers(0, 3, reqs) * (drafts == 0)  # some prefill chunks
    while tokens.sum() > capacity:
        tokens, drafts, reqs = tokens[:-1], drafts[:-1], reqs - 1
    total = int(tokens.sum())
    request = np.repeat(np.arange(reqs), tokens)
    draft_index = np.arange(total) - np.repeat(np.cumsum(tokens) - drafts, tokens)
    bucket = np.where(draft_index < 0, POSITIONS, np.minimum(draft_index, POSITIONS - 1))
    meta = np.tile(np.array([0, NEVER, POSITIONS]), (capacity, 1))
    meta[:total] = np.stack([request, draft_index, bucket], axis=1)
    accepted = np.zeros(max_requests, dtype=np.int64)
    accepted[:reqs] = rng.integers(0, drafts + 1)
    if invalid:
        r = int(rng.integers(reqs))
        accepted[r] = drafts[r] + 1 if rng.random() < 0.5 else -1
    limits = np.full(max_requests + 1, NEVER)
    limits[:reqs] = drafts
    limits[-1] = total
    slots = rng.permutation(1000)[: layers * capacity].reshape(layers, capacity)
    keep = draft_index < accepted[request]
    return (torch.from_numpy(meta), torch.from_numpy(accepted), torch.from_numpy(limits),
            torch.from_numpy(slots), total, keep)


def _run(backend: str, device: str, args, rows: int):
    meta, accepted, limits, slots = (t.to(device) for t in args)
    out = torch.full_like(slots, -7)
    counters = (torch.full((3,), 99, device=device), torch.ones(3, dtype=torch.int64,
                                                                device=device),
                torch.zeros(POSITIONS + 1, dtype=torch.int64, device=device))
    mask_rejected(meta, accepted, limits, slots, rows, out, counters, backend=backend)
    return out.cpu(), [c.cpu() for c in counters]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("invalid", [False, True])
def test_rejected_slots_are_minus_one_and_counters_add_up(device, invalid):
    rng = np.random.default_rng(31 + invalid)
    for _ in range(10):
        *args, total, keep = _window(rng, invalid=invalid)
        rows = int(rng.integers(total, 65))  # graph replays cover padded rows too
        out, (window, cumulative, per_position) = _run("torch", device, args, rows)
        slots = args[3]
        want_keep = np.ones(total, bool) if invalid else keep
        assert torch.equal(out[:, :total], torch.where(torch.from_numpy(want_keep),
                                                       slots[:, :total], -1))
        assert (out[:, total:rows] == -1).all() and (out[:, rows:] == -7).all()
        committed = 0 if invalid else int(keep.sum())
        assert window.tolist() == [committed, int(invalid), total if invalid else 0]
        assert cumulative.tolist() == [1 + committed, 1 + int(invalid),
                                       1 + (total if invalid else 0)]
        buckets = args[0][:total, 2].numpy()
        counted = buckets[keep] if not invalid else buckets[:0]
        assert per_position.tolist() == np.bincount(counted, minlength=POSITIONS + 1).tolist()


@needs_triton_interpreter
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("invalid", [False, True])
def test_triton_kernel_equals_torch_path(device, invalid):
    rng = np.random.default_rng(41 + invalid)
    for _ in range(4 if device == "cpu" else 20):
        *args, total, _ = _window(rng, invalid=invalid)
        rows = int(rng.integers(total, 65))
        want_out, want_counters = _run("torch", device, args, rows)
        got_out, got_counters = _run("triton", device, args, rows)
        assert torch.equal(got_out, want_out)
        for got, want in zip(got_counters, want_counters, strict=True):
            assert torch.equal(got, want)


def test_zero_rows_only_reset_the_window_counters():
    *args, _, _ = _window(np.random.default_rng(5), invalid=False)
    out, (window, cumulative, _) = _run("torch", "cpu", args, 0)
    assert (out == -7).all() and window.tolist() == [0, 0, 0] and cumulative.tolist() == [1] * 3
