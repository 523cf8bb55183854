"""The lag-2 timeline: a grant may find the request's previous step unsettled, and results come
one call late (docs/design.md, "Lag").

A model device runs every granted forward right after the call that granted it, accepting a
random number of its drafts; the host learns that count ``lag`` calls later. Random schedules
mix grants (some refused for want of blocks), CUDA-graph padding, forwards skipped and reverted
(at lag 2 in the same call as the older step's results), finishes with steps in flight
(preemption), and admissions sharing cached prefixes. After every call:

- every invariant holds;
- no forward in flight writes past capacity: its reach is the device's true position (the
  accepted drafts of unsettled steps included) + 1 + D, and that must stay <= capacity until
  its results are in, even while a later call settles an older step;
- under ``reclaim`` capacity is exact: history + the 1 + D (+ slack) of each unsettled grant,
  so a request grows by 1 + accepted per settled step and capacity minus reach never exceeds
  the drafts the behind step may still reject;
- the numpy step and the compiled one agree on every array of the state.

The crash policies show the crashes on this timeline: ``none`` lets a forward reach past
capacity, ``unreclaimed`` grows capacity until a row overflows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvalloc.allocator import (
    BlockTableOverflow,
    GrantPending,
    KVCacheManager,
    OutOfBlocks,
    PoolConfig,
    StepPlan,
)
from kvalloc.allocator.capacity.step.compiled import available

TPB = 4
MAX_DRAFT = 3


def make_manager(compiled: bool, policy: str = "reclaim", num_blocks: int = 48,
                 max_seq_len: int = 40) -> KVCacheManager:
    config = PoolConfig(num_blocks=num_blocks, tokens_per_block=TPB, num_layers=1,
                        num_kv_heads=1, head_dim=8, device="cpu", max_batch_size=5,
                        max_seq_len=max_seq_len, max_draft_len=MAX_DRAFT,
                        overlap_scheduler=True, slack_policy=policy)
    return KVCacheManager(config, compiled=compiled, prefix_caching=True)


@dataclasses.dataclass
class Step:
    """One granted forward as the device ran it."""

    draft: int
    accepted: int  # what the device accepted; the host hears it `lag` calls later
    start: int  # the device's position when the forward began
    due: int  # the call that reports it
    skipped: bool = False  # reverted instead: the forward never ran


@dataclasses.dataclass
class Request:
    row: int
    position: int  # tokens the device has written and kept (accepted drafts included)
    steps: list[Step] = dataclasses.field(default_factory=list)  # unsettled, oldest first


class Timeline:
    """Drives managers through one random schedule and checks the model after every call."""

    def __init__(self, managers: list[KVCacheManager], lag: int, rng: np.random.Generator,
                 policy: str = "reclaim") -> None:
        self.managers, self.lag, self.rng, self.policy = managers, lag, rng, policy
        self.live: dict[str, Request] = {}
        self.call = 0
        self.names = 0
        self.prefixes = [rng.integers(0, 50, size=3 * TPB) for _ in range(2)]
        self.overreach = 0  # forwards that wrote past capacity (only `none` may)

    @property
    def lead(self) -> KVCacheManager:
        return self.managers[0]

    def plan(self) -> tuple[StepPlan, list[str], list[str]]:
        """This call's plan, and the requests granted and admitted by it."""
        rng, due = self.rng, self.call
        results, accepted, reverts = [], [], []
        for req in self.live.values():
            for step in req.steps:
                if step.due == due and not step.skipped:
                    results.append(req.row)
                    accepted.append(step.accepted)
                elif step.due == due:
                    reverts.append(req.row)
        # Requests near the row's end finish (or are preempted) like the rest.
        finished = [n for n, r in self.live.items() if rng.random() < 0.08 or r.position > 26]
        grants, drafts = [], []
        for name, req in self.live.items():
            unsettled = sum(s.due > due for s in req.steps)
            if name not in finished and unsettled < self.lag and rng.random() < 0.9:
                grants.append(name)
                drafts.append(int(rng.integers(0, MAX_DRAFT + 1)))
        padded = [i for i in range(len(grants)) if rng.random() < 0.2]
        new = [f"r{self.names + i}" for i in range(int(rng.integers(0, 3)))]
        self.names += len(new)
        prompts = [self.prompt() for _ in new]
        row_of = {n: r.row for n, r in self.live.items()}
        plan = StepPlan(
            revert_rows=reverts, result_rows=results, num_accepted=accepted,
            finished_rows=[row_of[n] for n in finished],
            grant_rows=[row_of[n] for n in grants], draft_lens=drafts,
            padding_rows=[row_of[grants[i]] for i in padded],
            padded_draft_lens=[MAX_DRAFT for _ in padded],
            prompt_lens=[p.size for p in prompts], prompt_tokens=prompts, lag=self.lag)
        for name in finished:
            del self.live[name]
        for i in padded:
            drafts[i] = MAX_DRAFT
        self._drafts = dict(zip(grants, drafts, strict=True))
        return plan, grants, new

    def prompt(self) -> np.ndarray:
        head = self.prefixes[int(self.rng.integers(0, 2))][: int(self.rng.integers(0, 13))]
        return np.concatenate([head, self.rng.integers(50, 99, size=int(self.rng.integers(1, 7)))])

    def run_call(self) -> None:
        plan, grants, new = self.plan()
        outcomes = [m.step(plan) for m in self.managers]
        for m in self.managers[1:]:
            assert_same_state(self.lead, m)
        out = outcomes[0]
        for name in list(self.live):
            req = self.live[name]
            req.steps = [s for s in req.steps if s.due > self.call]
        for i, name in enumerate(new):
            if out.admitted_rows[i] >= 0:
                row = int(out.admitted_rows[i])
                self.live[name] = Request(row, self.lead.view(row).history)
        for i, name in enumerate(grants):
            if out.granted[i]:
                self.launch(self.live[name], self._drafts[name], int(out.grant_starts[i]))
        self.check()
        self.call += 1

    def launch(self, req: Request, draft: int, host_start: int) -> None:
        """The forward runs now (or, one time in ten, is skipped and reverted next call)."""
        unsettled = [s for s in req.steps if not s.skipped]
        # The host's start is the device's minus the accepted drafts it has not heard of.
        assert host_start == req.position - sum(s.accepted for s in unsettled)
        if self.rng.random() < 0.1:
            req.steps.append(Step(draft, 0, req.position, self.call + 1, skipped=True))
            return
        accepted = int(self.rng.integers(0, draft + 1))
        req.steps.append(Step(draft, accepted, req.position, self.call + self.lag))
        req.position += 1 + accepted

    def check(self) -> None:
        for m in self.managers:
            m.check_invariants()
        for req in self.live.values():
            view = self.lead.view(req.row)
            running = [s for s in req.steps if not s.skipped]
            for step in running:
                if step.start + 1 + step.draft > view.capacity:
                    self.overreach += 1
            assert view.history == req.position - sum(1 + s.accepted for s in running)
            if self.policy == "reclaim":
                reserved = sum(1 + s.draft for s in req.steps)
                slack = self.lead.rows.slack[req.row] + self.lead.rows.behind_slack[req.row]
                assert view.capacity == view.history + reserved + slack
                if req.steps:  # the newest grant's reach, had its forward run
                    newest = req.steps[-1]
                    assert 0 <= view.capacity - (newest.start + 1 + newest.draft) <= (
                        MAX_DRAFT + (slack if self.lag == 1 else 0))


