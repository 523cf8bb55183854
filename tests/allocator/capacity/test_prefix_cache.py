"""Prefix caching: shared prompt blocks, parked blocks reused until evicted (LRU), and the
guarantee that nothing a step grants ever lands in a shared or cached block.

The state machine runs a manager with sharing on next to a model of the KV content: every token
a request writes (prompt chunks as they are scheduled, drafts and slack as they are granted) goes
into the model at the slot the block table gives. After every rule: the manager's invariants
hold (reference counts == owners, conservation, the LRU list, the cache maps), no write of the
rule landed in a block that was cached before it or had another owner, every cached block still
holds exactly the content it had when it was registered, and a row's cached columns hold its own
prompt tokens (what the block hashes say they hold).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvalloc.allocator import InvalidValue, KVCacheManager, PoolConfig, StepPlan
from kvalloc.allocator.capacity.kv_events import BlockRemoved, namespace_digest
from kvalloc.allocator.capacity.prefix_cache import block_hashes
from kvalloc.allocator.tools.simulate_prefix import SharingSpec, simulate_sharing

TPB = 4


def make_manager(num_blocks: int = 16, *, compiled: bool = True, **options) -> KVCacheManager:
    cfg = PoolConfig(num_layers=1, num_kv_heads=1, head_dim=8, device="cpu",
                     num_blocks=num_blocks, tokens_per_block=TPB,
                     max_seq_len=min(48, (num_blocks - 2) * TPB),
                     max_draft_len=2, max_batch_size=4)
    return KVCacheManager(cfg, compiled=compiled, prefix_caching=True, **options)


SYSTEM = np.arange(1000, 1020)  # a 20-token "system prompt": five full blocks


def prompt(suffix: int, length: int = 6) -> np.ndarray:
    return np.concatenate([SYSTEM, np.full(length, suffix)])


def test_a_shared_prefix_is_reused_and_reported_in_tokens():
    m = make_manager()
    first = m.add_request("a", 26, prompt_tokens=prompt(1))
    second = m.step(StepPlan(prompt_lens=[26], prompt_tokens=[prompt(2)]))
    row = int(second.admitted_rows[0])
    assert second.cached_tokens.tolist() == [20]
    a, b = m.view(first), m.view(row)
    assert b.block_ids[:5].tolist() == a.block_ids[:5].tolist()
    assert not set(b.block_ids[5:].tolist()) & set(a.block_ids.tolist())
    assert m.pool.refcounts[a.block_ids[:5]].tolist() == [2] * 5
    assert b.history == b.capacity == 26  # the cached prefix counts as history
    assert (m.counters.prefix_queried_tokens, m.counters.prefix_hit_tokens) == (52, 20)
    m.check_invariants()


def test_a_full_hit_leaves_the_last_token_to_compute_and_chunks_count_past_the_hit():
    m = make_manager()
    m.add_request("a", 20, prompt_tokens=SYSTEM)
    out = m.step(StepPlan(prompt_lens=[20, 24], first_chunks=[0, 2],
                          prompt_tokens=[SYSTEM, prompt(3, 4)]))
    assert out.cached_tokens.tolist() == [16, 20]
    full, chunked = (m.view(int(r)) for r in out.admitted_rows)
    assert full.history == 20 and chunked.history == 22


def test_without_token_ids_or_with_another_cache_key_nothing_is_shared():
    m = make_manager()
    m.add_request("a", 26, prompt_tokens=prompt(1))
    assert m.step(StepPlan(prompt_lens=[26])).cached_tokens.tolist() == [0]
    other = make_manager(cache_key=b"lora-7")
    assert block_hashes(SYSTEM, TPB, b"lora-7") != block_hashes(SYSTEM, TPB)
    other.add_request("a", 26, prompt_tokens=prompt(1))
    other.cache_key = b""
    assert other.step(StepPlan(prompt_lens=[26], prompt_tokens=[prompt(1)])).cached_tokens[0] == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_prompts_share_blocks_only_under_the_same_salt(compiled: bool):
    """A salt is a namespace: a prompt hashed under another salt neither hits the blocks cached
    under the first (a probe learns nothing) nor registers over them (nothing is poisoned)."""
    m = make_manager(compiled=compiled)
    m.step(StepPlan(prompt_lens=[20], prompt_tokens=[m.prompt(SYSTEM, b"tenant-a")]))
    probe = m.step(StepPlan(prompt_lens=[20], prompt_tokens=[m.prompt(SYSTEM, b"tenant-b")]))
    assert probe.cached_tokens.tolist() == [0]
    again = m.step(StepPlan(prompt_lens=[20], prompt_tokens=[m.prompt(SYSTEM, b"tenant-a")]))
    assert again.cached_tokens.tolist() == [16]
    a, b, a2 = (m.view(int(r)).block_ids[:4].tolist() for r in
                (*m.live_rows[:2], m.live_rows[2]))
    assert a2 == a and not set(b) & set(a)
    m.check_invariants()


def test_the_root_separates_key_from_salt_and_takes_a_secret_seed():
    assert block_hashes(SYSTEM, TPB, b"ab", salt=b"c") != block_hashes(SYSTEM, TPB, b"a",
                                                                        salt=b"bc")
    seeded = block_hashes(SYSTEM, TPB, seed=b"s" * 32)
    assert seeded == block_hashes(SYSTEM, TPB, seed=b"s" * 32)
    others = set(block_hashes(SYSTEM, TPB)) | set(block_hashes(SYSTEM, TPB, seed=b"t" * 32))
    assert not set(seeded) & others
    m = make_manager(hash_seed=b"s" * 32)
    assert m.prompt(SYSTEM).hashes == seeded
    with pytest.raises(InvalidValue, match="seed: 65 bytes"):
        make_manager(hash_seed=b"s" * 65)


def test_freed_cached_blocks_are_parked_reusable_then_evicted_tail_first():
    m = make_manager(num_blocks=12)
    row = m.add_request("a", 26, prompt_tokens=prompt(1))
    blocks = m.view(row).block_ids.tolist()
    m.free("a")
    # The six full blocks are parked, the prefix's end oldest; the partial tail is free.
    assert m.pool.parked() == blocks[5::-1]
    assert m.free_blocks == 12 - 6
    # A request without the prefix takes the free blocks first, then evicts from the LRU head.
    m.add_request("b", 36)  # 9 blocks: 6 free + 3 evicted
    assert m.counters.evicted_blocks == 3
    assert m.pool.parked() == blocks[2::-1]
    m.free("b")
    # The first three blocks survive and are still found.
    out = m.step(StepPlan(prompt_lens=[26], prompt_tokens=[prompt(9)]))
    assert out.cached_tokens.tolist() == [12]
    assert m.view(int(out.admitted_rows[0])).block_ids[:3].tolist() == blocks[:3]
    m.check_invariants()


def test_parked_blocks_count_as_available_but_not_twice():
    """A parked block a new request takes back is not also evicted for its fresh blocks."""
    m = make_manager(num_blocks=9)
    m.add_request("a", 20, prompt_tokens=SYSTEM)
    m.free("a")  # 5 parked, 4 free
    m.add_request("x", 12)  # 1 free left
    out = m.step(StepPlan(prompt_lens=[28], prompt_tokens=[prompt(4, 8)]))
    assert out.new_refusals.tolist() == [1]  # 5 parked reused + 2 fresh > 1 free + 5 parked
    m.free("x")
    out = m.step(StepPlan(prompt_lens=[28], prompt_tokens=[prompt(4, 8)]))
    assert out.cached_tokens.tolist() == [20] and m.free_blocks == 2
    m.check_invariants()


def test_cache_changes_are_the_protection_flips_and_events_since_the_last_drain():
    """Registering a written prefix protects its blocks; evicting them lifts it; each drain gives
    what changed since the previous one, then nothing."""
    m = make_manager(kv_events=True, register_when_written=True)
    first = m.drain_cache_changes()
    assert first.blocks.size == 0 and [type(e.event).__name__ for e in first.events] == [
        "AllBlocksCleared"]
    row = m.add_request("a", 26, prompt_tokens=prompt(1))
    blocks = m.view(row).block_ids[:6]  # its full blocks
    m.mark_written(np.array([row]), np.array([26]))
    registered = m.drain_cache_changes()
    assert registered.blocks.tolist() == blocks.tolist() and registered.protected.all()
    assert [type(e.event).__name__ for e in registered.events] == ["BlockStored"]
    m.free("a")
    assert m.used_blocks == m.pool.num_parked == 6  # parked blocks are not free
    m.add_request("b", 48)  # 12 blocks: the 10 free ones, then the prefix's last two evicted
    evicted = m.drain_cache_changes()
    assert sorted(evicted.blocks.tolist()) == sorted(blocks[4:].tolist())
    assert not evicted.protected.any()
    assert [type(e.event).__name__ for e in evicted.events] == ["BlockRemoved"]
    nothing = m.drain_cache_changes()
    assert nothing.blocks.size == nothing.protected.size == 0 and nothing.events == []
    m.check_invariants()


def test_events_name_their_namespace_and_a_namespaces_stored_blocks_rebuild_its_cache():
    """Each event says whose blocks it concerns: one `BlockRemoved` per namespace when an
    eviction spans several, and ``stored_events`` gives a new subscriber of a namespace exactly
    the blocks of it that are registered, parents first, in the shape the live events have."""
    m = make_manager(num_blocks=20, kv_events=True)
    m.drain_kv_events()
    for name, suffix in [(b"a", 1), (b"b", 2), (b"a", 3)]:
        m.step(StepPlan(prompt_lens=[26], prompt_tokens=[m.prompt(prompt(suffix), name)]))
    live = m.drain_kv_events()
    assert [(n, type(e).__name__) for n, e in live] == [(b"a", "BlockStored"),
                                                         (b"b", "BlockStored"),
                                                         (b"a", "BlockStored")]
    stored = {n: set() for n in (b"a", b"b")}
    for namespace, stored_event in live:
        assert stored_event.medium == "GPU"  # the pool's tier, whatever its device
        assert stored_event.kv_cache_spec_kind == "full_attention"
        digests = [(namespace_digest(namespace),)] * len(stored_event.block_hashes)
        assert stored_event.extra_keys == digests
        stored[namespace].update(stored_event.block_hashes)
    for namespace, hashes in stored.items():
        snapshot = m.cache.stored_events(namespace)
        assert {h for e in snapshot for h in e.block_hashes} == hashes
        seen: set[int] = set()
        for block in snapshot:  # parents first
            assert block.parent_block_hash is None or block.parent_block_hash in seen
            seen.update(block.block_hashes)
    m.step(StepPlan(finished_rows=m.live_rows))
    m.clear_prefix_cache()
    removed = m.drain_kv_events()
    assert sorted(n for n, _ in removed) == [b"a", b"b"]
    assert {n: set(e.block_hashes) for n, e in removed} == stored
    assert m.cache.stored_events(b"a") == m.cache.stored_events(b"b") == []
    m.check_invariants()


def test_without_prefix_caching_the_cache_changes_nothing():
    m = KVCacheManager(PoolConfig(num_blocks=8, tokens_per_block=TPB, max_seq_len=16,
                                  device="cpu"))
    assert not m.prefix_caching
    changes = m.drain_cache_changes()
    assert changes.blocks.dtype == np.int64 and changes.protected.dtype == bool
    assert changes.blocks.size == changes.protected.size == 0 and changes.events == []


@pytest.mark.parametrize("tokens, message", [
    ([np.arange(5)], "must be 6"),
    ([np.arange(6) - 3], "non-negative"),
    ([np.arange(6), None], "2 entries for 1"),
    ([np.arange(6.0)], "expected integers"),
])
def test_bad_prompt_token_ids_are_refused_and_change_nothing(tokens, message):
    m = make_manager()
    m.add_request("a", 26, prompt_tokens=prompt(1))
    before = (m.pool.free_stack.copy(), m.pool.refcounts.copy(), m.rows.cached.copy())
    with pytest.raises(InvalidValue, match=message) as err:
        m.step(StepPlan(prompt_lens=[6], prompt_tokens=tokens))
    assert err.value.field == "prompt_tokens"
    after = (m.pool.free_stack, m.pool.refcounts, m.rows.cached)
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))


def test_content_another_block_holds_ends_a_rows_cached_run():
    """Two requests with one prompt admitted in one step both miss; only the first caches."""
    m = make_manager()
    out = m.step(StepPlan(prompt_lens=[20, 20], prompt_tokens=[SYSTEM, SYSTEM]))
    first, second = out.admitted_rows.tolist()
    assert m.rows.cached[first] == 5 and m.rows.cached[second] == 0
    assert len(m.cache.block_of) == 5
    m.check_invariants()


def test_clearing_the_cache_frees_parked_blocks_and_keeps_owned_ones():
    m = make_manager()
    m.add_request("a", 20, prompt_tokens=SYSTEM)
    m.add_request("b", 26, prompt_tokens=prompt(5))
    m.free("a")
    m.free("b")
    m.add_request("c", 8, prompt_tokens=SYSTEM[:8])
    m.clear_prefix_cache()
    assert m.pool.num_parked == 0 and len(m.cache.block_of) == 1
    m.check_invariants()


class SharingMachine(RuleBasedStateMachine):
    """Random admissions with overlapping prefixes, chunked prefill, drafts, rejections, slack,
    reverts, padding, frees and eviction under pressure, on a small pool."""

    def __init__(self) -> None:
        super().__init__()
        self.m = make_manager(num_blocks=18, kv_events=True)
        self.kv = np.full((18, TPB), -1, dtype=np.int64)  # token id written at each slot
        self.snapshot: dict[int, np.ndarray] = {}  # registered block -> content then
        self.prompts: dict[int, np.ndarray] = {}
        self.protected: set[int] = set()

    # ---------------------------------------------------------------- helpers

    def run(self, plan: StepPlan):
        before = dict(self.m.cache.hash_of)
        routes = {b: origin.route for b, origin in self.m.cache.origin.items()}
        out = self.m.step(plan)
        # Cached before the step and not evicted by it. An evicted block may be reused and
        # registered again in the same step, even under its old hash: a full hit's last block,
        # recomputed into the evicted block that held it, gets the same content back.
        evicted = {h for _, e in self.m.drain_kv_events() if isinstance(e, BlockRemoved)
                   for h in e.block_hashes}
        after = self.m.cache.hash_of
        self.protected = {b for b, h in before.items()
                          if after.get(b) == h and routes[b] not in evicted}
        for row in plan.finished_rows:
            self.prompts.pop(int(row), None)
        return out

    def write(self, row: int, start: int, end: int, tokens: np.ndarray) -> None:
        host, refcounts = self.m.table.host, self.m.pool.refcounts
        for position in range(start, end):
            block = int(host[row, position // TPB])
            assert block >= 0, "a granted position has no block"
            assert block not in self.protected, "a write landed in a cached block"
            assert refcounts[block] == 1, "a write landed in a shared block"
            self.kv[block, position % TPB] = tokens[position - start]

    def settle_snapshot(self) -> None:
        registered = self.m.cache.hash_of
        self.snapshot = {b: self.snapshot[b] if b in self.protected else self.kv[b].copy()
                         for b in registered}

    def rows_where(self, predicate) -> list[int]:
        r = self.m.rows
        return [int(x) for x in self.m.live_rows if predicate(r, x)]

    # ---------------------------------------------------------------- rules

    @rule(family=st.integers(0, 2), length=st.integers(1, 40), chunk=st.integers(0, 12),
          with_ids=st.integers(0, 4))
    def admit(self, family, length, chunk, with_ids):
        tokens = (np.arange(length) % 7 + 10 * family) if family else np.arange(length) % 3
        out = self.run(StepPlan(prompt_lens=[length], first_chunks=[min(chunk, length)],
                                prompt_tokens=[tokens if with_ids else None]))
        row = int(out.admitted_rows[0])
        if row >= 0:
            self.prompts[row] = tokens
            start = int(out.cached_tokens[0])
            self.write(row, start, int(self.m.rows.history[row]), tokens[start:])
        self.settle_snapshot()

    @precondition(lambda self: self.rows_where(lambda r, x: r.history[x] < r.prompt_len[x]))
    @rule(data=st.data())
    def prefill(self, data):
        row = data.draw(st.sampled_from(self.rows_where(
            lambda r, x: r.history[x] < r.prompt_len[x])))
        start = int(self.m.rows.history[row])
        chunk = data.draw(st.integers(1, int(self.m.rows.prompt_len[row]) - start))
        out = self.run(StepPlan(prefill_rows=[row], prefill_tokens=[chunk]))
        if out.prefill_granted[0]:
            self.write(row, start, start + chunk, self.prompts[row][start:])
        self.settle_snapshot()

    @precondition(lambda self: self.rows_where(
        lambda r, x: not r.pending[x] and r.history[x] >= r.prompt_len[x]))
    @rule(data=st.data(), draft=st.integers(0, 2), padded=st.integers(0, 2))
    def grant(self, data, draft, padded):
        row = data.draw(st.sampled_from(self.rows_where(
            lambda r, x: not r.pending[x] and r.history[x] >= r.prompt_len[x])))
        padded = max(padded, draft)
        out = self.run(StepPlan(grant_rows=[row], draft_lens=[draft], padding_rows=[row],
                                padded_draft_lens=[padded]))
        if out.granted[0]:
            # Drafts, padding and slack: everything from history to capacity is written.
            start, end = int(self.m.rows.history[row]), int(self.m.rows.capacity[row])
            self.write(row, start, end, np.full(end - start, -7))
        self.settle_snapshot()

    @precondition(lambda self: self.rows_where(lambda r, x: r.pending[x]))
    @rule(data=st.data(), revert=st.booleans())
    def settle(self, data, revert):
        row = data.draw(st.sampled_from(self.rows_where(lambda r, x: r.pending[x])))
        if revert:
            self.run(StepPlan(revert_rows=[row]))
        else:
            accepted = data.draw(st.integers(0, int(self.m.rows.draft_len[row])))
            self.run(StepPlan(result_rows=[row], num_accepted=[accepted]))
        self.settle_snapshot()

    @precondition(lambda self: self.m.num_requests)
    @rule(data=st.data())
    def finish(self, data):
        row = data.draw(st.sampled_from(self.m.live_rows.tolist()))
        self.run(StepPlan(finished_rows=[row]))
        self.settle_snapshot()

    # ---------------------------------------------------------------- checks

    @invariant()
    def cached_blocks_hold_what_produced_them(self):
        m = self.m
        m.check_invariants()
        for block, content in self.snapshot.items():
            assert np.array_equal(self.kv[block], content), "a cached block was overwritten"
        for row in m.live_rows.tolist():
            cached = int(m.rows.cached[row])
            if cached:
                held = self.kv[m.table.host[row, :cached]].reshape(-1)
                assert np.array_equal(held, self.prompts[row][: cached * TPB])
                assert block_hashes(held, TPB)[:cached] == [
                    m.cache.hash_of[int(b)] for b in m.table.host[row, :cached]]
        pool = m.pool
        assert pool.num_free + pool.num_parked + int((pool.refcounts > 0).sum()) == 18

    def teardown(self):
        counters = self.m.counters
        event(f"hits: {counters.prefix_hit_tokens > 0}, evictions: {counters.evicted_blocks > 0}")
        self.m.step(StepPlan(finished_rows=self.m.live_rows))
        self.m.clear_prefix_cache()
        assert self.m.free_blocks == 18


SharingMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSharing = SharingMachine.TestCase


def test_the_shared_prefix_workload_reuses_most_prompt_tokens_and_evicts_when_short():
    roomy = simulate_sharing(SharingSpec(conversations=8, turns=3, osl=8))
    # Every turn after the first conversation's reuses the system prompt, later turns their
    # earlier prompts too.
    assert roomy.turns == 24 and roomy.hit_rate > 0.6 and roomy.evicted_blocks == 0
    short = simulate_sharing(SharingSpec(conversations=8, turns=3, osl=8, num_blocks=120))
    assert short.turns == 24 and short.evicted_blocks > 0
    assert short.prompt_tokens == roomy.prompt_tokens and short.hit_rate < roomy.hit_rate


def test_kvalloc_simulate_reports_the_hit_rate_of_the_shared_prefix_workload():
    proc = subprocess.run(
        [sys.executable, "-m", "kvalloc.server.cli", "simulate", "--shared-prefix", "256",
         "--osl", "8", "--tokens-per-block", "16", "--conversations", "4", "--no-progress"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["turns"] == 12 and 0 < summary["hit_rate"] <= 1
    ratio = summary["cached_tokens"] / summary["prompt_tokens"]
    assert abs(ratio - summary["hit_rate"]) < 1e-4
