"""The host tier's accounting: registered blocks are offloaded as they register, a prompt whose
prefix continues in the tier gets it back in fresh pool blocks (onboarded) in the step that admits
it, and a refused step undoes its onboarding whole.

The state machine runs a manager with a small pool and a smaller tier next to a model of what
each pool block and tier slot holds: a write puts a prompt block's hash where the block table
says, and the copies each drain returns are carried out in the order it gives. After every rule
the invariants hold, every registered pool block and every held tier slot holds the content its
hash names, and the cached columns a step hands a new request hold that request's prompt blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvalloc.allocator import (
    REFUSED_ONBOARDING,
    BlockRemoved,
    BlockStored,
    InvalidValue,
    KVAllocError,
    KVCacheManager,
    OnboardingPending,
    PoolConfig,
    StepPlan,
    UnknownRequest,
)
from kvalloc.allocator.capacity.kv_events import MEDIUM_POOL, MEDIUM_TIER

TPB = 4


def make_manager(num_blocks: int = 12, tier: int = 8, **options) -> KVCacheManager:
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="cpu",
                     num_blocks=num_blocks, tokens_per_block=TPB,
                     max_seq_len=min(40, (num_blocks - 1) * TPB - 3),
                     max_draft_len=2, max_batch_size=4)
    return KVCacheManager(cfg, prefix_caching=True, register_when_written=True,
                          host_tier_blocks=tier, **options)


class Contents:
    """What each pool block and tier slot holds, as the hash of the prompt block written there
    (None: nothing a hash names)."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.pool: dict[int, bytes | None] = {}
        self.tier: dict[int, bytes | None] = {}
        self.events: list = []  # the events the drains returned, oldest first

    def write(self, row: int, hashes: list[bytes], first: int) -> None:
        """The forward wrote the row's prompt blocks from column ``first`` on."""
        blocks = self.m.table.host[row]
        for i in range(first, len(hashes)):
            self.pool[int(blocks[i])] = hashes[i]

    def copy(self) -> tuple[int, int]:
        """Carry out what the manager owes, onboards first; returns how many of each."""
        changes = self.m.drain_cache_changes()
        self.events += [e.event for e in changes.events]
        for block, slot in zip(changes.onboards.blocks.tolist(), changes.onboards.slots.tolist(),
                               strict=True):
            self.pool[block] = self.tier.get(slot)
        for block, slot in zip(changes.offloads.blocks.tolist(), changes.offloads.slots.tolist(),
                               strict=True):
            self.tier[slot] = self.pool.get(block)
        return changes.onboards.blocks.size, changes.offloads.blocks.size

    def check(self) -> None:
        for block, block_hash in self.m.cache.hash_of.items():
            assert self.pool.get(block) == block_hash, f"pool block {block} holds other content"
        for slot, block_hash in self.m.tier.lru.items():
            assert self.tier.get(slot) == block_hash, f"tier slot {slot} holds other content"


def admit(m: KVCacheManager, contents: Contents, tokens: np.ndarray, salt: bytes = b"") -> int:
    """Admit a prompt the way the service does: the step, the copies it owes, the forward's
    writes past its hit, and its blocks marked written (then offloaded)."""
    prompt = m.prompt(tokens, salt)
    out = m.step(StepPlan(prompt_lens=[tokens.size], prompt_tokens=[prompt]))
    row = int(out.admitted_rows[0])
    contents.copy()  # what the step owes, admitted or not (the service copies every call)
    if row < 0:
        return row
    cached = int(out.cached_tokens[0]) // TPB
    held = m.table.host[row, :cached].tolist()
    assert [contents.pool.get(b) for b in held] == prompt.hashes[:cached]
    contents.write(row, prompt.hashes, cached)
    m.mark_written(np.array([row]), np.array([tokens.size]))
    contents.copy()
    return row


def prompt(first: int, blocks: int = 5) -> np.ndarray:
    return np.arange(first, first + blocks * TPB + 1)