def assert_same_state(a: KVCacheManager, b: KVCacheManager) -> None:
    for field in dataclasses.fields(a.rows):
        np.testing.assert_array_equal(getattr(a.rows, field.name), getattr(b.rows, field.name),
                                      err_msg=field.name)
    np.testing.assert_array_equal(a.table.host, b.table.host)
    assert a.free_blocks == b.free_blocks


def managers() -> list[KVCacheManager]:
    return [make_manager(False), *([make_manager(True)] if available() else [])]


@pytest.mark.parametrize("lag", [1, 2])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_schedules_stay_exact_and_inside_their_blocks(lag: int, seed: int) -> None:
    timeline = Timeline(managers(), lag, np.random.default_rng(seed))
    for _ in range(40):
        try:
            timeline.run_call()
        except BlockTableOverflow:
            return  # a request at max_seq_len: refused whole, state unchanged (checked above)
    assert timeline.overreach == 0


def test_at_lag_2_the_device_really_runs_ahead_of_the_host() -> None:
    """The schedules above do exercise the timeline: grants that found a step unsettled, and
    calls that settled one step while reverting the next."""
    timeline = Timeline(managers(), 2, np.random.default_rng(7))
    behind = 0
    for _ in range(40):
        timeline.run_call()
        behind += int(timeline.lead.rows.behind.sum())
    assert behind > 20


