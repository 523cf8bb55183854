"""`DeferredWriteManager` on the CPU: exactly the committed tokens reach the pool, every other
slot keeps its poison, bad input changes nothing, and any failure falls back without loss."""

from __future__ import annotations

import kvalloc.allocator.nwor.deferred.pool_writes as pool_writes
import kvalloc.allocator.nwor.packed_commit as packed_commit
import numpy as np
import pytest
import torch
from kvalloc.allocator.errors import (
    AcceptedExceedsDrafts,
    InvalidValue,
    NworInputError,
    SlotDtypeError,
    StagingOverflow,
    WindowStateError,
)
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.window import WindowLayout, WindowStats
from nwor_scenarios import (
    POISON_BITS,
    bits,
    expected_after,
    poisoned_storage,
    pool_config,
    random_window,
    stage,
)
from triton_interpreter import needs_triton_interpreter

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton_interpreter)]


def _manager(dtype: str = "bfloat16", backend: str = "torch", kv_layout: str = "kv", **kw):
    cfg = pool_config("cpu", dtype=dtype, scales=dtype == "fp8_e4m3", kv_layout=kv_layout)
    storage = poisoned_storage(cfg)
    return storage, DeferredWriteManager(storage, max_tokens=48, backend=backend, **kw)


def _tokens(n: int, row: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, row, generator=gen).bfloat16(),
            torch.randn(n, row, generator=gen).bfloat16())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "kv_layout"), [
    ("bfloat16", "kv"), ("fp8_e4m3", "kv"),
    # An MLA latent pool: one plane of one 40-wide head, one fp8 scale per layer.
    ("float32", "latent"), ("bfloat16", "latent"), ("fp8_e4m3", "latent")])
def test_random_windows_commit_exactly_the_accepted_tokens(dtype, kv_layout, backend):
    storage, mgr = _manager(dtype, backend, kv_layout)
    rng = np.random.default_rng(11)
    for _ in range(12 if backend == "torch" else 4):
        window = random_window(rng, storage, max_tokens=48, stage_dtype=mgr.spec.stage_dtype)
        want = expected_after(storage.kv, window, window.keep(), mgr._scales.inv)
        mgr.begin_window(window.layout)
        stage(mgr, window)
        mgr.commit(window.accepted)
        assert torch.equal(bits(storage.kv), bits(want))
        stats = mgr.last_window
        assert stats.fallback_reason is None
        assert stats.committed == int(window.keep().sum())
    m = mgr.metrics()
    assert m.fallbacks == {} and m.fallback_tokens == 0
    assert m.staged_tokens == m.committed_tokens + m.rejected_tokens
    assert m.rejected_tokens > 0


def test_a_latent_pool_stages_its_latent_as_the_key_and_takes_no_value():
    storage = poisoned_storage(pool_config("cpu", kv_layout="latent"))
    mgr = DeferredWriteManager(storage, max_tokens=8)
    latent = torch.randn(2, 40).bfloat16()
    mgr.begin_window(WindowLayout((2,), (0,)))
    with pytest.raises(NworInputError) as err:
        mgr.stage_layer(0, latent, latent, torch.tensor([4, 5]))
    assert err.value.field == "value"
    with pytest.raises(NworInputError) as err:
        mgr.stage_layer(0, latent, None, torch.tensor([4, 5]), v_scale=0.5)
    assert err.value.field == "v_scale"
    assert mgr.staged_rows(0) == 0
    mgr.stage_layer(0, latent, None, torch.tensor([4, 5]))
    key, value = mgr.staged_kv(0)
    assert torch.equal(key.reshape(2, 40), latent) and torch.equal(value, key)
    mgr.commit([0])
    assert torch.equal(storage.key_cache(0)[1, :2].reshape(2, 40), latent)
    with pytest.raises(NworInputError) as err:
        storage.value_cache(0)
    assert err.value.field == "kv_layout"
    _, kv_mgr = _manager()
    kv_mgr.begin_window(WindowLayout((2,), (0,)))
    with pytest.raises(NworInputError) as err:
        kv_mgr.stage_layer(0, torch.zeros(2, 32).bfloat16(), None, torch.tensor([4, 5]))
    assert err.value.field == "value"


