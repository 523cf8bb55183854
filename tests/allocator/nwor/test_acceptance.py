"""`acceptance_mask` and SCV modes. Multi-request batches first: the historical bug (segment
lookup through an inclusive cumulative sum searched with the wrong side) only shows after the
first request."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvalloc.allocator.errors import InvalidScvMode, NworInputError
from kvalloc.allocator.nwor.acceptance import (
    SCV_MODE_ENV,
    ScvAcceptor,
    ScvMode,
    StaticAcceptance,
    acceptance_mask,
    scv_mode_from_env,
)


def reference(drafts: list[list[int]], sampled: list[list[int]]) -> list[int]:
    """Plain Python: accepted drafts per request, up to the first mismatch."""
    counts = []
    for d, s in zip(drafts, sampled, strict=True):
        n = 0
        while n < len(d) and d[n] == s[n]:
            n += 1
        counts.append(n)
    return counts


def make_batch(rng: random.Random, batch: int, max_drafts: int, vocab: int = 4):
    """Random drafts, and target samples that agree for a random prefix then differ or match by
    chance (small vocab), in a rejection sampler's [batch, max_drafts + 1] layout padded with -1."""
    drafts = [[rng.randrange(vocab) for _ in range(rng.randint(0, max_drafts))]
              for _ in range(batch)]
    sampled = []
    for d in drafts:
        agree = rng.randint(0, len(d))
        row = d[:agree] + [rng.randrange(vocab) for _ in range(len(d) - agree + 1)]
        sampled.append(row + [-1] * (max_drafts + 1 - len(row)))
    return drafts, sampled


def flat_inputs(drafts, sampled):
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int64)
    return flat, torch.tensor(sampled, dtype=torch.int64), [len(d) for d in drafts]


def padded_inputs(drafts, sampled, width):
    # Padded with -1 like the sampler's output: padding "matches", so only the counts stop it.
    padded = torch.full((len(drafts), width), -1, dtype=torch.int64)
    for r, d in enumerate(drafts):
        padded[r, : len(d)] = torch.tensor(d, dtype=torch.int64)
    return padded, torch.tensor(sampled, dtype=torch.int64), [len(d) for d in drafts]


def expected_mask(drafts, counts) -> list[bool]:
    return [j < c for d, c in zip(drafts, counts, strict=True) for j in range(len(d))]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 24), st.integers(1, 6))
def test_multi_request_flat_batch_matches_python_reference(seed, batch, max_drafts):
    drafts, sampled = make_batch(random.Random(seed), batch, max_drafts)
    mask, counts = acceptance_mask(*flat_inputs(drafts, sampled))
    want = reference(drafts, sampled)
    assert counts.tolist() == want
    assert mask.tolist() == expected_mask(drafts, want)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 24), st.integers(1, 6))
def test_multi_request_padded_batch_matches_python_reference(seed, batch, max_drafts):
    drafts, sampled = make_batch(random.Random(seed), batch, max_drafts)
    mask, counts = acceptance_mask(*padded_inputs(drafts, sampled, max_drafts))
    want = reference(drafts, sampled)
    assert counts.tolist() == want
    assert mask.shape == (batch, max_drafts)
    assert mask.tolist() == [[j < c for j in range(max_drafts)] for c in want]


def test_mismatch_at_every_position_in_one_batch():
    """Request k mismatches at draft k (k = D means all accepted, 0 means all rejected), in a
    batch whose later requests would inherit an earlier request's segment under the old bug."""
    depth = 4
    drafts = [[10 + k * 10 + j for j in range(depth)] for k in range(depth + 1)]
    sampled = [d[:k] + [-5] * (depth + 1 - k) for k, d in enumerate(drafts)]
    for inputs in (flat_inputs(drafts, sampled), padded_inputs(drafts, sampled, depth)):
        _, counts = acceptance_mask(*inputs)
        assert counts.tolist() == list(range(depth + 1))
    # Reversed order too: the first request accepts everything, the last nothing.
    _, counts = acceptance_mask(*flat_inputs(drafts[::-1], sampled[::-1]))
    assert counts.tolist() == list(range(depth, -1, -1))


def test_segment_boundary_token_belongs_to_the_next_request():
    """Flat index 1 is request 0's end and request 1's first draft. side='left' on the inclusive
    sum [1, 3] assigns it to request 0, comparing it with the wrong target."""
    draft = torch.tensor([5, 7, 8])
    sampled = torch.tensor([[9, -1, -1], [7, 8, 1]])  # request 0 rejects, request 1 accepts both
    mask, counts = acceptance_mask(draft, sampled, [1, 2])
    assert counts.tolist() == [0, 2]
    assert mask.tolist() == [False, True, True]


def test_zero_draft_requests_anywhere_in_the_batch():
    drafts = [[], [3, 4], [], [], [1], []]
    sampled = [[-1, -1, -1], [3, 4, 9], [-1, -1, -1], [2, -1, -1], [2, 5, -1], [0, -1, -1]]
    mask, counts = acceptance_mask(*flat_inputs(drafts, sampled))
    assert counts.tolist() == [0, 2, 0, 0, 0, 0]
    assert mask.tolist() == [True, True, False]
    _, counts = acceptance_mask(*padded_inputs(drafts, sampled, 2))
    assert counts.tolist() == [0, 2, 0, 0, 0, 0]


def test_empty_batch_and_all_zero_drafts():
    mask, counts = acceptance_mask(torch.zeros(0, dtype=torch.int64),
                                   torch.zeros((0, 4), dtype=torch.int64), [])
    assert mask.shape == (0,) and counts.shape == (0,)
    mask, counts = acceptance_mask(torch.zeros(0, dtype=torch.int64),
                                   torch.full((3, 4), -1), [0, 0, 0])
    assert counts.tolist() == [0, 0, 0] and mask.numel() == 0


