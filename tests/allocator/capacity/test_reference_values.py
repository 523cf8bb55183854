"""docs/design.md "Capacity accounting": every reference value, each as its own test.

The numbers below are the design's (cap = capacity, D = draft_len); where it gives only the
starting capacity, the request starts with history == capacity (a fully prefilled prompt: prefill
tokens carry no speculation). Each per-request test runs twice: through the per-request methods
and through the batched ``step(StepPlan(...))``, which must agree exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kvalloc.allocator import BlockTableOverflow, KVCacheManager, SlackPolicy, StepPlan
from kvalloc.allocator.capacity.accounting import settle

TPB = 16
MAX_D = 3


@pytest.fixture
def manager(make_each_manager):
    def factory(**overrides) -> KVCacheManager:
        base = {"num_blocks": 128, "tokens_per_block": TPB, "max_seq_len": 1024,
                "max_draft_len": MAX_D, "max_batch_size": 4}
        return make_each_manager(**{**base, **overrides})

    return factory


class PerRequest:
    """The per-request methods of the design's accounting table."""

    name = "per_request"

    def grant(self, m: KVCacheManager, req, d: int) -> None:
        assert m.try_allocate_generation(req, d) is True

    def draft_grant(self, m: KVCacheManager, req, d: int) -> None:
        m.prepare_draft_resources(req, d)

    def pad(self, m: KVCacheManager, req, padded: int) -> None:
        m.extend_capacity_for_tokens(req, padded)

    def revert(self, m: KVCacheManager, req) -> None:
        m.revert_allocate_generation(req)

    def update(self, m: KVCacheManager, req, accepted: int) -> None:
        m.update_resources(req, accepted)


class Batched:
    """The same calls as one-entry batched steps, naming the request by row."""

    name = "batched"

    def grant(self, m: KVCacheManager, req, d: int) -> None:
        out = m.step(StepPlan(grant_rows=m.rows_of([req]), draft_lens=[d]))
        assert out.granted.tolist() == [True]

    def draft_grant(self, m: KVCacheManager, req, d: int) -> None:
        out = m.step(StepPlan(grant_rows=m.rows_of([req]), draft_lens=[d], strict_grants=True))
        assert out.granted.tolist() == [True]

    def pad(self, m: KVCacheManager, req, padded: int) -> None:
        m.step(StepPlan(padding_rows=m.rows_of([req]), padded_draft_lens=[padded]))

    def revert(self, m: KVCacheManager, req) -> None:
        m.step(StepPlan(revert_rows=m.rows_of([req])))

    def update(self, m: KVCacheManager, req, accepted: int) -> None:
        m.step(StepPlan(result_rows=m.rows_of([req]), num_accepted=[accepted]))


APIS = [pytest.param(PerRequest(), id="per_request"), pytest.param(Batched(), id="batched")]


def blocks(capacity: int) -> int:
    return math.ceil(capacity / TPB)


def assert_state(m: KVCacheManager, req, *, cap: int, hist: int, slack: int) -> None:
    assert m.capacity(req) == cap
    assert m.history(req) == hist
    assert m.pending_overlap_slack(req) == slack
    assert m.num_blocks(req) == blocks(cap)  # blocks = ceil(capacity / tokens_per_block)
    m.check_invariants()


def started(m: KVCacheManager, cap: int = 100, req="r"):
    m.add_request(req, cap)
    assert_state(m, req, cap=cap, hist=cap, slack=0)
    return req


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("site", ["grant", "draft_grant"])
def test_d3_allocate_107_slack_3_then_one_accepted_102_slack_0(manager, api, site):
    """D=3, cap 100: allocate -> 107, pending slack 3; update with 1 accepted -> 102, slack 0.
    try_allocate_generation and prepare_draft_resources are the same rule."""
    m = manager()
    req = started(m)
    getattr(api, site)(m, req, 3)
    assert_state(m, req, cap=107, hist=100, slack=3)
    api.update(m, req, 1)
    assert_state(m, req, cap=102, hist=102, slack=0)


@pytest.mark.parametrize("api", APIS)
def test_d3_two_accepted_each_step_grows_exactly_3_per_step_without_compounding(manager, api):
    """D=3, 2 accepted each step: cap = 100 + 3 per step, for hundreds of steps (no leak)."""
    m = manager()
    req = started(m)
    for step in range(1, 251):
        api.grant(m, req, 3)
        assert_state(m, req, cap=100 + 3 * (step - 1) + 7, hist=100 + 3 * (step - 1), slack=3)
        api.update(m, req, 2)
        assert_state(m, req, cap=100 + 3 * step, hist=100 + 3 * step, slack=0)


@pytest.mark.parametrize("api", APIS)
def test_d2_allocate_105_then_revert_100_slack_0(manager, api):
    """D=2, cap 100: allocate -> 105; revert -> 100, slack 0 (and the blocks go back)."""
    m = manager()
    req = started(m)
    free_before = m.free_blocks
    api.grant(m, req, 2)
    assert_state(m, req, cap=105, hist=100, slack=2)
    api.revert(m, req)
    assert_state(m, req, cap=100, hist=100, slack=0)
    assert m.pending_draft_len(req) is None
    assert m.free_blocks == free_before