def test_a_latent_pool_stages_from_a_one_plane_buffer():
    storage = poisoned_storage(pool_config("cpu", kv_layout="latent"))
    mgr = DeferredWriteManager(storage, max_tokens=8)
    staging = torch.randn(3, 1, 8, 1, 40).bfloat16()
    mgr.begin_window(WindowLayout((3,), (2,)))
    with pytest.raises(NworInputError) as err:
        mgr.stage_from(staging.expand(3, 2, 8, 1, 40).contiguous(), torch.tensor([0, 1, 2]))
    assert err.value.field == "staging"
    mgr.stage_from(staging, torch.tensor([0, 1, 2]))
    mgr.commit([1])  # the second draft is rejected: its slot keeps the poison
    rows = storage.rows()
    assert torch.equal(rows[:, 0, :2], staging[:, 0, :2, 0])
    assert (bits(rows[:, 0, 2]) == POISON_BITS[torch.bfloat16]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_tensor_counts_commit_the_same_as_host_counts(backend):
    storage, mgr = _manager("bfloat16", backend)
    rng = np.random.default_rng(16)
    for _ in range(6 if backend == "torch" else 3):
        window = random_window(rng, storage, max_tokens=48, stage_dtype=mgr.spec.stage_dtype)
        want = expected_after(storage.kv, window, window.keep(), None)
        mgr.begin_window(window.layout)
        stage(mgr, window)
        mgr.commit(torch.tensor(window.accepted, dtype=torch.int32))
        assert torch.equal(bits(storage.kv), bits(want))
        assert mgr.last_window.committed == int(window.keep().sum())
        assert mgr.last_window.path == "device"
    m = mgr.metrics()
    assert m.windows == (6 if backend == "torch" else 3)
    assert m.staged_tokens == m.committed_tokens + m.rejected_tokens and m.fallbacks == {}
    assert m.rejected_tokens > 0


def test_window_counts_every_scheduled_token_not_only_drafts():
    """A prefill chunk, and decodes with their last verified token: staging all 12 tokens fits."""
    _, mgr = _manager()
    layout = WindowLayout(num_tokens=(5, 4, 3), num_draft=(0, 3, 2))
    assert layout.total_tokens == 12
    mgr.begin_window(layout)
    k, v = _tokens(12)
    slots = torch.arange(12, dtype=torch.int64)
    mgr.stage_layer(0, k, v, slots)
    mgr.commit([0, 1, 2])
    stats = mgr.last_window
    assert (stats.tokens, stats.committed, stats.rejected) == (12, 5 + 2 + 3, 2)
    assert stats.fallback_reason is None


def test_each_layer_keeps_its_own_running_offset_across_chunks():
    storage, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([3, 3]))
    k, v = _tokens(8)
    slots = torch.arange(8, dtype=torch.int64) + 40
    for layer in range(3):
        mgr.stage_layer(layer, k[:3], v[:3], slots[:3])
        assert mgr.staged_rows(layer) == 3
    for layer in range(3):
        mgr.stage_layer(layer, k[3:], v[3:], slots[3:])
        assert mgr.staged_rows(layer) == 8
    mgr.commit([3, 3])
    assert mgr.last_window.path == "fast"
    for layer in range(3):
        got = storage.rows()[layer, 0, 40:48]
        assert torch.equal(bits(got), bits(k))


def test_all_accepted_takes_the_fast_path_and_zero_drafts_too():
    _, mgr = _manager()
    for layout, accepted in ((WindowLayout.decode([2, 1]), [2, 1]),
                             (WindowLayout((6,), (0,)), [0])):
        mgr.begin_window(layout)
        n = layout.total_tokens
        mgr.stage_layer(0, *_tokens(n), torch.arange(n, dtype=torch.int64))
        mgr.commit(accepted)
        assert mgr.last_window.path == "fast"
        assert mgr.last_window.rejected == 0


def test_unstaged_layers_are_left_untouched():
    storage, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([2]))
    mgr.stage_layer(1, *_tokens(3), torch.arange(3, dtype=torch.int64))
    mgr.commit([1])
    rows = bits(storage.rows())
    assert (rows[[0, 2]] == POISON_BITS[torch.bfloat16]).all()
    assert (rows[1, :, :2] != POISON_BITS[torch.bfloat16]).all()
    assert (rows[1, :, 2:] == POISON_BITS[torch.bfloat16]).all()


