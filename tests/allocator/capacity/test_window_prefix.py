"""Prefix caching in sliding-window groups (docs/design.md, "Sliding-window groups", "Prefix
caching"): a hit of h tokens in a windowed group needs only the blocks covering ``(h - W, h]``,
a window's released cached blocks stay in the cache until evicted, and groups of different
block sizes admit a request with one hit. The random schedules are `test_windows`' ``Prefix``
machines; these are the rules, one case each, in the numpy step and the compiled one.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvalloc.allocator import InvalidValue, KVCacheManager, PoolConfig, StepPlan
from kvalloc.allocator.capacity.block_table import RELEASED
from kvalloc.allocator.capacity.kv_events import BlockRemoved, BlockStored
from kvalloc.allocator.capacity.step.compiled import available
from kvalloc.allocator.capacity.step.plan import coerce
from kvalloc.allocator.capacity.windows.groups import GroupSpec, KVCacheGroups
from kvalloc.allocator.capacity.windows.hits import common_hit
from kvalloc.allocator.errors import InvariantViolation
from kvalloc.allocator.tools.simulate_prefix import SharingResult, SharingSpec, simulate_sharing

STEPS = [False, True] if available() else [False]
PROMPT = np.arange(40)


def config(num_blocks: int, tokens_per_block: int, window: int | None) -> PoolConfig:
    return PoolConfig(num_blocks=num_blocks, tokens_per_block=tokens_per_block, num_layers=1,
                      num_kv_heads=1, head_dim=8, device="cpu", max_batch_size=4,
                      max_seq_len=120, max_draft_len=3, overlap_scheduler=True, window=window)


def admit(m: KVCacheManager, tokens: np.ndarray) -> int:
    out = m.step(StepPlan(prompt_lens=[tokens.size], prompt_tokens=[tokens]))
    m.check_invariants()
    return int(out.admitted_rows[0])


def prefilled_and_finished(m: KVCacheManager, tokens: np.ndarray) -> np.ndarray:
    """A request prefills ``tokens`` whole, its forward runs (the window passes its early
    blocks), and it finishes; returns the blocks it held."""
    row = admit(m, tokens)
    blocks = m.table.host[row, : m.rows.num_blocks[row]].copy()
    m.step(StepPlan(lag=1))
    m.check_invariants()
    m.step(StepPlan(finished_rows=[row]))
    m.check_invariants()
    return blocks


@pytest.mark.parametrize("compiled", STEPS)
def test_the_window_parks_the_cached_blocks_it_passes(compiled: bool) -> None:
    """W = 8, T = 4: once the 40-token prompt has run, its first 8 columns are behind the window.
    They are cached blocks, so they are parked (evictable), not freed, and the row still counts
    them cached."""
    m = KVCacheManager(config(12, 4, 8), prefix_caching=True, compiled=compiled)
    row = admit(m, PROMPT)
    blocks = m.table.host[row, :10].copy()
    m.step(StepPlan(lag=1))
    m.check_invariants()
    assert (m.table.host[row, :8] == RELEASED).all() and m.rows.cached[row] == 10
    assert m.pool.parked() == blocks[:8].tolist() and m.held_blocks == 2
    assert m.free_blocks == 2


@pytest.mark.parametrize("compiled", STEPS)
def test_a_hit_survives_the_eviction_of_the_early_blocks(compiled: bool) -> None:
    """The early blocks are parked first, so they are evicted first (another request takes
    them). The same prompt again hits 36 tokens (one left to compute): a query at 36 reads keys
    29..36, columns 7 and 8, still cached; its row starts RELEASED before them."""
    m = KVCacheManager(config(12, 4, 8), prefix_caching=True, compiled=compiled)
    blocks = prefilled_and_finished(m, PROMPT)
    admit(m, np.arange(100, 120))  # 5 blocks: the 2 free ones, then 3 evicted
    hashes = m.prompt(PROMPT).hashes
    assert m.counters.evicted_blocks == 3
    assert [h in m.cache.block_of for h in hashes] == [False] * 3 + [True] * 7
    out = m.step(StepPlan(prompt_lens=[40], prompt_tokens=[PROMPT]))
    m.check_invariants()
    row = int(out.admitted_rows[0])
    assert out.cached_tokens.tolist() == [36]
    assert (m.table.host[row, :7] == RELEASED).all()
    assert m.table.host[row, 7:9].tolist() == blocks[7:9].tolist()
    assert m.rows.released[row] == 7 and m.rows.cached[row] == 9 and m.rows.num_blocks[row] == 10


@pytest.mark.parametrize("compiled", STEPS)
def test_a_hit_shorter_than_the_window_needs_every_block_of_it(compiled: bool) -> None:
    """W = 16: a hit of 8 tokens reads all of them, so its row releases nothing and holds both
    cached blocks."""
    m = KVCacheManager(config(12, 4, 16), prefix_caching=True, compiled=compiled)
    blocks = prefilled_and_finished(m, PROMPT[:10])
    out = m.step(StepPlan(prompt_lens=[10], prompt_tokens=[PROMPT[:10]]))
    m.check_invariants()
    row = int(out.admitted_rows[0])
    assert out.cached_tokens.tolist() == [8] and m.rows.released[row] == 0
    assert m.table.host[row, :2].tolist() == blocks[:2].tolist()


def test_a_released_cached_block_leaves_the_events_only_when_evicted() -> None:
    """The window passing a cached block says nothing to a router: the block still serves
    hits. Its `BlockRemoved` comes when the pool evicts it."""
    m = KVCacheManager(config(12, 4, 8), prefix_caching=True, kv_events=True)
    prefilled_and_finished(m, PROMPT)
    events = [e.event for e in m.drain_kv_events()]
    assert not any(isinstance(e, BlockRemoved) for e in events)
    assert sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored)) == 10
    admit(m, np.arange(100, 120))
    removed = [e.event for e in m.drain_kv_events() if isinstance(e.event, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == m.counters.evicted_blocks == 3


def written_later(compiled: bool) -> KVCacheManager:
    """W = 8, T = 4, blocks register when the caller says they are written."""
    return KVCacheManager(config(12, 4, 8), prefix_caching=True, register_when_written=True,
                          compiled=compiled)


@pytest.mark.parametrize("compiled", STEPS)
@pytest.mark.parametrize("lag", [1, 2])
def test_the_window_keeps_a_prompt_block_until_it_registers(compiled: bool, lag: int) -> None:
    """The 40-token prompt has run; the window has passed its first 8 columns (a query at 40
    reads from 33), but none is written yet as far as the cache knows: the release keeps them
    all. Once they register, the next step releases them, parked. At lag 2 the step after the
    admission still reads from 0, so the window passes them one call later."""
    m = written_later(compiled)
    row = m.step(StepPlan(prompt_lens=[40], prompt_tokens=[PROMPT], lag=lag)).admitted_rows[0]
    blocks = m.table.host[row, :10].copy()
    for _ in range(lag):
        m.step(StepPlan(lag=lag))
        m.check_invariants()
    assert m.rows.released[row] == 0 and m.window.keep_from[row] == 0 and m.free_blocks == 2
    m.mark_written(np.array([row]), np.array([40]))
    m.check_invariants()
    assert m.rows.cached[row] == 10 and m.rows.released[row] == 0
    m.step(StepPlan(lag=lag))
    m.check_invariants()
    assert (m.table.host[row, :8] == RELEASED).all() and m.rows.cached[row] == 10
    assert m.pool.parked() == blocks[:8].tolist() and m.held_blocks == 2


@pytest.mark.parametrize("compiled", STEPS)
def test_a_request_preempted_before_its_blocks_register_gives_them_all_back(
        compiled: bool) -> None:
    m = written_later(compiled)
    row = admit(m, PROMPT)
    m.step(StepPlan(lag=1))
    m.step(StepPlan(finished_rows=[row]))
    m.check_invariants()
    assert m.free_blocks == 12 and m.pool.num_parked == 0 and not m.cache.hash_of
    assert not m.cache.registering.any()


@pytest.mark.parametrize("compiled", STEPS)
def test_a_row_whose_blocks_another_row_registered_keeps_nothing(compiled: bool) -> None:
    """Two requests with one prompt, admitted together (nothing cached yet): the first one's
    blocks register, the second one's run stops at its first block (another holds its
    content), so the window releases its blocks to the free stack."""
    m = KVCacheManager(config(24, 4, 8), prefix_caching=True, register_when_written=True,
                       compiled=compiled)
    a, b = m.step(StepPlan(prompt_lens=[40, 40], prompt_tokens=[PROMPT, PROMPT])).admitted_rows
    m.step(StepPlan(lag=1))
    m.mark_written(np.array([a, b]), np.array([40, 40]))
    m.check_invariants()
    assert m.rows.cached[a] == 10 and m.rows.cached[b] == 0 and not m.cache.registering.any()
    m.step(StepPlan(lag=1))
    m.check_invariants()
    assert m.rows.released[a] == m.rows.released[b] == 8
    assert m.pool.num_parked == 8 and m.free_blocks == 4 + 8 and m.held_blocks == 4


@pytest.mark.parametrize("hit", [6, 8])
def test_a_hit_the_cache_cannot_serve_is_refused_and_changes_nothing(hit: int) -> None:
    """6 tokens is no whole block; a hit of 8 reads columns 0 and 1, evicted."""
    m = KVCacheManager(config(12, 4, 8), prefix_caching=True)
    prefilled_and_finished(m, PROMPT)
    admit(m, np.arange(100, 120))
    before = (m.pool.parked(), m.free_blocks, m.table.host.copy())
    with pytest.raises(InvalidValue) as info:
        m.step_arrays(coerce(StepPlan(prompt_lens=[40])), [PROMPT], hit_tokens=np.array([hit]))
    assert info.value.field == "hit_tokens"
    assert (m.pool.parked(), m.free_blocks) == before[:2]
    assert (m.table.host == before[2]).all()
    out = m.step_arrays(coerce(StepPlan(prompt_lens=[40])), [PROMPT], hit_tokens=np.array([32]))
    assert out is not None and out.cached_tokens.tolist() == [32]
    m.check_invariants()


def test_the_common_hit_is_the_longest_every_group_serves() -> None:
    """Full attention (T = 4) serves 0 to 12 tokens; a window (T = 2) serves 0, 8 and 12 (its
    early blocks evicted): both serve 12. Without the window's 12 they agree on 8, not on the
    full group's longest. Block sizes 4 and 6 agree only on multiples of 12."""
    full = np.ones(4, dtype=bool)
    assert common_hit([(full, 4), (np.array([1, 0, 0, 0, 1, 0, 1], dtype=bool), 2)]) == 12
    assert common_hit([(full, 4), (np.array([1, 0, 0, 0, 1, 0, 0], dtype=bool), 2)]) == 8
    assert common_hit([(np.ones(7, dtype=bool), 4), (np.ones(5, dtype=bool), 6)]) == 24
    assert common_hit([(full, 4), (np.ones(2, dtype=bool), 6)]) == 0


