"""Sliding-window groups (docs/design.md, "Sliding-window groups"): random lag-1 and lag-2
schedules against a windowed group alone (the numpy step and the compiled one side by side) and a
full-attention group beside a windowed one of another block size (`KVCacheGroups`).

A model device runs every scheduled forward right after the call that scheduled it: a prefill
chunk, or a generation step that accepts a random number of its drafts, which the host hears
``lag`` calls later. Schedules mix admissions with chunked prefill, grants (some refused for want
of blocks), reverts, and finishes with steps in flight (preemption); windows end near block
boundaries. After every call:

- every invariant holds, in every group;
- every forward still in flight finds a real block in every column it touches in every group:
  its window's reads from ``start - W + 1`` and its writes up to its reach;
- a decoding request holds at most `PoolConfig.max_live_blocks_per_seq` blocks in a windowed
  group, however long it grows;
- the numpy and compiled steps (the window's release included) return the same outcomes and
  leave the same state, alone and in groups;
- a plan some group refuses with a typed error (a strict grant one pool cannot serve, a grant
  for a request only another group has wholly prefilled) changes no group.

With prefix caching (the ``Prefix`` machines) new requests come with token ids drawn as
prefixes of two sequences that share their first 20 tokens, so they hit each other's cached
blocks, including ones their windows released, and the pools are small enough to evict them;
groups hear which tokens are written as the forwards run. Then, too: each hit needs only its
window's blocks, the events remove a cached block only when the pool evicts it, and the two
steps leave the same cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kvalloc.allocator import (
    InvalidValue,
    KVAllocError,
    KVCacheManager,
    PoolConfig,
    StepOutcome,
    StepPlan,
    checked_plan,
)
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.allocator.capacity.kv_events import BlockRemoved, BlockStored
from kvalloc.allocator.capacity.step.compiled import available
from kvalloc.allocator.capacity.windows.groups import GroupSpec, KVCacheGroups
from kvalloc.allocator.errors import OutOfBlocks, PrefillIncomplete, UnknownRequest

MAX_DRAFT = 3
MAX_SEQ = 120


def config(num_blocks: int, tokens_per_block: int, window: int | None) -> PoolConfig:
    return PoolConfig(num_blocks=num_blocks, tokens_per_block=tokens_per_block, num_layers=1,
                      num_kv_heads=1, head_dim=8, device="cpu", max_batch_size=4,
                      max_seq_len=MAX_SEQ, max_draft_len=MAX_DRAFT, overlap_scheduler=True,
                      window=window)


@dataclasses.dataclass
class Forward:
    start: int  # first position it writes; its window reads from start - W + 1
    tokens: int  # positions it writes (a chunk's tokens, or 1 + D)
    accepted: int  # drafts kept (0 for a chunk)
    until: int  # the last call after which it may still run
    due: int  # a generation step: the call that reports its accepted drafts


@dataclasses.dataclass
class Request:
    row: int
    prompt: int
    done: int  # tokens scheduled (prefill) or kept by the device (decode)
    steps: list[Forward] = dataclasses.field(default_factory=list)  # unsettled, oldest first
    chunks: list[Forward] = dataclasses.field(default_factory=list)  # prefill that may run

    def in_flight(self, call: int) -> list[Forward]:
        return [f for f in self.steps + self.chunks if f.until >= call]


# Prompts are prefixes of these: two requests' prompts share a prefix where they draw the same.
PROMPT_TOKENS = [np.arange(MAX_SEQ) % 5, np.arange(MAX_SEQ) % 5 + (np.arange(MAX_SEQ) >= 20)]


class WindowMachine(RuleBasedStateMachine):
    LAG = 2
    MIXED = False
    PREFIX = False  # admit with prompt token ids, prefix caching on

    def __init__(self) -> None:
        super().__init__()
        self.call_no = 0
        self.requests: list[Request] = []
        compiled = [False, True] if available() else [False]
        if self.MIXED:
            # With prefix caching the full pool is small enough to evict cached blocks.
            full = 36 if self.PREFIX else 80
            self.twins = [KVCacheGroups([GroupSpec("full", config(full, 4, None)),
                                         GroupSpec("window", config(24, 2, 7))], compiled=c,
                                        prefix_caching=self.PREFIX)
                          for c in compiled]
            self.groups = self.twins[0]
            self.windows = {"full": None, "window": 7}
        else:
            self.managers = [KVCacheManager(config(16 if self.PREFIX else 40, 4, 9), compiled=c,
                                            prefix_caching=self.PREFIX, kv_events=self.PREFIX)
                             for c in compiled]
            self.windows = {"window": 9}

    # ------------------------------------------------------------------ one call
    def _step(self, plan: StepPlan):  # type: ignore[no-untyped-def]
        """One call; a call that raises is no call (nothing ran, nothing changed)."""
        if self.MIXED:
            runs = [twin.step(plan) for twin in self.twins]
            outs, out = [r.groups for r in runs], runs[0].outcome
        else:
            outs = [{"window": m.step(plan)} for m in self.managers]
            out = outs[0]["window"]
        for name, group_out in outs[0].items():  # the numpy step's, then the compiled one's
            assert outcome_of(group_out) == outcome_of(outs[-1][name]), name
        self.call_no += 1
        return out

    def _state(self) -> list[dict]:
        if self.MIXED:
            return [groups_state(twin) for twin in self.twins]
        return [manager_state(m) for m in self.managers]

    def _refused(self, plan: StepPlan, error: type[KVAllocError]):  # type: ignore[no-untyped-def]
        """Step ``plan``; if it raises ``error``, no group (or manager) changed. Its outcome,
        else None."""
        before = self._state()
        try:
            return self._step(plan)
        except error:
            assert self._state() == before
            return None

    def _managers(self) -> dict[str, KVCacheManager]:
        return self.groups.managers if self.MIXED else {"window": self.managers[0]}

    @rule(prompt=st.integers(1, 40), chunk=st.integers(0, 24), strict=st.integers(0, 3),
          data=st.data())
    def call(self, prompt: int, chunk: int, strict: int, data: st.DataObject) -> None:
        """One call; one in four makes its grants strict: a grant some group cannot serve
        then refuses the whole call."""
        now = self.call_no + 1
        results = [r for r in self.requests if r.steps and r.steps[0].due == now]
        decoding = [r for r in self.requests if r.done >= r.prompt
                    and len(r.steps) - (r in results) < self.LAG]
        grants = [r for r in decoding if data.draw(st.booleans())]
        drafts = [data.draw(st.integers(0, MAX_DRAFT)) for _ in grants]
        prefilling = [r for r in self.requests if r.done < r.prompt]
        chunks = [min(r.prompt - r.done, data.draw(st.integers(1, 16))) for r in prefilling]
        new = [prompt] if len(self.requests) < 4 and data.draw(st.booleans()) else []
        first = min(chunk, prompt)
        tokens = ([PROMPT_TOKENS[data.draw(st.integers(0, 1))][:prompt]]
                  if new and self.PREFIX else [])
        plan = StepPlan(
            result_rows=[r.row for r in results],
            num_accepted=[r.steps[0].accepted for r in results],
            grant_rows=[r.row for r in grants], draft_lens=drafts,
            prefill_rows=[r.row for r in prefilling], prefill_tokens=chunks,
            prompt_lens=new, first_chunks=[first] if new else [], prompt_tokens=tokens,
            lag=self.LAG,
            strict_grants=strict == 0)
        out = self._refused(plan, OutOfBlocks)
        if out is None:
            return
        until = now + self.LAG - 1  # the last call after which a forward run now may still run
        for r in self.requests:
            r.chunks = [f for f in r.chunks if f.until >= now]
        for r in results:
            r.steps.pop(0)
        for r, ok, d in zip(grants, out.granted.tolist(), drafts, strict=True):
            if ok:
                accepted = data.draw(st.integers(0, d))
                r.steps.append(Forward(r.done, 1 + d, accepted, until, now + self.LAG))
                r.done += 1 + accepted
        for r, ok, c in zip(prefilling, out.prefill_granted.tolist(), chunks, strict=True):
            if ok:
                r.chunks.append(Forward(r.done, c, 0, until, 0))
                r.done += c
        for i, row in enumerate(out.admitted_rows.tolist()):
            if row >= 0:
                hit = int(out.cached_tokens[i])
                req = Request(row, new[i], min(new[i], hit + first) if first else new[i])
                req.chunks.append(Forward(hit, req.done - hit, 0, until, 0))
                self.requests.append(req)
        if self.MIXED and self.PREFIX:
            self._mark_written(now)
        for r in list(self.requests):
            if r.done >= MAX_SEQ - 2 * (1 + MAX_DRAFT):
                self._finish(r)

    def _mark_written(self, now: int) -> None:
        """The forwards that settled by call ``now`` wrote their prompt tokens: every group
        hears so (`KVCacheGroups.mark_written`) after the call's step, as a service's commit
        follows it."""
        if not self.requests:
            return
        written = [min([f.start for f in r.chunks if f.until >= now], default=r.done)
                   for r in self.requests]
        for twin in self.twins:
            twin.mark_written(np.array([r.row for r in self.requests]),
                              np.minimum(written, [r.prompt for r in self.requests]))
            twin.drain_cache_changes()

    @rule(data=st.data())
    def grant_before_the_prompt_ends(self, data: st.DataObject) -> None:
        """A grant for a request still prefilling, which a group holding its whole prompt ahead
        would serve: every group stays as it was."""
        prefilling = [r for r in self.requests if r.done < r.prompt]
        if prefilling:
            r = data.draw(st.sampled_from(prefilling))
            out = self._refused(StepPlan(grant_rows=[r.row], draft_lens=[0], lag=self.LAG),
                                PrefillIncomplete)
            assert out is None

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        if self.requests:
            self._finish(data.draw(st.sampled_from(self.requests)))

    def _finish(self, r: Request) -> None:
        """Free a request, its steps in flight dropped (preemption)."""
        self._step(StepPlan(finished_rows=[r.row], lag=self.LAG))
        self.requests.remove(r)

    # ------------------------------------------------------------------ checks
    @invariant()
    def invariants_hold(self) -> None:
        for twin in self.twins if self.MIXED else self.managers:
            twin.check_invariants()
        numpy, compiled = self._state()[0], self._state()[-1]
        assert numpy == compiled  # the window's release included

    @invariant()
    def every_touched_column_is_a_block(self) -> None:
        for name, manager in self._managers().items():
            window, tpb = self.windows[name], manager.tokens_per_block
            for r in self.requests:
                host = manager.table.host[r.row]
                for f in r.in_flight(self.call_no):
                    first = 0 if window is None else max(0, f.start - window + 1)
                    columns = host[first // tpb : -(-(f.start + f.tokens) // tpb)]
                    assert (columns >= 0).all(), (name, f, host)

    @invariant()
    def a_cached_block_leaves_the_events_only_when_evicted(self) -> None:
        """A window's released cached block stays in the cache: the events remove exactly the
        blocks the pool evicted, each once, after it was stored."""
        if not self.PREFIX or self.MIXED:
            return
        if not hasattr(self, "stored"):
            self.stored: list[set[int]] = [set() for _ in self.managers]
            self.removed = [0] * len(self.managers)
        for i, m in enumerate(self.managers):
            for event in (e.event for e in m.drain_kv_events()):
                if isinstance(event, BlockStored):
                    self.stored[i].update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    assert set(event.block_hashes) <= self.stored[i]
                    self.stored[i] -= set(event.block_hashes)
                    self.removed[i] += len(event.block_hashes)
            assert self.removed[i] == m.counters.evicted_blocks

    @invariant()
    def windowed_rows_stay_bounded(self) -> None:
        for name, manager in self._managers().items():
            if self.windows[name] is None:
                continue
            bound = manager.config.max_live_blocks_per_seq
            for r in self.requests:
                held = (manager.table.host[r.row] >= 0).sum()
                if r.done >= r.prompt + 2 * (1 + MAX_DRAFT) and not r.chunks:
                    assert held <= bound, (held, bound)


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def machine(lag: int, mixed: bool = False, prefix: bool = False):  # type: ignore[no-untyped-def]
    """The machine's test case at ``lag``, for a windowed group alone or beside a full one
    (``mixed``), with prefix caching or not."""
    name = f"{'Mixed' if mixed else 'Window'}{'Prefix' if prefix else ''}Lag{lag}"
    case = type(name, (WindowMachine,), {"LAG": lag, "MIXED": mixed, "PREFIX": prefix}).TestCase
    case.settings = SETTINGS
    return case


TestWindowLag2 = machine(2)
TestWindowLag1 = machine(1)
TestMixedLag2 = machine(2, mixed=True)
TestMixedLag1 = machine(1, mixed=True)
TestPrefixLag2 = machine(2, prefix=True)
TestPrefixLag1 = machine(1, prefix=True)
TestMixedPrefixLag2 = machine(2, mixed=True, prefix=True)
TestMixedPrefixLag1 = machine(1, mixed=True, prefix=True)


def long_decode(lag: int, window: int, tokens_per_block: int, steps: int,
                accepted: int = 2) -> KVCacheManager:
    cfg = PoolConfig(num_blocks=4096, tokens_per_block=tokens_per_block, num_layers=1,
                     num_kv_heads=1, head_dim=8, device="cpu", max_batch_size=1,
                     max_seq_len=40_000, max_draft_len=3, overlap_scheduler=True, window=window)
    m = KVCacheManager(cfg)
    row = m.step(StepPlan(prompt_lens=[1000], first_chunks=[1000])).admitted_rows
    for k in range(steps):
        res = dict(result_rows=row, num_accepted=[accepted]) if k >= lag else {}
        m.step(StepPlan(grant_rows=row, draft_lens=[3], lag=lag, **res))
        m.check_invariants()
    return m


@pytest.mark.parametrize("lag", [1, 2])
def test_a_long_request_holds_its_window_and_no_more(lag: int) -> None:
    m = long_decode(lag, window=64, tokens_per_block=16, steps=400)
    view = m.view(0)
    live = (view.block_ids >= 0).sum()
    assert view.history > 1000 + 400
    assert live <= m.config.max_live_blocks_per_seq == 6  # ceil((64 + 12 + 14) / 16)
    assert (view.block_ids[: view.num_blocks - live] == RELEASED).all()
    assert m.held_blocks == live


def test_the_window_reads_from_the_block_it_starts_in() -> None:
    """History 100, W = 8, T = 4: a query at 100 reads keys 93..100; block 23 (92..95) stays,
    blocks 0..22 go back."""
    cfg = config(40, 4, 8)
    m = KVCacheManager(cfg)
    row = m.step(StepPlan(prompt_lens=[100], first_chunks=[100])).admitted_rows
    m.step(StepPlan(lag=1))  # the prompt's forward has run
    v = m.view(int(row[0]))
    assert v.num_blocks == 25 and (v.block_ids[:23] == RELEASED).all()
    assert (v.block_ids[23:] >= 0).all() and m.held_blocks == 2


def test_a_chunk_in_flight_keeps_its_window_at_lag_2() -> None:
    """The chunk scheduled in the last call may still run at lag 2: its window's blocks stay
    until the next call."""
    m = KVCacheManager(config(40, 4, 8))
    row = m.step(StepPlan(prompt_lens=[60], first_chunks=[40], lag=2)).admitted_rows
    m.step(StepPlan(prefill_rows=row, prefill_tokens=[20], lag=2))
    assert m.rows.released[row[0]] == 0  # the first chunk (from 0) may still run
    m.step(StepPlan(lag=2))
    assert m.rows.released[row[0]] == (40 - 8 + 1) // 4  # the second chunk reads from 33


def test_a_windowed_pool_is_sized_by_its_window_not_its_row() -> None:
    cfg = config(7, 4, 8)  # a whole row is 32 blocks; the window needs ceil((8+12+2)/4) = 6
    assert cfg.max_live_blocks_per_seq == 6 < cfg.max_blocks_per_seq
    with pytest.raises(ValueError, match="per sequence"):
        config(5, 4, 8)


def test_windowed_groups_keep_no_host_tier() -> None:
    with pytest.raises(InvalidValue) as info:
        KVCacheManager(config(40, 4, 8), prefix_caching=True, register_when_written=True,
                       host_tier_blocks=8)
    assert info.value.field == "host_tier_blocks"


def test_groups_refuse_what_one_group_cannot_serve_and_the_other_gives_back() -> None:
    """The windowed group is too small for a second whole prompt: the full group admitted it,
    then gave its row and blocks back."""
    groups = KVCacheGroups([GroupSpec("full", config(80, 4, None)),
                            GroupSpec("window", config(36, 2, 7))])
    first = groups.step(StepPlan(prompt_lens=[60])).outcome
    assert first.admitted_rows.tolist() == [0]
    out = groups.step(StepPlan(prompt_lens=[60]))
    assert out.outcome.admitted_rows.tolist() == [-1]
    assert groups.managers["full"].held_blocks == 15
    groups.check_invariants()


def test_a_windowed_group_ahead_by_a_chunk_keeps_the_window_the_chunk_reads() -> None:
    """The full group cannot serve A's second chunk, the windowed group can: the chunk is
    refused and the windowed group holds it ahead. When it comes again and runs, its window
    (from position 26) must still be blocks in the windowed group."""
    groups = KVCacheGroups([GroupSpec("full", config(34, 4, None)),
                            GroupSpec("window", config(120, 2, 7))])
    a = int(groups.step(StepPlan(prompt_lens=[64], first_chunks=[32])).outcome.admitted_rows[0])
    b = int(groups.step(StepPlan(prompt_lens=[100], first_chunks=[96])).outcome.admitted_rows[0])
    out = groups.step(StepPlan(prefill_rows=[a], prefill_tokens=[32])).outcome
    assert out.prefill_granted.tolist() == [False] and groups.ahead["window"][a] == 32
    out = groups.step(StepPlan(finished_rows=[b], prefill_rows=[a], prefill_tokens=[32]))
    assert out.outcome.prefill_granted.tolist() == [True]
    assert out.outcome.prefill_starts.tolist() == [32]
    window = groups.managers["window"].table.host[a]
    assert (window[(32 - 7 + 1) // 2 : 64 // 2] >= 0).all()
    groups.check_invariants()


def test_a_give_back_keeps_the_window_of_a_chunk_in_flight_at_lag_2() -> None:
    """A's first chunk (from 0) may still run when the next call schedules its second; in that
    call the full group refuses B and the windowed group gives B's row back. That undo is no
    step of the window's: A's first chunk still reads from column 0."""
    groups = KVCacheGroups([GroupSpec("full", config(34, 4, None)),
                            GroupSpec("window", config(120, 2, 7))])
    a = int(groups.step(StepPlan(prompt_lens=[64], first_chunks=[32], lag=2)
                        ).outcome.admitted_rows[0])
    out = groups.step(StepPlan(prefill_rows=[a], prefill_tokens=[32], prompt_lens=[76],
                               lag=2)).outcome
    assert out.prefill_granted.tolist() == [True] and out.admitted_rows.tolist() == [-1]
    window = groups.managers["window"]
    assert window.rows.released[a] == 0 and (window.table.host[a, :32] >= 0).all()
    groups.check_invariants()


def test_a_chunk_held_ahead_keeps_its_window_until_it_has_run_at_lag_2() -> None:
    """The windowed group served A's second chunk ahead of the full one; when every group has
    it, it runs from 32 (the common start), not from the windowed group's history (64). At lag
    2 the next call must keep its window: the columns from (32 - 7 + 1) // 2 = 13 on."""
    groups = KVCacheGroups([GroupSpec("full", config(34, 4, None)),
                            GroupSpec("window", config(120, 2, 7))])
    a = int(groups.step(StepPlan(prompt_lens=[64], first_chunks=[32], lag=2)
                        ).outcome.admitted_rows[0])
    b = int(groups.step(StepPlan(prompt_lens=[100], first_chunks=[96], lag=2)
                        ).outcome.admitted_rows[0])
    out = groups.step(StepPlan(prefill_rows=[a], prefill_tokens=[32], lag=2)).outcome
    assert out.prefill_granted.tolist() == [False] and groups.ahead["window"][a] == 32
    out = groups.step(StepPlan(finished_rows=[b], prefill_rows=[a], prefill_tokens=[32],
                               lag=2)).outcome
    assert out.prefill_granted.tolist() == [True] and out.prefill_starts.tolist() == [32]
    groups.step(StepPlan(lag=2))
    window = groups.managers["window"]
    assert window.rows.released[a] == 13 and (window.table.host[a, 13:32] >= 0).all()
    groups.check_invariants()