def test_int32_slots_are_a_typed_error_and_the_window_stays_usable():
    _, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([1]))
    k, v = _tokens(2)
    with pytest.raises(SlotDtypeError) as err:
        mgr.stage_layer(0, k, v, torch.arange(2, dtype=torch.int32))
    assert err.value.field == "slot_mapping"
    assert mgr.staged_rows(0) == 0
    mgr.stage_layer(0, k, v, torch.arange(2, dtype=torch.int64))
    mgr.commit([1])
    assert mgr.last_window.committed == 2


def test_accepted_more_than_drafts_is_a_typed_error_not_a_clamp():
    storage, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([2, 3]))
    mgr.stage_layer(0, *_tokens(7), torch.arange(7, dtype=torch.int64))
    before = storage.kv.clone()
    with pytest.raises(AcceptedExceedsDrafts) as err:
        mgr.commit([3, 1])
    assert err.value.field == "accepted_counts"
    with pytest.raises(InvalidValue):
        mgr.commit([-1, 1])
    with pytest.raises(NworInputError) as err:
        mgr.commit([1])
    assert err.value.field == "accepted_counts"
    # Nothing changed: the window is still open, the pool untouched, no window counted.
    assert mgr.window_open and torch.equal(bits(storage.kv), bits(before))
    assert mgr.metrics().windows == 0
    mgr.commit([2, 1])
    m = mgr.metrics()
    assert (m.windows, m.committed_tokens, m.rejected_tokens) == (1, 5, 2)


def test_device_counts_out_of_range_fall_back_and_metrics_stay_non_negative():
    storage, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([2, 3]))
    k, v = _tokens(7)
    mgr.stage_layer(0, k, v, torch.arange(7, dtype=torch.int64))
    mgr.commit(torch.tensor([5, 1]))
    # Fallback: every staged token written (rejected ones too), nothing lost, reason counted.
    assert torch.equal(bits(storage.rows()[0, 0, :7]), bits(k))
    stats = mgr.last_window
    assert (stats.path, stats.fallback_reason, stats.fallback_tokens) == (
        "fallback", "accepted_out_of_range", 7)
    m = mgr.metrics()
    assert m.fallbacks == {"accepted_out_of_range": 1}
    assert min(m.committed_tokens, m.rejected_tokens, m.fallback_tokens) >= 0
    assert m.staged_tokens == m.committed_tokens + m.rejected_tokens + m.fallback_tokens == 7
    # A bad count does not outlive its window, even in a slot a later, smaller window leaves idle.
    mgr.begin_window(WindowLayout.decode([2, 3]))
    mgr.stage_layer(0, k, v, torch.arange(7, dtype=torch.int64))
    mgr.commit(torch.tensor([1, -4]))
    assert mgr.last_window.fallback_reason == "accepted_out_of_range"
    mgr.begin_window(WindowLayout.decode([2]))
    mgr.stage_layer(0, k[:3], v[:3], torch.arange(3, dtype=torch.int64) + 20)
    mgr.commit(torch.tensor([1]))
    assert mgr.last_window == WindowStats(3, 2, 1, 0, "device")


def test_incomplete_staging_falls_back_writing_every_staged_token():
    storage, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([3]))
    k, v = _tokens(4)
    mgr.stage_layer(0, k, v, torch.arange(4, dtype=torch.int64))
    mgr.stage_layer(1, k[:2], v[:2], torch.arange(2, dtype=torch.int64))
    mgr.commit([0])
    assert mgr.last_window.fallback_reason == "incomplete_staging"
    assert torch.equal(bits(storage.rows()[0, 0, :4]), bits(k))
    assert torch.equal(bits(storage.rows()[1, 1, :2]), bits(v[:2]))
    assert mgr.metrics().fallbacks == {"incomplete_staging": 1}