@pytest.mark.parametrize("api", APIS)
def test_d1_allocate_103_pad_to_3_is_107_slack_3_then_zero_accepted_101(manager, api):
    """D=1: allocate 100 -> 103; padding to 3 drafts -> 107 (slack 3); update with 0 accepted
    -> 101 (the padded drafts are drafts: all rewound when rejected)."""
    m = manager()
    req = started(m)
    api.grant(m, req, 1)
    assert_state(m, req, cap=103, hist=100, slack=1)
    api.pad(m, req, 3)
    assert_state(m, req, cap=107, hist=100, slack=3)
    api.update(m, req, 0)
    assert_state(m, req, cap=101, hist=101, slack=0)


def test_d1_padding_then_revert_undoes_the_grant_and_the_padding(manager):
    """revert undoes exactly what was granted, the padding top-up and its slack included."""
    m = manager()
    req = started(m)
    m.try_allocate_generation(req, 1)
    m.extend_capacity_for_tokens(req, 3)
    m.revert_allocate_generation(req)
    assert_state(m, req, cap=100, hist=100, slack=0)


def test_d0_pending_slack_5_history_99_cap_100_reclaim_clamps_at_history_99():
    """D=0, pending slack 5, history 99, cap 100: reclaim clamps at history -> 99.

    ``settle`` clamps at the history *after* the step (history += 1 + accepted), so the design's
    "history 99" is the new history: history before the step is 98 (98 + 1 + 0 = 99). Rewinding
    0 rejected drafts and reclaiming 5 would give 95 < 99; the clamp keeps capacity at 99.

    This state cannot be reached through the public API under ``reclaim``: a grant records slack
    D (or 0 without overlap), so a pending grant with D=0 carries slack 0, never 5; and since a
    grant adds 1 + 2D while the settlement removes (D - accepted) + D, capacity - history is the
    same after every step as before it (0 after a prefill), so the clamp never binds. It is a
    safety net, hence tested on ``settle`` directly.
    """
    cap, hist = settle(np.array([100]), np.array([98]), np.array([0]), np.array([5]),
                       np.array([0]), SlackPolicy.RECLAIM)
    assert cap.tolist() == [99]
    assert hist.tolist() == [99]


def test_settle_clamp_applies_per_request_in_a_batch():
    """The same clamp, vectorised: only the rows that would drop below history are clamped."""
    cap, hist = settle(np.array([100, 107, 50]), np.array([98, 100, 40]), np.array([0, 3, 2]),
                       np.array([5, 3, 9]), np.array([0, 1, 2]), SlackPolicy.RECLAIM)
    # row 0: max(100 - 0 - 5, 99) = 99; row 1: 107 - 2 - 3 = 102; row 2: max(50 - 0 - 9, 43) = 43
    assert cap.tolist() == [99, 102, 43]
    assert hist.tolist() == [99, 102, 43]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("d", range(MAX_D + 1))