def test_a_registered_block_is_offloaded_once_and_an_evicted_prefix_comes_back_from_the_tier():
    m = make_manager(num_blocks=8, tier=16)
    c = Contents(m)
    row = admit(m, c, prompt(0))
    assert m.tier.held == 5 and m.tier.counters.offloaded_blocks == 5
    m.step(StepPlan(finished_rows=[row]))
    for first in (500, 600):  # each needs 6 of the 8 blocks: the first prompt's are evicted
        m.step(StepPlan(finished_rows=[admit(m, c, prompt(first))]))
    assert m.counters.evicted_blocks >= 5 and m.tier.held == 15
    out = m.step(StepPlan(prompt_lens=[21], prompt_tokens=[m.prompt(prompt(0))]))
    assert out.cached_tokens.tolist() == [20]
    onboarded, offloaded = c.copy()
    assert (onboarded, offloaded) == (5, 0) and m.tier.counters.onboarded_blocks == 5
    c.check()
    m.check_invariants()


def test_another_namespace_gets_nothing_from_the_tier():
    m = make_manager(num_blocks=8)
    c = Contents(m)
    m.step(StepPlan(finished_rows=[admit(m, c, prompt(0), b"alice")]))
    m.clear_prefix_cache()
    out = m.step(StepPlan(prompt_lens=[21], prompt_tokens=[m.prompt(prompt(0), b"bob")]))
    assert out.cached_tokens.tolist() == [0] and m.tier.counters.onboarded_blocks == 0
    m.step(StepPlan(finished_rows=out.admitted_rows))
    out = m.step(StepPlan(prompt_lens=[21], prompt_tokens=[m.prompt(prompt(0), b"alice")]))
    assert out.cached_tokens.tolist() == [20]


def test_a_refused_step_undoes_its_onboarding_whole():
    m = make_manager(num_blocks=8)
    c = Contents(m)
    m.step(StepPlan(finished_rows=[admit(m, c, prompt(0))]))
    m.clear_prefix_cache()
    m.drain_cache_changes()
    before = (m.pool.free_stack.copy(), m.pool.num_free, m.pool.lru.copy(),
              dict(m.cache.hash_of), list(m.tier.lru), m.cache.protected.copy())
    with pytest.raises(UnknownRequest):
        m.step(StepPlan(finished_rows=[3], prompt_lens=[21],
                        prompt_tokens=[m.prompt(prompt(0))]))
    after = (m.pool.free_stack, m.pool.num_free, m.pool.lru, m.cache.hash_of, list(m.tier.lru),
             m.cache.protected)
    for was, now in zip(before, after, strict=True):
        assert np.array_equal(was, now) if isinstance(was, np.ndarray) else was == now
    changes = m.drain_cache_changes()
    assert changes.events == [] and changes.onboards.blocks.size == 0
    m.check_invariants()


def test_events_name_each_medium():
    m = make_manager(num_blocks=8, tier=5, kv_events=True)
    c = Contents(m)
    m.step(StepPlan(finished_rows=[admit(m, c, prompt(0))]))
    stored = {e.medium: e for e in c.events if isinstance(e, BlockStored)}
    assert stored[MEDIUM_POOL].block_hashes == stored[MEDIUM_TIER].block_hashes
    assert len(stored[MEDIUM_TIER].block_hashes) == 5
    c.events.clear()
    admit(m, c, prompt(900))  # five more blocks push the first five out of a tier of five
    removed = [e for e in c.events if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} >= {MEDIUM_TIER}
    assert sum(len(e.block_hashes) for e in removed if e.medium == MEDIUM_TIER) == 5
    assert m.tier.stored_events(b"")[0].medium == MEDIUM_TIER
    m.check_invariants()


def test_a_tier_needs_written_blocks_to_copy():
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="cpu", num_blocks=8,
                     tokens_per_block=TPB, max_seq_len=16, max_draft_len=0, max_batch_size=2)
    with pytest.raises(InvalidValue, match="host_tier_blocks"):
        KVCacheManager(cfg, prefix_caching=True, host_tier_blocks=4)


PROMPTS = [prompt(0), prompt(0, 3), prompt(100), prompt(100, 6), prompt(300, 2)]