def test_a_failing_write_falls_back_and_loses_nothing(monkeypatch):
    storage, mgr = _manager()
    real = pool_writes.write_staged

    def flaky(*args, backend, **kw):
        if backend != "torch" or flaky.failed:
            return real(*args, backend=backend, **kw)
        flaky.failed = True
        raise RuntimeError("kernel launch failed")

    flaky.failed = False
    for module in (pool_writes, packed_commit):  # the writes every path ends in
        monkeypatch.setattr(module, "write_staged", flaky)
    mgr.begin_window(WindowLayout.decode([2]))
    k, v = _tokens(3)
    mgr.stage_layer(0, k, v, torch.arange(3, dtype=torch.int64))
    mgr.commit([0])
    assert mgr.last_window.fallback_reason == "error:RuntimeError"
    assert torch.equal(bits(storage.rows()[0, 1, :3]), bits(v))
    assert not mgr.window_open


def test_cancel_writes_every_staged_token_and_records_the_reason():
    storage, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([2]))
    k, v = _tokens(3)
    mgr.stage_layer(2, k, v, torch.arange(3, dtype=torch.int64) + 7)
    mgr.cancel("forward_aborted")
    assert not mgr.window_open
    assert torch.equal(bits(storage.rows()[2, 0, 7:10]), bits(k))
    assert mgr.metrics().fallbacks == {"forward_aborted": 1}
    mgr.begin_window(WindowLayout.decode([1]))
    with pytest.raises(NworInputError) as err:
        mgr.cancel("")
    assert err.value.field == "reason" and mgr.window_open


def test_window_calls_out_of_order_are_typed_errors():
    _, mgr = _manager()
    k, v = _tokens(2)
    with pytest.raises(WindowStateError) as err:
        mgr.stage_layer(0, k, v, torch.arange(2, dtype=torch.int64))
    assert err.value.field == "window"
    with pytest.raises(WindowStateError):
        mgr.commit([])
    with pytest.raises(WindowStateError):
        mgr.cancel("nothing to cancel")
    mgr.begin_window(WindowLayout.decode([1]))
    with pytest.raises(WindowStateError):
        mgr.begin_window(WindowLayout.decode([1]))
    with pytest.raises(NworInputError) as err:
        mgr.graphs.capture_commit(8)
    assert err.value.field == "device"  # graphs need CUDA; checked before the window


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda k, v, s: (9, k, v, s), "layer"),
        (lambda k, v, s: (0, k.half(), v, s), "key"),
        (lambda k, v, s: (0, k, v[:2], s), "value"),
        (lambda k, v, s: (0, k.reshape(3, 4, 8), v.reshape(3, 4, 8), s), "key"),
        (lambda k, v, s: (0, k, v, s[:2]), "slot_mapping"),
        (lambda k, v, s: (0, k, v, s.to("meta")), "slot_mapping"),
    ],
)
def test_bad_stage_input_is_a_typed_error_and_changes_nothing(call, field):
    _, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([2]))
    k, v = _tokens(3)
    with pytest.raises(NworInputError) as err:
        mgr.stage_layer(*call(k, v, torch.arange(3, dtype=torch.int64)))
    assert err.value.field == field
    assert [mgr.staged_rows(layer) for layer in range(3)] == [0, 0, 0]


