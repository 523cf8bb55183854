"""`window_maths`: the compiled window loops (numba) against their numpy references, on random
layouts (empty windows, prefill chunks, padded requests, requests that are all drafts) and
counts, and a manager that commits through either gives the same pool, stats and metrics."""

from __future__ import annotations

import kvalloc.allocator.nwor.deferred.device_keep as device_keep
import kvalloc.allocator.nwor.deferred.input_checks as input_checks
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.common.jit import numba
from kvalloc.allocator.errors import NworInputError
from kvalloc.allocator.nwor import window_maths
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.window import WindowLayout
from kvalloc.allocator.nwor.window_maths import (
    INT64_MAX,
    keep_reference,
    token_table_reference,
    window_total_reference,
)
from nwor_scenarios import bits, poisoned_storage, pool_config, random_window

compiled = pytest.mark.skipif(numba is None, reason="numba is not installed")

# Per request (tokens, drafts): padded (0, 0), prefill chunks (n, 0), decodes (1 + d, d), and
# requests the service dropped (n, n: every token a draft).
requests = st.integers(0, 7).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n)))


@st.composite
def windows(draw: st.DrawFn, *, bad_counts: bool = False) -> tuple[np.ndarray, ...]:
    """(num_tokens, num_draft, accepted, slots, positions) of one window; ``slots`` empty
    for a window whose slots are not on the host."""
    layout = draw(st.lists(requests, max_size=12))
    tokens = np.array([n for n, _ in layout], dtype=np.int64)
    drafts = np.array([d for _, d in layout], dtype=np.int64)
    accepted = np.array([draw(st.integers(0, d)) for d in drafts.tolist()], dtype=np.int64)
    if bad_counts and layout:
        for r in draw(st.lists(st.integers(0, len(layout) - 1), min_size=1, max_size=3)):
            accepted[r] = draw(st.sampled_from([-1, -5, drafts[r] + 1, drafts[r] + 4]))
    total = int(tokens.sum())
    slots = (np.array(draw(st.lists(st.integers(-1, 99), min_size=total, max_size=total)),
                      dtype=np.int64)
             if draw(st.booleans()) else np.zeros(0, dtype=np.int64))
    for array in (tokens, drafts):  # as a layout holds them
        array.flags.writeable = False
    return tokens, drafts, accepted, slots, draw(st.integers(1, 5))


def _same(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype == np.int64
            assert a.shape == b.shape and np.array_equal(a, b)
        else:
            assert type(a) is type(b) is int and a == b


def test_the_reference_keeps_each_requests_leading_tokens():
    """Request 0: 3 tokens, the last 2 drafts, 1 accepted; request 1: a prefill chunk of 2;
    request 2: padding; request 3: 3 drafts all accepted (positions 2: the last bucket also
    counts the third draft)."""
    tokens, drafts = np.array([3, 2, 0, 3]), np.array([2, 0, 0, 3])
    slots = np.array([10, 11, 12, 13, -1, 20, 21, 22])
    bad, kept, per_position, committed, written = keep_reference(
        tokens, drafts, np.array([1, 0, 0, 3]), slots, 2)
    assert bad == -1
    assert kept.tolist() == [10, 11, -1, 13, -1, 20, 21, 22]
    assert per_position.tolist() == [2, 2] and (committed, written) == (7, 6)
    assert token_table_reference(tokens, drafts, 2).tolist() == [
        [0, -1, 2], [0, 0, 0], [0, 1, 1], [1, -2, 2], [1, -1, 2], [3, 0, 0], [3, 1, 1],
        [3, 2, 1]]


@pytest.mark.parametrize(("accepted", "bad"), [([-1, 9, 0, -2], 0), ([0, 9, 0, -2], 3),
                                               ([0, 9, 1, 0], 1), ([0, 1, 0, 4], 3)])
def test_a_negative_count_is_named_before_one_above_its_drafts(accepted, bad):
    tokens, drafts = np.array([3, 2, 1, 3]), np.array([2, 1, 0, 3])
    for keep in (keep_reference, window_maths.keep):
        got = keep(tokens, drafts, np.array(accepted), np.arange(9), 3)
        _same(got, (bad, np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 0))


@compiled
@settings(max_examples=400, deadline=None)
@given(windows())
def test_the_compiled_keep_equals_the_reference(window):
    _same(window_maths.keep(*window), keep_reference(*window))


@compiled
@settings(max_examples=200, deadline=None)
@given(windows(bad_counts=True))
def test_the_compiled_keep_names_the_same_bad_count(window):
    _same(window_maths.keep(*window), keep_reference(*window))


@compiled
@settings(max_examples=300, deadline=None)
@given(windows())
def test_the_compiled_token_table_equals_the_reference(window):
    tokens, drafts, _, _, positions = window
    got = window_maths.token_table(tokens, drafts, positions)
    want = token_table_reference(tokens, drafts, positions)
    assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want)
    assert got.shape == (int(tokens.sum()), 3)


@compiled
@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.lists(st.tuples(st.integers(0, INT64_MAX), st.integers(-3, INT64_MAX)), max_size=6),
    st.lists(requests, max_size=12)))
def test_the_compiled_window_total_equals_the_reference(counts):
    """Counts anywhere in int64 (totals past it saturate), drafts above tokens or negative."""
    tokens = np.array([n for n, _ in counts], dtype=np.int64)
    drafts = np.array([d for _, d in counts], dtype=np.int64)
    got, want = window_maths.window_total(tokens, drafts), window_total_reference(tokens, drafts)
    assert type(got) is type(want) is int and got == want


def test_a_layout_past_int64_tokens_in_all_is_refused_by_the_window():
    storage = poisoned_storage(pool_config("cpu"))
    mgr = DeferredWriteManager(storage, max_tokens=48)
    layout = WindowLayout((2**62, 2**62), (0, 0))
    assert layout.total_tokens == INT64_MAX
    with pytest.raises(NworInputError, match="exceed max_tokens"):
        mgr.begin_window(layout)
    assert not mgr.window_open


def _run_windows(counts: str, slots: str) -> list:
    """Random windows committed from a caller buffer: every stats, the pool, the metrics."""
    storage = poisoned_storage(pool_config("cpu"))
    mgr = DeferredWriteManager(storage, max_tokens=48, backend="torch")
    rng = np.random.default_rng(41)
    seen = []
    for _ in range(12):
        window = random_window(rng, storage, max_tokens=48, stage_dtype=mgr.spec.stage_dtype)
        n = window.layout.total_tokens
        staging = torch.zeros((storage.config.num_layers, 2, 48, *window.keys.shape[2:]),
                              dtype=mgr.spec.stage_dtype)
        staging[:, 0, :n], staging[:, 1, :n] = window.keys, window.values
        mgr.begin_window(window.layout)
        mgr.stage_from(staging, window.slots.numpy() if slots == "host" else window.slots)
        mgr.commit(window.accepted if counts == "host" else torch.tensor(window.accepted))
        seen.append(mgr.last_window)
    return [*seen, mgr.metrics(), bits(storage.kv).tolist()]


@compiled
@pytest.mark.parametrize(("counts", "slots"), [("host", "host"), ("host", "tensor"),
                                               ("tensor", "host")])
def test_a_manager_commits_the_same_through_the_compiled_loops_and_the_references(
        counts, slots, monkeypatch):
    compiled_run = _run_windows(counts, slots)
    monkeypatch.setattr(input_checks, "keep", keep_reference)
    monkeypatch.setattr(device_keep, "token_table", token_table_reference)
    assert _run_windows(counts, slots) == compiled_run