def test_each_group_s_table_is_placed_under_its_own_name() -> None:
    """One placement makes every group's table: the first group's under the lone manager's
    name, another's under its group's, so a service can export both."""
    made: dict[str, torch.Tensor] = {}

    def placement(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        made[name] = torch.empty(shape, dtype=dtype, device=device)
        return made[name]

    groups = KVCacheGroups([GroupSpec("full", config(80, 4, None)),
                            GroupSpec("window", config(36, 2, 7))], allocate=placement)
    assert sorted(made) == ["block_table", "group-window-block_table"]
    assert made["group-window-block_table"] is groups.tables["window"].device_table
    row = int(groups.step(StepPlan(prompt_lens=[20])).outcome.admitted_rows[0])
    slots = groups.token_slots(np.array([row]), np.array([0]), np.array([20]))
    full, window = (groups.managers[g].table.host[row] for g in ("full", "window"))
    assert slots["full"].tolist() == [int(full[p // 4]) * 4 + p % 4 for p in range(20)]
    assert slots["window"].tolist() == [int(window[p // 2]) * 2 + p % 2 for p in range(20)]
    assert groups.free_blocks == {"full": 75, "window": 26}
    assert groups.live_rows.tolist() == [row]
    views = groups.view(row)
    assert views["full"].block_ids.tolist() == full[:5].tolist()
    assert views["window"].block_ids.tolist() == window[:10].tolist()
    with pytest.raises(UnknownRequest):
        groups.view(row + 1)


COLUMNS = ("revert_rows", "result_rows", "num_accepted", "finished_rows", "grant_rows",
           "draft_lens", "padding_rows", "padded_draft_lens", "prefill_rows", "prefill_tokens",
           "prompt_lens", "first_chunks")


def test_a_checked_plan_steps_the_groups_as_the_plan_does() -> None:
    """`step_arrays` over `checked_plan`'s arrays (how a service steps) leaves every group as
    `step` over the same plan."""
    twins = [KVCacheGroups([GroupSpec("full", config(80, 4, None)),
                            GroupSpec("window", config(36, 2, 7))]) for _ in range(2)]
    plans = [dict(prompt_lens=[20, 9], first_chunks=[12, 0]),
             dict(prefill_rows=[0], prefill_tokens=[8], grant_rows=[1], draft_lens=[2]),
             dict(result_rows=[1], num_accepted=[1], grant_rows=[0, 1], draft_lens=[3, 3])]
    for fields in plans:
        by_plan = twins[0].step(StepPlan(**fields))
        by_arrays = twins[1].step_arrays(checked_plan(**{
            **dict.fromkeys(COLUMNS, np.zeros(0, dtype=np.int64)),
            **{k: np.asarray(v, dtype=np.int64) for k, v in fields.items()}}))
        assert outcome_of(by_plan.outcome) == outcome_of(by_arrays.outcome)
        assert groups_state(twins[0]) == groups_state(twins[1])
    twins[1].check_invariants()


def manager_state(m: KVCacheManager) -> dict:
    """Everything a step can change in one group, as plain values (the refusal counter an error
    may bump, ``row_overflows``, aside)."""
    out = {f"rows.{k}": v.tolist() for k, v in vars(m.rows).items()}
    out.update({f"pool.{k}": v.tolist() if isinstance(v, np.ndarray) else v
                for k, v in vars(m.pool).items()})
    out.update({
        "table.host": m.table.host.tolist(),
        "table.device": m.table.device_table.cpu().tolist(),
        "table.free_rows": m.table.free_rows.tolist(),
        "table.num_free_rows": m.table.num_free_rows,
        "counters": {**dataclasses.asdict(m.counters), "row_overflows": 0},
        "ids": sorted(map(str, m.request_ids)),
    })
    if m.window is not None:
        out.update({f"window.{k}": v.tolist() for k, v in vars(m.window).items()
                    if isinstance(v, np.ndarray)})
    if m.cache is not None:
        out["cache"] = sorted(m.cache.hash_of.items())
    return out


def outcome_of(out: StepOutcome) -> dict:
    return {f.name: (str(getattr(out, f.name).dtype), getattr(out, f.name).tolist())
            for f in dataclasses.fields(out)}


def groups_state(groups: KVCacheGroups) -> dict:
    return {name: {**manager_state(m), "ahead": groups.ahead[name].tolist()}
            for name, m in groups.managers.items()}


def test_a_strict_grant_only_the_second_group_refuses_changes_no_group() -> None:
    """The full group can serve both grants, the windowed group only one: the step raises
    `OutOfBlocks` and neither group granted anything."""
    groups = KVCacheGroups([GroupSpec("full", config(80, 4, None)),
                            GroupSpec("window", config(14, 2, 7))])
    a = int(groups.step(StepPlan(prompt_lens=[20])).outcome.admitted_rows[0])
    groups.step(StepPlan())  # the prompt has run: the windowed group gives its start back
    b = int(groups.step(StepPlan(prompt_lens=[20])).outcome.admitted_rows[0])
    before = groups_state(groups)
    with pytest.raises(OutOfBlocks):
        groups.step(StepPlan(grant_rows=[a, b], draft_lens=[3, 3], strict_grants=True))
    assert groups_state(groups) == before
    groups.check_invariants()
    out = groups.step(StepPlan(grant_rows=[a, b], draft_lens=[3, 3])).outcome
    assert not out.granted.any()  # not strict, the plan runs and the grants are refused
    assert not groups.managers["full"].rows.pending.any()
    groups.check_invariants()


def test_padding_only_the_second_group_cannot_serve_changes_no_group() -> None:
    """Padding of an earlier grant may not be refused: padding the windowed pool cannot serve
    (a third request took its last blocks) raises, and the full group keeps the grant as it
    was."""
    groups = KVCacheGroups([GroupSpec("full", config(80, 4, None)),
                            GroupSpec("window", config(14, 2, 7))])
    a = int(groups.step(StepPlan(prompt_lens=[20])).outcome.admitted_rows[0])
    groups.step(StepPlan())
    groups.step(StepPlan(prompt_lens=[20]))
    assert groups.step(StepPlan(grant_rows=[a], draft_lens=[0])).outcome.granted.all()
    assert groups.step(StepPlan(prompt_lens=[14])).outcome.admitted_rows.tolist() == [2]
    assert groups.managers["window"].free_blocks == 0
    before = groups_state(groups)
    with pytest.raises(OutOfBlocks):
        groups.step(StepPlan(padding_rows=[a], padded_draft_lens=[3]))
    assert groups_state(groups) == before
    groups.check_invariants()


def test_a_grant_only_another_group_has_prefilled_for_changes_no_group() -> None:
    """The windowed group served A's last chunk, the full one could not: A is still prefilling,
    so a grant for it is refused with `PrefillIncomplete` by the full group alone, and the
    windowed group (first here) grants nothing."""
    groups = KVCacheGroups([GroupSpec("window", config(120, 2, 7)),
                            GroupSpec("full", config(34, 4, None))])
    a = int(groups.step(StepPlan(prompt_lens=[64], first_chunks=[32])).outcome.admitted_rows[0])
    groups.step(StepPlan(prompt_lens=[100], first_chunks=[96]))
    out = groups.step(StepPlan(prefill_rows=[a], prefill_tokens=[32])).outcome
    assert out.prefill_granted.tolist() == [False] and groups.ahead["window"][a] == 32
    before = groups_state(groups)
    with pytest.raises(PrefillIncomplete):
        groups.step(StepPlan(grant_rows=[a], draft_lens=[3]))
    assert groups_state(groups) == before
    groups.check_invariants()
