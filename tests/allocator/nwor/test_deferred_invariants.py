"""`DeferredWriteManager.check_invariants`: it holds after every call of every window path (host
counts, device counts, verify, stage_layer or stage_from with device or host slots, fallbacks,
cancels, protected blocks, fp8 overrides), and it fails when any part's state contradicts
itself. A closed window keeps nothing of what it staged. The ``gpu`` test checks the same of a
commit graph captured after a window staged from a caller's buffer."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from kvalloc.allocator.errors import AcceptedExceedsDrafts, InvariantViolation, NworInputError
from kvalloc.allocator.nwor.acceptance import StaticAcceptance
from kvalloc.allocator.nwor.deferred.graphs import CapturedCommit
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.window import WindowLayout, WindowStats
from nwor_scenarios import bits, expected_after, poisoned_storage, pool_config, random_window, stage

TOKENS = 48


def _manager(dtype: str = "bfloat16", device: str = "cpu") -> DeferredWriteManager:
    storage = poisoned_storage(pool_config(device, dtype=dtype, scales=dtype == "fp8_e4m3"))
    return DeferredWriteManager(storage, max_tokens=TOKENS, backend="torch")


def _window(rng: np.random.Generator, mgr: DeferredWriteManager):
    """A random window of at least two tokens, so that one layer can hold part of it."""
    while (window := random_window(rng, mgr.storage, max_tokens=TOKENS,
                                   stage_dtype=mgr.spec.stage_dtype)).layout.total_tokens < 2:
        pass
    return window


def _staging(mgr: DeferredWriteManager, window) -> torch.Tensor:
    """The caller's own ``[L, 2, TOKENS, H, D]`` buffer holding ``window``'s K/V."""
    num_layers, n, heads, dim = window.keys.shape
    staging = torch.zeros((num_layers, 2, TOKENS, heads, dim), dtype=mgr.spec.stage_dtype,
                          device=window.keys.device)
    staging[:, 0, :n], staging[:, 1, :n] = window.keys, window.values
    return staging


def _verify_inputs(window) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded drafts and a sampler's output that accepts exactly ``window.accepted``."""
    drafts = [[10 * r + j for j in range(d)] for r, d in enumerate(window.layout.num_draft)]
    sampled = [d[:a] + [-2] + [-1] * (4 - a) for d, a in zip(drafts, window.accepted,
                                                              strict=True)]
    return torch.tensor([d + [-1] * (4 - len(d)) for d in drafts]), torch.tensor(sampled)