def test_staging_past_the_window_is_a_typed_error():
    _, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([1]))
    k, v = _tokens(3)
    mgr.stage_layer(0, k[:1], v[:1], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(StagingOverflow):
        mgr.stage_layer(0, k[1:], v[1:], torch.ones(2, dtype=torch.int64))
    assert mgr.staged_rows(0) == 1


@pytest.mark.parametrize("as_arrays", [False, True])
@pytest.mark.parametrize(
    ("tokens", "drafts", "field"),
    [((2, 3), (1,), "layout"), ((2,), (3,), "layout"), ((-1,), (0,), "layout"),
     ((49,), (0,), "layout"), ((2, 2**63), (1, 0), "layout"), ((True,), (False,), "layout")],
)
def test_bad_layouts_are_typed_errors(tokens, drafts, field, as_arrays):
    _, mgr = _manager()
    with pytest.raises(NworInputError) as err:
        layout = (WindowLayout.of_arrays(np.array(tokens), np.array(drafts)) if as_arrays
                  else WindowLayout(tokens, drafts))
        mgr.begin_window(layout)
    assert err.value.field == field
    assert not mgr.window_open


def test_a_layout_of_arrays_equals_the_layout_of_the_same_counts():
    tokens, drafts = np.array([4, 1, 16, 0]), np.array([3, 0, 0, 0])
    layout = WindowLayout.of_arrays(tokens, drafts)
    assert layout == WindowLayout((4, 1, 16, 0), (3, 0, 0, 0))
    assert layout.total_tokens == 21 and layout.num_requests == 4
    tokens[0] = 9  # the layout keeps its own copy
    assert layout.arrays[0].tolist() == [4, 1, 16, 0]
    assert not layout.arrays[0].flags.writeable


def test_a_layout_of_arrays_reads_as_python_ints_and_stays_immutable():
    layout = WindowLayout.of_arrays(np.array([4, 1], dtype=np.int32), np.array([3, 0]))
    same = WindowLayout((4, 1), (3, 0))
    assert layout.num_tokens == (4, 1) and layout.num_draft == (3, 0)
    assert all(type(c) is int for c in layout.num_tokens + layout.num_draft)
    assert hash(layout) == hash(same) and repr(layout) == repr(same)
    assert layout != WindowLayout((4, 1), (2, 0)) and layout != (4, 1)
    with pytest.raises(AttributeError):
        layout.num_tokens = (1, 1)  # type: ignore[misc]
    assert layout.num_tokens == (4, 1)


def test_fp8_pool_quantises_with_the_layer_scale_or_an_explicit_one():
    storage, mgr = _manager("fp8_e4m3")
    k, v = _tokens(2)
    mgr.begin_window(WindowLayout((2,), (0,)))
    mgr.stage_layer(1, k, v, torch.tensor([4, 5]), k_scale=0.25)
    mgr.commit([0])
    got = storage.rows()[1, :, 4:6].float()
    assert torch.equal(got[0], (k.float() * 4.0).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    v_scale = storage.v_scale[1].item()
    assert torch.equal(got[1], (v.float() * (1 / torch.tensor(v_scale))).clamp(-448, 448).to(
        torch.float8_e4m3fn).float())
    # The override lasts for that call only: the next window quantises with the pool's scale.
    mgr.begin_window(WindowLayout((2,), (0,)))
    mgr.stage_layer(1, k, v, torch.tensor([6, 7]))
    mgr.commit([0])
    k_scale = storage.k_scale[1]
    want = (k.float() * torch.reciprocal(k_scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(bits(storage.rows()[1, 0, 6:8]), bits(want))


def test_staged_kv_exposes_this_windows_tokens_for_attention():
    _, mgr = _manager()
    mgr.begin_window(WindowLayout.decode([1, 1]))
    k, v = _tokens(4)
    mgr.stage_layer(0, k, v, torch.arange(4, dtype=torch.int64))
    sk, sv = mgr.staged_kv(0)
    assert sk.shape == (4, 2, 16)
    assert torch.equal(sk.reshape(4, 32), k) and torch.equal(sv.reshape(4, 32), v)
    assert mgr.staged_kv(1)[0].shape == (0, 2, 16)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_accepted_per_position_counts_each_committed_draft_by_depth(as_tensor):
    _, mgr = _manager()  # max_draft_len 3: positions 0, 1, 2 (2 also counts deeper drafts)
    layout = WindowLayout((4, 1, 5, 3), (3, 0, 4, 2))
    accepted = [2, 0, 4, 0]
    mgr.begin_window(layout)
    mgr.stage_layer(0, *_tokens(13), torch.arange(13, dtype=torch.int64))
    mgr.commit(torch.tensor(accepted) if as_tensor else accepted)
    assert mgr.metrics().accepted_per_position == (2, 2, 2)


def test_a_write_failing_after_the_device_counted_the_window_keeps_metrics_consistent(
        monkeypatch):
    storage, mgr = _manager()
    real = pool_writes.write_staged

    def failing(*args, backend, **kw):
        if backend == "torch" and not failing.failed:
            failing.failed = True
            raise RuntimeError("lost the device")
        return real(*args, backend=backend, **kw)

    failing.failed = False
    for module in (pool_writes, packed_commit):  # the writes every path ends in
        monkeypatch.setattr(module, "write_staged", failing)
    mgr.begin_window(WindowLayout.decode([3, 3]))
    k, v = _tokens(8)
    mgr.stage_layer(0, k, v, torch.arange(8, dtype=torch.int64))
    mgr.commit(torch.tensor([0, 1]))  # counted on the device, then the write fails
    assert mgr.last_window == WindowStats(8, 0, 0, 8, "fallback", "error:RuntimeError")
    assert torch.equal(bits(storage.rows()[0, 0, :8]), bits(k))
    mgr.begin_window(WindowLayout.decode([3]))
    mgr.stage_layer(0, k[:4], v[:4], torch.arange(4, dtype=torch.int64) + 20)
    mgr.commit(torch.tensor([2]))
    m = mgr.metrics()
    assert (m.staged_tokens, m.committed_tokens, m.rejected_tokens, m.fallback_tokens) == (
        12, 3, 1, 8)


def _verify_inputs(layout: WindowLayout, accepted: list[int], flat: bool):
    """Drafts, and a rejection sampler's [R, 5] output accepting exactly ``accepted``."""
    drafts = [[10 * r + j for j in range(d)] for r, d in enumerate(layout.num_draft)]
    sampled = torch.tensor([d[:a] + [-2] + [-1] * (4 - a) for d, a in
                            zip(drafts, accepted, strict=True)])
    if flat:
        return torch.tensor([t for d in drafts for t in d], dtype=torch.int64), sampled
    return torch.tensor([d + [-1] * (4 - len(d)) for d in drafts]), sampled


@pytest.mark.parametrize("flat", [False, True])
def test_verify_and_commit_accepts_and_commits_in_one_call(flat):
    storage, mgr = _manager()
    rng = np.random.default_rng(17)
    for _ in range(6):
        window = random_window(rng, storage, max_tokens=48, stage_dtype=mgr.spec.stage_dtype)
        want = expected_after(storage.kv, window, window.keep(), None)
        mgr.begin_window(window.layout)
        stage(mgr, window)
        counts = mgr.verify_and_commit(*_verify_inputs(window.layout, window.accepted, flat))
        assert counts.tolist() == window.accepted
        assert torch.equal(bits(storage.kv), bits(want))
    assert mgr.metrics().fallbacks == {}


def test_verify_and_commit_rejects_inputs_that_do_not_match_the_window():
    _, mgr = _manager()
    layout = WindowLayout.decode([2, 3])
    mgr.begin_window(layout)
    mgr.stage_layer(0, *_tokens(7), torch.arange(7, dtype=torch.int64))
    draft_ids, sampled = _verify_inputs(layout, [1, 3], flat=True)
    with pytest.raises(NworInputError) as err:
        mgr.verify_and_commit(draft_ids[:4], sampled)  # 4 flat drafts, the window has 5
    assert err.value.field == "draft_ids"
    with pytest.raises(NworInputError) as err:
        mgr.verify_and_commit(draft_ids, sampled[:1])
    assert err.value.field == "num_draft_tokens"
    assert mgr.window_open and mgr.metrics().windows == 0
    assert mgr.verify_and_commit(draft_ids, sampled).tolist() == [1, 3]


def _caller_staging(window, mgr, capacity: int) -> torch.Tensor:
    """The worker's own ``[L, 2, capacity, H, D]`` buffer holding ``window``'s K/V for every
    layer (stage_from stages all layers, so the window counts as fully staged)."""
    num_layers, n, heads, dim = window.keys.shape
    staging = torch.zeros((num_layers, 2, capacity, heads, dim), dtype=mgr.spec.stage_dtype)
    staging[:, 0, :n] = window.keys
    staging[:, 1, :n] = window.values
    return staging


@pytest.mark.parametrize("counts", ["host", "device"])
@pytest.mark.parametrize("slots", ["tensor", "host"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_stage_from_a_caller_buffer_commits_exactly_what_stage_layer_commits(dtype, backend,
                                                                             slots, counts):
    """Committing straight from the worker's buffer writes the same bytes as staging each layer
    through stage_layer: the accepted tokens of every layer, poison everywhere else; whether the
    slots come as a tensor or as a host array (the keep mask then applied on the host), and the
    accepted counts as a list or a tensor."""
    storage, mgr = _manager(dtype, backend)
    reference_storage, reference = _manager(dtype, backend)
    rng = np.random.default_rng(23)
    for _ in range(8 if backend == "torch" else 3):
        window = random_window(rng, storage, max_tokens=48, stage_dtype=mgr.spec.stage_dtype)
        window.staged_layers = list(range(storage.config.num_layers))
        window.chunks = [[window.layout.total_tokens]] * len(window.staged_layers)
        reference.begin_window(window.layout)
        stage(reference, window)
        reference.commit(window.accepted)
        mgr.begin_window(window.layout)
        mgr.stage_from(_caller_staging(window, mgr, capacity=64),
                       window.slots.numpy() if slots == "host" else window.slots)
        mgr.commit(window.accepted if counts == "host" else torch.tensor(window.accepted))
        assert torch.equal(bits(storage.kv), bits(reference_storage.kv))
        last, want = mgr.last_window, reference.last_window
        assert (last.tokens, last.committed, last.rejected) == (
            want.tokens, want.committed, want.rejected)
        if slots == "host" and counts == "host":  # the window counts what reached a slot
            assert last.written == int(np.count_nonzero(window.keep() & (window.slots >= 0)
                                                        .numpy()))
    metrics, want = mgr.metrics(), reference.metrics()
    assert (metrics.committed_tokens, metrics.rejected_tokens, metrics.accepted_per_position,
            metrics.fallbacks) == (want.committed_tokens, want.rejected_tokens,
                                   want.accepted_per_position, want.fallbacks)


def test_stage_from_exposes_the_callers_buffer_to_attention_without_copying():
    storage, mgr = _manager()
    window = random_window(np.random.default_rng(5), storage, max_tokens=48,
                           stage_dtype=mgr.spec.stage_dtype)
    staging = _caller_staging(window, mgr, capacity=48)
    mgr.begin_window(window.layout)
    mgr.stage_from(staging, window.slots)
    key, value = mgr.staged_kv(1)
    n = window.layout.total_tokens
    assert key.data_ptr() == staging[1, 0].data_ptr()
    assert torch.equal(bits(value), bits(staging[1, 1, :n]))
    mgr.commit(window.accepted)


def test_stage_from_refuses_bad_buffers_and_mixing_with_stage_layer():
    storage, mgr = _manager()
    window = random_window(np.random.default_rng(8), storage, max_tokens=48,
                           stage_dtype=mgr.spec.stage_dtype)
    n = window.layout.total_tokens
    good = _caller_staging(window, mgr, capacity=n)
    mgr.begin_window(window.layout)
    bad_inputs = [
        (good[:, :, : n - 1], window.slots, NworInputError),  # capacity below the window
        (good[:1], window.slots, NworInputError),  # one layer short
        (good.float(), window.slots, NworInputError),  # not the staging dtype
        (good.transpose(3, 4), window.slots, NworInputError),  # not contiguous
        (good, window.slots.int(), SlotDtypeError),
        (good, window.slots[:-1], NworInputError),
        (good, window.slots.numpy().astype(np.int32), SlotDtypeError),
        (good, window.slots.numpy()[:-1], NworInputError),
        (good, window.slots.tolist(), NworInputError),  # neither a tensor nor an array
    ]
    for staging, slots, error in bad_inputs:
        with pytest.raises(error):
            mgr.stage_from(staging, slots)
        assert mgr.staged_rows(0) == 0  # nothing staged
    mgr.stage_from(good, window.slots)
    with pytest.raises(WindowStateError):
        mgr.stage_layer(0, window.keys[0], window.values[0], window.slots)
    mgr.commit(window.accepted)
    mgr.begin_window(window.layout)
    mgr.stage_layer(0, window.keys[0, :1], window.values[0, :1], window.slots[:1])
    with pytest.raises(WindowStateError):
        mgr.stage_from(good, window.slots)
    mgr.cancel("test")


def test_a_manager_is_freed_by_reference_counting_alone():
    """No reference cycle holds a manager: the cyclic collector would free it (and destroy
    its CUDA graphs) whenever it happens to run, during another stream's graph capture too,
    which aborts the process."""
    import gc
    import weakref

    _, mgr = _manager()
    mgr.graphs.captured.check_invariants(mgr.spec.max_requests)  # the capture view, used once
    gone = weakref.ref(mgr)
    gc.disable()
    try:
        del mgr
        assert gone() is None
    finally:
        gc.enable()