def test_rejection_sampler_output_gives_the_same_counts_as_raw_target_samples():
    """A rejection sampler writes the recovered token after the last accepted draft and -1 after
    that; comparing drafts with that output gives the count the raw target tokens give."""
    rng = random.Random(3)
    drafts, raw = make_batch(rng, 32, 5)
    counts = reference(drafts, raw)
    sampler_out = [r[: c + 1] + [-1] * (len(r) - c - 1) for r, c in zip(raw, counts, strict=True)]
    _, got = acceptance_mask(*flat_inputs(drafts, sampler_out))
    assert got.tolist() == counts


def test_counts_are_int64_on_the_input_device_and_accept_int32_inputs():
    drafts, sampled = make_batch(random.Random(4), 8, 3)
    flat, samp, n = flat_inputs(drafts, sampled)
    mask, counts = acceptance_mask(flat.int(), samp.int(), torch.tensor(n, dtype=torch.int32))
    assert counts.dtype == torch.int64 and counts.device == samp.device
    assert mask.dtype == torch.bool
    assert counts.tolist() == reference(drafts, sampled)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((torch.tensor([1, 2]), torch.tensor([1, 2]), [2]), "sampled_ids"),
        ((torch.tensor([1, 2]), torch.tensor([[1, 2, -1]]).float(), [2]), "sampled_ids"),
        ((torch.tensor([1.0, 2.0]), torch.tensor([[1, 2, -1]]), [2]), "draft_ids"),
        ((torch.tensor([1, 2, 3]), torch.tensor([[1, 2, -1]]), [2]), "draft_ids"),
        ((torch.tensor([1, 2]), torch.tensor([[1, 2, -1]]), [2, 0]), "num_draft_tokens"),
        ((torch.tensor([1, 2]), torch.tensor([[1, 2, -1]]), [-1]), "num_draft_tokens"),
        ((torch.arange(4), torch.tensor([[1, 2, -1]]), [4]), "num_draft_tokens"),
        ((torch.zeros(1, 4, dtype=torch.int64), torch.tensor([[1, 2, -1]]), [2]), "draft_ids"),
        ((torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[1, 2, -1]]), [3]),
         "num_draft_tokens"),
        ((torch.zeros(1, 1, 2, dtype=torch.int64), torch.tensor([[1, 2, -1]]), [2]),
         "draft_ids"),
    ],
)
def test_bad_inputs_are_typed_errors_naming_the_field(args, field):
    with pytest.raises(NworInputError) as err:
        acceptance_mask(*args)
    assert err.value.field == field


def test_scv_mode_defaults_to_off_and_reads_the_variable():
    assert scv_mode_from_env({}) is ScvMode.OFF
    for mode in ScvMode:
        assert scv_mode_from_env({SCV_MODE_ENV: mode.value}) is mode


@pytest.mark.parametrize("value", ["on", "graphs", "", "1"])
def test_unknown_scv_mode_is_a_startup_error_naming_the_variable(value, monkeypatch):
    with pytest.raises(InvalidScvMode, match=SCV_MODE_ENV) as err:
        scv_mode_from_env({SCV_MODE_ENV: value})
    assert err.value.field == SCV_MODE_ENV
    monkeypatch.setenv(SCV_MODE_ENV, value)
    with pytest.raises(InvalidScvMode, match=SCV_MODE_ENV):
        ScvAcceptor()


@pytest.mark.parametrize("mode", list(ScvMode))
def test_every_scv_mode_runs_eagerly_on_cpu_with_identical_results(mode):
    acceptor = ScvAcceptor(mode)
    rng = random.Random(5)
    for batch in (3, 17, 64):
        drafts, sampled = make_batch(rng, batch, 4)
        want = reference(drafts, sampled)
        for inputs in (flat_inputs(drafts, sampled), padded_inputs(drafts, sampled, 4)):
            mask, counts = acceptor(*inputs)
            assert counts.tolist() == want
            assert np.array_equal(mask.numpy(), acceptance_mask(*inputs)[0].numpy())
    assert acceptor.stats.eager_calls == 6
    assert acceptor.stats.graph_replays == 0 and acceptor.num_graphs == 0


@pytest.mark.parametrize("flat", [False, True])
def test_static_buffers_give_eager_results_whatever_earlier_batches_left_behind(flat):
    """Graph buckets reuse their buffers: padding rows, columns and flat tokens hold stale data
    from a larger earlier batch, and must not change a smaller batch's mask or counts."""
    rng = random.Random(9)
    static = StaticAcceptance(flat=flat, batch=32, width=8, device=torch.device("cpu"))
    for batch, max_drafts in ((32, 7), (5, 3), (17, 6), (1, 1)):
        drafts, sampled = make_batch(rng, batch, max_drafts, vocab=2)
        inputs = (flat_inputs(drafts, sampled) if flat
                  else padded_inputs(drafts, sampled, max_drafts))
        draft_ids, sampled_ids, n = inputs
        static.load(draft_ids, sampled_ids, torch.tensor(n))
        static.compute()
        mask, counts = static.result(draft_ids, batch)
        want_mask, want_counts = acceptance_mask(*inputs)
        assert torch.equal(mask, want_mask) and torch.equal(counts, want_counts)
        out = torch.full((32,), -5, dtype=torch.int64)
        static.compute_counts(out)
        assert out[:batch].tolist() == reference(drafts, sampled)
        assert (out[batch:] == 0).all()