def test_no_slack_lets_a_forward_write_past_capacity_at_lag_2() -> None:
    hits = 0
    for seed in range(20):
        timeline = Timeline([make_manager(False, "none")], 2, np.random.default_rng(seed), "none")
        for _ in range(30):
            timeline.run_call()
        hits += timeline.overreach
    assert hits > 0


def test_unreclaimed_slack_overflows_a_row_at_lag_2() -> None:
    mgr = make_manager(False, "unreclaimed", num_blocks=400, max_seq_len=64)
    mgr.add_request("a", prompt_len=8)
    row = mgr.rows_of(["a"])
    mgr.step(StepPlan(grant_rows=row, draft_lens=[MAX_DRAFT], lag=2))
    with pytest.raises(BlockTableOverflow):
        for _ in range(64):
            mgr.step(StepPlan(result_rows=row, num_accepted=[0], grant_rows=row,
                              draft_lens=[MAX_DRAFT], lag=2))


@pytest.mark.parametrize("compiled", [False, *([True] if available() else [])])
def test_reference_values_at_lag_2(compiled: bool) -> None:
    """docs/design.md's lag-2 table, step by step."""
    mgr = make_manager(compiled, max_seq_len=128)
    mgr.add_request("a", prompt_len=100)
    row = mgr.rows_of(["a"])
    mgr.try_allocate_generation("a", 3, lag=2)          # step 1: nothing unsettled
    assert (mgr.capacity("a"), mgr.history("a")) == (104, 100)
    out = mgr.step(StepPlan(grant_rows=row, draft_lens=[3], lag=2))  # step 2, behind step 1
    assert (mgr.capacity("a"), int(out.grant_starts[0])) == (108, 101)
    out = mgr.step(StepPlan(result_rows=row, num_accepted=[2], grant_rows=row, draft_lens=[3],
                            lag=2))                      # step 1 settles, step 3 granted
    assert (mgr.capacity("a"), mgr.history("a"), int(out.grant_starts[0])) == (111, 103, 104)
    with pytest.raises(GrantPending, match="two unsettled steps"):
        mgr.step(StepPlan(grant_rows=row, draft_lens=[3], lag=2))
    mgr.step(StepPlan(result_rows=row, num_accepted=[3], revert_rows=row, lag=2))
    assert (mgr.capacity("a"), mgr.history("a")) == (107, 107)  # step 2 settles, 3 reverted
    mgr.check_invariants()


def none_manager(compiled: bool, num_blocks: int = 48) -> KVCacheManager:
    """``none`` gives back the drafts of the step behind a lag-2 grant at once; its manager's
    rows fit a 5-token prompt and two steps of MAX_DRAFT drafts (3 blocks)."""
    return make_manager(compiled, "none", num_blocks=num_blocks, max_seq_len=8)