def test_non_overlap_mode_grants_1_plus_d_and_no_slack(manager, api, d):
    """Without the overlap scheduler there is nothing to cover: a grant adds exactly 1 + D."""
    m = manager(overlap_scheduler=False)
    req = started(m)
    api.grant(m, req, d)
    assert_state(m, req, cap=101 + d, hist=100, slack=0)
    api.update(m, req, d // 2)
    assert_state(m, req, cap=101 + d // 2, hist=101 + d // 2, slack=0)


@pytest.mark.parametrize("d", range(MAX_D + 1))
def test_none_policy_grants_1_plus_d_even_under_overlap(manager, d):
    """Policy ``none`` reproduces the first production crash: 1 + D, no slack."""
    m = manager(slack_policy="none")
    req = started(m)
    assert m.try_allocate_generation(req, d)
    assert_state(m, req, cap=101 + d, hist=100, slack=0)


def test_none_policy_write_reach_runs_past_the_blocks_at_a_block_boundary(manager):
    """Under overlap the device is `u` accepted tokens ahead of the host's history, so this
    step writes up to history + u + 1 + D. With ``none`` the grant covers only history + 1 + D:
    when that ends on a block boundary the last writes hit a -1 table entry (the IMA); the same
    steps under ``reclaim`` stay inside the capacity."""
    # prompt 104, D=3, 3 accepted -> history 108; next grant ends at 108 + 1 + 3 = 112 = 7 blocks.
    for policy, ima in (("none", True), ("reclaim", False)):
        m = manager(slack_policy=policy)
        req = started(m, cap=104)
        assert m.try_allocate_generation(req, 3)
        m.update_resources(req, 3)
        u = 3
        assert m.try_allocate_generation(req, 3)
        reach = m.history(req) + u + 1 + 3
        assert reach == 115
        if ima:
            assert m.capacity(req) == 112 and m.num_blocks(req) == 7
            assert reach > m.num_blocks(req) * TPB
            pos = torch.arange(m.history(req) + u, reach)
            slots = m.table.slot_mapping(torch.full_like(pos, m.row(req)), pos, TPB)
            assert (slots[-3:] == -1).all()  # these writes would read the -1 entry
        else:
            assert reach <= m.capacity(req)


def test_unreclaimed_policy_leaks_d_per_step_until_a_typed_row_overflow(manager):
    """Policy ``unreclaimed`` reproduces the second crash: the D slack is granted every step and
    never taken back, so capacity - history grows by exactly D per step, until a grant would
    need more than max_blocks_per_seq blocks: a typed BlockTableOverflow, nothing truncated."""
    m = manager(slack_policy="unreclaimed", max_seq_len=512)
    req = started(m)
    rng = np.random.default_rng(0)
    mbps = m.max_blocks_per_seq
    step = 0
    while True:
        cap, hist = m.capacity(req), m.history(req)
        assert cap - hist == MAX_D * step
        if blocks(cap + 1 + 2 * MAX_D) > mbps:
            break
        assert m.try_allocate_generation(req, MAX_D)
        a = int(rng.integers(0, MAX_D + 1))
        m.update_resources(req, a)
        assert m.capacity(req) == cap + 1 + a + MAX_D  # net growth 1 + accepted + leaked D
        step += 1
    assert m.history(req) < 512  # a request well inside max_seq_len is the one that overflows
    before = (m.capacity(req), m.history(req), m.num_blocks(req), m.free_blocks)
    with pytest.raises(BlockTableOverflow):
        m.try_allocate_generation(req, MAX_D)
    assert (m.capacity(req), m.history(req), m.num_blocks(req), m.free_blocks) == before
    m.check_invariants()


@pytest.mark.parametrize("overlap", [True, False])
def test_reclaim_net_growth_per_step_is_1_plus_accepted(manager, overlap):
    """Under reclaim, with any D and acceptance: capacity after the update is exactly the
    capacity before the grant + 1 + accepted, and history == capacity after every update.
    Under overlap the grant's slack is D, or the last step's accepted drafts when D shrank
    below them (the device is that far ahead of history)."""
    m = manager(overlap_scheduler=overlap)
    req = started(m)
    rng = np.random.default_rng(5)
    lead = 0
    for _ in range(150):
        cap = m.capacity(req)
        d = int(rng.integers(0, MAX_D + 1))
        assert m.try_allocate_generation(req, d)
        slack = max(d, lead) if overlap else 0
        assert m.capacity(req) == cap + 1 + d + slack
        assert m.pending_overlap_slack(req) == slack
        a = int(rng.integers(0, d + 1))
        m.update_resources(req, a)
        assert m.capacity(req) == cap + 1 + a == m.history(req)
        lead = a


def test_a_shortened_draft_len_still_covers_the_device_lead(manager):
    """Dynamic speculation: D=3 with 3 accepted, then D=0. The device is 3 accepted drafts
    ahead of history, so the D=0 grant records a slack of 3 and reach stays within capacity."""
    m = manager()
    req = started(m)
    assert m.try_allocate_generation(req, 3)
    m.update_resources(req, 3)
    h = m.history(req)
    assert m.try_allocate_generation(req, 0)
    assert m.pending_overlap_slack(req) == 3
    reach = h + 3 + 1 + 0
    assert reach <= m.capacity(req) == h + 1 + 0 + 3
    m.update_resources(req, 0)
    assert m.capacity(req) == m.history(req) == h + 1
    m.check_invariants()


def test_reclaim_reach_never_exceeds_capacity_with_everything_accepted(manager):
    """Every forward sees capacity >= write reach = history + u + 1 + D (u = last step's
    accepted drafts, still uncommitted on the device under overlap), worst case u = D."""
    m = manager()
    req = started(m, cap=104)
    u = 0
    for _ in range(100):
        assert m.try_allocate_generation(req, MAX_D)
        assert m.history(req) + u + 1 + MAX_D <= m.capacity(req)
        m.update_resources(req, MAX_D)
        u = MAX_D


@pytest.mark.parametrize(("overlap", "expected"), [(True, 7), (False, 6)])
def test_max_blocks_per_seq_formula(make_config, overlap, expected):
    """max_blocks_per_seq = ceil((max_seq_len + max_draft_len + 1 + slack) / tokens_per_block),
    slack = max_draft_len under overlap: 90 + 3 + 1 + 3 = 97 -> 7 blocks; 94 -> 6 blocks."""
    cfg = make_config(tokens_per_block=16, max_seq_len=90, max_draft_len=3,
                      overlap_scheduler=overlap)
    assert cfg.max_blocks_per_seq == expected


@pytest.mark.parametrize("overlap", [True, False])
def test_a_full_length_prompt_still_fits_its_largest_grant(manager, overlap):
    """The row is sized so that a request at max_seq_len can take a max_draft_len grant."""
    m = manager(max_seq_len=1024, overlap_scheduler=overlap)
    req = started(m, cap=1024)
    assert m.try_allocate_generation(req, MAX_D)
    assert m.capacity(req) == 1024 + 1 + MAX_D + (MAX_D if overlap else 0)
    assert m.num_blocks(req) <= m.max_blocks_per_seq