@pytest.mark.parametrize("compiled", STEPS)
def test_two_groups_with_different_block_sizes_agree_on_one_hit(compiled: bool) -> None:
    """The first request's forward wrote 42 of its 50 tokens: the full group (T = 4) caches 40
    of them, the windowed one (T = 2, W = 7) 42. The same prompt again gets 40 in both groups:
    the longest hit both serve, a multiple of both block sizes. The windowed row starts with
    the 17 columns behind a query at 40 released."""
    groups = KVCacheGroups([GroupSpec("full", config(80, 4, None)),
                            GroupSpec("window", config(40, 2, 7))], prefix_caching=True,
                           compiled=compiled)
    tokens = np.arange(50)
    a = groups.step(StepPlan(prompt_lens=[50], prompt_tokens=[tokens])).outcome.admitted_rows
    groups.mark_written(a, np.array([42]))
    groups.step(StepPlan(finished_rows=a))
    groups.check_invariants()
    out = groups.step(StepPlan(prompt_lens=[50], prompt_tokens=[tokens]))
    groups.check_invariants()
    row = int(out.outcome.admitted_rows[0])
    assert out.outcome.cached_tokens.tolist() == [40]
    assert {name: o.cached_tokens.tolist() for name, o in out.groups.items()} == {
        "full": [40], "window": [40]}
    window = groups.managers["window"]
    assert window.rows.released[row] == (40 - 7 + 1) // 2 == 17 and window.rows.cached[row] == 20
    assert groups.managers["full"].rows.cached[row] == 10