@pytest.mark.parametrize("compiled", [False, *([True] if available() else [])])
def test_a_revert_after_the_step_behind_settles_never_goes_below_history(compiled: bool) -> None:
    """Under ``none`` the behind step's results find the device kept drafts the host gave
    back: capacity rises to the new history, short of the pending grant's 1 + D. Reverting
    that grant then leaves capacity at history, not below it."""
    mgr = none_manager(compiled)
    row = mgr.step(StepPlan(prompt_lens=[1], lag=2)).admitted_rows

    def capacity_and_history() -> tuple[int, int]:
        view = mgr.view(int(row[0]))
        return view.capacity, view.history

    mgr.step(StepPlan(grant_rows=row, draft_lens=[3], lag=2))
    mgr.step(StepPlan(grant_rows=row, draft_lens=[0], lag=2))  # gives back the 3 drafts behind
    assert capacity_and_history() == (3, 1)
    mgr.step(StepPlan(result_rows=row, num_accepted=[1], lag=2))  # one of them was kept
    assert capacity_and_history() == (3, 3)
    mgr.step(StepPlan(revert_rows=row, lag=2))
    assert capacity_and_history() == (3, 3)
    mgr.check_invariants()


@pytest.mark.parametrize("compiled", [False, *([True] if available() else [])])
def test_a_revert_leaves_the_drafts_given_back_behind_it_and_needs_no_block(
        compiled: bool) -> None:
    """Under ``none`` a lag-2 grant gives back the drafts of the step behind it, and their
    block goes to another request; reverting the grant takes back only its own 1 + D, so the
    row does not grow back into a pool that has nothing left."""
    mgr = none_manager(compiled, num_blocks=4)
    row = mgr.step(StepPlan(prompt_lens=[5], lag=2)).admitted_rows
    mgr.step(StepPlan(grant_rows=row, draft_lens=[3], lag=2))  # 9 tokens: 3 blocks
    mgr.step(StepPlan(grant_rows=row, draft_lens=[0], lag=2))  # 7 tokens: 2 blocks
    mgr.step(StepPlan(prompt_lens=[8], lag=2))  # takes the 2 blocks left
    assert mgr.free_blocks == 0
    mgr.step(StepPlan(revert_rows=row, lag=2))
    view = mgr.view(int(row[0]))
    assert (view.capacity, view.history, view.num_blocks, view.pending_draft_len) == (6, 5, 2, 3)
    mgr.check_invariants()


@pytest.mark.parametrize("compiled", [False, *([True] if available() else [])])
def test_results_past_the_blocks_of_an_empty_pool_are_refused_whole(compiled: bool) -> None:
    """Under ``none`` the behind step's results can commit drafts the host gave back (the
    forward wrote past capacity): the row must grow to the new history before anything else,
    and with no block left the step raises OutOfBlocks and changes nothing."""
    mgr = none_manager(compiled, num_blocks=4)
    row = mgr.step(StepPlan(prompt_lens=[5], lag=2)).admitted_rows
    mgr.step(StepPlan(grant_rows=row, draft_lens=[3], lag=2))
    mgr.step(StepPlan(grant_rows=row, draft_lens=[0], lag=2))
    other = mgr.step(StepPlan(prompt_lens=[8], lag=2)).admitted_rows
    before = mgr.view(int(row[0]))
    with pytest.raises(OutOfBlocks, match="0 blocks available, not enough for row 0") as err:
        mgr.step(StepPlan(result_rows=row, num_accepted=[3], lag=2))
    assert err.value.field == "num_blocks"
    after = mgr.view(int(row[0]))
    assert (after.capacity, after.history, after.num_blocks) == (
        before.capacity, before.history, before.num_blocks)
    mgr.check_invariants()
    # Freeing the other request in the same call makes room: history 5 + 1 + 3 in 3 blocks.
    mgr.step(StepPlan(result_rows=row, num_accepted=[3], finished_rows=other, lag=2))
    after = mgr.view(int(row[0]))
    assert (after.capacity, after.history, after.num_blocks) == (9, 9, 3)
    mgr.check_invariants()