@settings(max_examples=60, stateful_step_count=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
class TierMachine(RuleBasedStateMachine):
    """Admissions, finishes (preemption and a worker's restart alike: its rows end), clears,
    refused steps and a tier far smaller than the prompts' blocks."""

    onboard_blocks_per_step: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.m = make_manager(num_blocks=14, tier=6, kv_events=True,
                              onboard_blocks_per_step=self.onboard_blocks_per_step)
        self.contents = Contents(self.m)
        self.rows: list[int] = []

    @rule(which=st.integers(0, len(PROMPTS) - 1), salt=st.sampled_from([b"", b"x"]))
    def admit(self, which: int, salt: bytes) -> None:
        onboarded = self.m.tier.counters.onboarded_blocks
        row = admit(self.m, self.contents, PROMPTS[which], salt)
        event(f"onboarded: {self.m.tier.counters.onboarded_blocks > onboarded}")
        if row >= 0:
            self.rows.append(row)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        row = self.rows.pop(data.draw(st.integers(0, len(self.rows) - 1)))
        self.m.step(StepPlan(finished_rows=[row]))

    @rule()
    def restart(self) -> None:
        if self.rows:
            self.m.step(StepPlan(finished_rows=self.rows))
        self.rows = []

    @rule()
    def clear(self) -> None:
        self.m.clear_prefix_cache()
        self.contents.copy()

    @rule(which=st.integers(0, len(PROMPTS) - 1))
    def refused(self, which: int) -> None:
        journal = (self.m.pool.num_free, self.m.pool.num_parked, dict(self.m.cache.hash_of))
        with pytest.raises(KVAllocError):  # row 0 has no grant to settle, or is not live
            self.m.step(StepPlan(result_rows=[0], num_accepted=[0],
                                 prompt_lens=[PROMPTS[which].size],
                                 prompt_tokens=[self.m.prompt(PROMPTS[which])]))
        assert journal == (self.m.pool.num_free, self.m.pool.num_parked, self.m.cache.hash_of)

    @invariant()
    def holds(self) -> None:
        self.m.check_invariants()
        self.contents.check()


TestTierMachine = TierMachine.TestCase


class BoundedTierMachine(TierMachine):
    """The same with two blocks brought back a step: prompts deferred, brought back in parts."""

    onboard_blocks_per_step = 2


TestBoundedTierMachine = BoundedTierMachine.TestCase


def test_a_step_brings_back_a_bounded_number_of_blocks_and_defers_the_prompt_until_it_has_all():
    """Two blocks a step: a five-block prefix takes three steps; the prompt is refused as
    onboarding until the last, which admits it with the whole prefix cached, and a prompt
    behind it in the same steps gets nothing of the budget while the first one takes it."""
    m = make_manager(num_blocks=16, tier=16, onboard_blocks_per_step=2)
    c = Contents(m)
    m.step(StepPlan(finished_rows=[admit(m, c, prompt(0))]))
    m.clear_prefix_cache()
    c.copy()
    for step in range(3):
        out = m.step(StepPlan(prompt_lens=[21], prompt_tokens=[m.prompt(prompt(0))]))
        onboarded, _ = c.copy()
        assert onboarded == (2 if step < 2 else 1)
        if step < 2:
            assert out.admitted_rows.tolist() == [-1]
            assert out.new_refusals.tolist() == [REFUSED_ONBOARDING]
            assert out.cached_tokens.tolist() == [0]
    assert out.cached_tokens.tolist() == [20] and out.admitted_rows[0] >= 0
    c.check()
    m.check_invariants()


def test_a_deferred_prompt_leaves_the_others_of_its_step_admitted_in_their_places():
    m = make_manager(num_blocks=16, tier=16, onboard_blocks_per_step=1)
    c = Contents(m)
    m.step(StepPlan(finished_rows=[admit(m, c, prompt(0))]))
    m.clear_prefix_cache()
    out = m.step(StepPlan(prompt_lens=[9, 21, 5],
                          prompt_tokens=[m.prompt(prompt(100, 2)), m.prompt(prompt(0)),
                                         m.prompt(prompt(200, 1))]))
    assert (out.admitted_rows >= 0).tolist() == [True, False, True]
    assert out.new_refusals.tolist() == [0, REFUSED_ONBOARDING, 0]
    m.check_invariants()


def test_add_request_says_its_prefix_is_onboarding_and_admits_it_when_asked_again():
    m = make_manager(num_blocks=16, tier=16, onboard_blocks_per_step=3)
    c = Contents(m)
    m.step(StepPlan(finished_rows=[admit(m, c, prompt(0))]))
    m.clear_prefix_cache()
    with pytest.raises(OnboardingPending, match="'again'"):
        m.add_request("again", 21, prompt_tokens=prompt(0))
    row = m.add_request("again", 21, prompt_tokens=prompt(0))
    assert m.view(row).history == 21 and m.rows.cached[row] == 5
    m.check_invariants()