def test_check_invariants_catches_a_released_cached_block_on_the_free_stack() -> None:
    """Freeing a cached block the window passed, rather than parking it, loses a block the
    cache still maps: the invariants say so."""
    m = KVCacheManager(config(12, 4, 8), prefix_caching=True, compiled=False)
    admit(m, PROMPT)
    m.step(StepPlan(lag=1))
    block = m.pool.parked()[0]
    m.pool.unpark(block)
    m.pool.free_stack[m.pool.num_free] = block
    m.pool.num_free += 1
    with pytest.raises(InvariantViolation, match="registered blocks"):
        m.check_invariants()


def test_the_shared_prefix_workload_keeps_its_hits_when_windowed_blocks_are_evicted() -> None:
    """`kvalloc simulate --shared-prefix --window`: with room to spare a windowed pool hits
    exactly what full attention does; a pool small enough to evict loses under full
    attention, but a window's hits need only their last blocks, which the LRU evicts last."""
    def run(**options: int) -> SharingResult:
        return simulate_sharing(SharingSpec(conversations=8, turns=3, osl=8, **options))
    roomy_full, roomy = run(), run(window=64)
    assert roomy == roomy_full and roomy.evicted_blocks == 0
    short_full, short = run(num_blocks=120), run(num_blocks=120, window=64)
    assert short_full.evicted_blocks > 0 and short_full.hit_rate < roomy.hit_rate
    assert short.evicted_blocks > 0 and short.hit_rate == roomy.hit_rate