ENDINGS = ["host counts", "device counts", "verify", "from buffer, device slots",
           "from buffer, host slots", "from buffer, host slots, device counts", "partly staged",
           "cancel", "bad counts"]


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_the_invariants_hold_after_every_call_of_every_window_path(dtype: str) -> None:
    mgr = _manager(dtype)
    check = mgr.check_invariants
    storage = mgr.storage
    blocks = torch.rand(storage.config.total_blocks, generator=torch.Generator().manual_seed(4))
    rng = np.random.default_rng(9)
    check()
    for i in range(3 * len(ENDINGS)):
        ending = ENDINGS[i % len(ENDINGS)]
        if i == len(ENDINGS):
            mgr.protect(blocks < 0.3)
            check()
        window = _window(rng, mgr)
        mgr.begin_window(window.layout)
        check()
        if ending.startswith("from buffer"):
            slots = window.slots.numpy() if "host slots" in ending else window.slots
            mgr.stage_from(_staging(mgr, window), slots)
        elif ending == "partly staged":
            n = window.layout.total_tokens
            mgr.stage_layer(0, window.keys[0], window.values[0], window.slots)
            mgr.stage_layer(1, window.keys[1, : n // 2], window.values[1, : n // 2],
                            window.slots[: n // 2])
        else:
            for layer in window.staged_layers:  # fp8: the first layer's scales overridden
                mgr.stage_layer(layer, window.keys[layer], window.values[layer], window.slots,
                                k_scale=0.5 if layer == window.staged_layers[0] else None)
        check()
        if ending == "verify":
            assert mgr.verify_and_commit(*_verify_inputs(window)).tolist() == window.accepted
        elif ending == "cancel":
            mgr.cancel("abandoned")
        elif ending == "bad counts":
            mgr.commit(torch.tensor([d + 1 for d in window.layout.num_draft]))
        elif "device counts" in ending:
            mgr.commit(torch.tensor(window.accepted))
        else:
            mgr.commit(window.accepted)
        check()
    m = mgr.metrics()
    assert m.windows == 3 * len(ENDINGS) and m.protected_refusals > 0
    assert set(m.fallbacks) == {"incomplete_staging", "abandoned", "accepted_out_of_range"}


def test_a_refused_call_leaves_the_invariants_holding() -> None:
    mgr = _manager()
    mgr.begin_window(WindowLayout.decode([2]))
    k = torch.zeros(3, 32, dtype=mgr.spec.stage_dtype)
    with pytest.raises(NworInputError, match="layer"):
        mgr.stage_layer(7, k, k, torch.arange(3))
    with pytest.raises(AcceptedExceedsDrafts):
        mgr.commit([3])
    mgr.check_invariants()
    mgr.stage_layer(0, k, k, torch.arange(3))
    mgr.commit([1])
    mgr.check_invariants()


def test_a_closed_window_keeps_nothing_it_staged() -> None:
    """Not the caller's buffer (it may be released), nor its host slots or rows: a capture
    between windows reads the manager's own staging."""
    mgr = _manager()
    window = random_window(np.random.default_rng(3), mgr.storage, max_tokens=TOKENS,
                           stage_dtype=mgr.spec.stage_dtype)
    staging = _staging(mgr, window)
    released = weakref.ref(staging)
    mgr.begin_window(window.layout)
    mgr.stage_from(staging, window.slots.numpy())
    assert mgr.staged_rows(0) == window.layout.total_tokens
    mgr.commit(window.accepted)
    del staging
    gc.collect()
    assert released() is None
    layers = mgr.spec.num_layers
    assert [mgr.staged_rows(layer) for layer in range(layers)] == [0] * layers
    mgr.check_invariants()


def _plant(mgr: DeferredWriteManager, part: str) -> None:
    """One contradiction in one part's state."""
    if part == "counters":
        mgr._counters.staged_tokens += 1
    elif part == "last window":
        mgr._counters.last = WindowStats(1, 1, 0, 0, "fast")
    elif part == "staging":
        mgr._staging.host_slots = np.zeros(3, dtype=np.int64)
    elif part == "keep tables":
        mgr._keep.tokens[TOKENS - 1, 1] = 0
    elif part == "protection":
        mgr._protection.blocks = torch.zeros(3, dtype=torch.bool)
    elif part == "graphs":
        acceptance = StaticAcceptance(flat=True, batch=2, width=4, device=mgr.spec.device)
        mgr.graphs.captured.commit.append(CapturedCommit(8, None, acceptance))  # type: ignore[arg-type]
    elif part == "fp8 scales":
        assert mgr._scales.inv is not None
        mgr._scales.inv[1, 0] = 3.0
    else:
        raise AssertionError(part)


@pytest.mark.parametrize(("part", "seen"), [
    ("counters", "staged != committed"), ("last window", "last window"),
    ("staging", "closed window"), ("keep tables", "padding"), ("protection", "mask"),
    ("graphs", "commit graph with acceptance"), ("fp8 scales", "nobody overrode")])
def test_the_check_sees_each_part_contradict_itself(part: str, seen: str) -> None:
    mgr = _manager("fp8_e4m3")
    mgr.check_invariants()
    _plant(mgr, part)
    with pytest.raises(InvariantViolation, match=seen):
        mgr.check_invariants()


def test_an_open_window_staged_past_its_tokens_is_a_violation() -> None:
    mgr = _manager()
    mgr.begin_window(WindowLayout.decode([1]))
    mgr._staging.rows[0] = 5
    with pytest.raises(InvariantViolation, match="past the window"):
        mgr.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_commit_graph_captured_after_a_window_from_a_callers_buffer_reads_its_own() -> None:
    """Captured between windows, the commit graph reads the manager's staging, not the buffer
    the window before staged from: replayed, it writes exactly the committed tokens."""
    mgr = DeferredWriteManager(poisoned_storage(pool_config("cuda")), max_tokens=TOKENS)
    storage, rng = mgr.storage, np.random.default_rng(27)
    first = random_window(rng, storage, max_tokens=TOKENS, stage_dtype=mgr.spec.stage_dtype)
    mgr.begin_window(first.layout)
    mgr.stage_from(_staging(mgr, first), first.slots)
    mgr.commit(first.accepted)
    mgr.graphs.capture_commit(TOKENS)
    for _ in range(4):
        window = random_window(rng, storage, max_tokens=TOKENS, stage_dtype=mgr.spec.stage_dtype)
        want = expected_after(storage.kv, window, window.keep(), None)
        mgr.begin_window(window.layout)
        stage(mgr, window)
        mgr.commit(torch.tensor(window.accepted, device="cuda"))
        assert mgr.last_window is not None and mgr.last_window.path == "graph"
        assert torch.equal(bits(storage.kv), bits(want))
        mgr.check_invariants()
