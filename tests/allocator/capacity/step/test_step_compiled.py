"""Differential tests: the compiled step (numba) against the numpy step, its specification.

Two managers over the same pool run the same random plans, valid and invalid: after every plan
both must have raised the same typed error (class, field, message) or returned the same outcome
(every array, dtype included), and their whole state must be identical: every row array, the
pool's free stack (all of it), its top and reference counts, the block table on the host and on
the device, the free-row stack, the counters and the request-id edge. An error must also leave
the state exactly as it was before the plan.

Plans are drawn around the managers' current state, at lag 1 or 2 (results for pending grants,
grants for idle requests and at lag 2 for pending ones, chunks for prefilling ones, new requests,
finishes) and then, often, broken in one of the ways a caller can break them: a stale or
out-of-range row, a row listed twice or in two lists that exclude each other, a value out of
bounds, too many blocks.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvalloc.allocator import KVAllocError, KVCacheManager, PoolConfig, StepPlan
from kvalloc.allocator.capacity.step import plan as step_plan
from kvalloc.allocator.capacity.step.compiled import available, driver

pytestmark = pytest.mark.skipif(not available(), reason="numba is not installed")

CONFIGS = {
    "overlap": dict(num_blocks=24, tokens_per_block=4, max_seq_len=24, max_draft_len=3,
                    max_batch_size=5),
    "no_overlap": dict(num_blocks=30, tokens_per_block=3, max_seq_len=20, max_draft_len=2,
                       max_batch_size=4, overlap_scheduler=False),
    "one_token_blocks": dict(num_blocks=60, tokens_per_block=1, max_seq_len=16, max_draft_len=3,
                             max_batch_size=4),
    "unreclaimed": dict(num_blocks=40, tokens_per_block=4, max_seq_len=24, max_draft_len=3,
                        max_batch_size=5, slack_policy="unreclaimed"),
    "no_slack": dict(num_blocks=30, tokens_per_block=4, max_seq_len=24, max_draft_len=3,
                     max_batch_size=5, slack_policy="none"),
    # A sliding-window group's: the compiled step's last phase gives back the columns behind
    # every window (the numpy step runs `WindowRelease.release` after it).
    "window": dict(num_blocks=16, tokens_per_block=2, max_seq_len=24, max_draft_len=3,
                   max_batch_size=5, window=5),
}

LISTS = ("revert_rows", "result_rows", "finished_rows", "grant_rows", "padding_rows",
         "prefill_rows")
VALUES = {"num_accepted": "result_rows", "draft_lens": "grant_rows",
          "padded_draft_lens": "padding_rows", "prefill_tokens": "prefill_rows",
          "prompt_lens": None, "first_chunks": None}


def make_pair(name: str, prefix_caching: bool = False) -> tuple[KVCacheManager, KVCacheManager]:
    cfg = PoolConfig(**{"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "device": "cpu",
                        **CONFIGS[name]})
    return tuple(KVCacheManager(cfg, compiled=compiled, prefix_caching=prefix_caching)
                 for compiled in (False, True))


def state_of(m: KVCacheManager) -> dict:
    """Everything a step can change, as plain values."""
    out = {f"rows.{k}": v.tolist() for k, v in vars(m.rows).items()}
    out.update({
        "pool.free_stack": m.pool.free_stack.tolist(),
        "pool.num_free": m.pool.num_free,
        "pool.refcounts": m.pool.refcounts.tolist(),
        "pool.lru": [m.pool.lru.tolist(), m.pool.lru_prev.tolist(), m.pool.lru_next.tolist()],
        "cache": None if m.cache is None else sorted(m.cache.hash_of.items()),
        "table.host": m.table.host.tolist(),
        "table.device": m.table.device_table.numpy().tolist(),
        "table.free_rows": m.table.free_rows.tolist(),
        "table.num_free_rows": m.table.num_free_rows,
        "counters": dataclasses.asdict(m.counters),
        "ids": sorted(map(str, m.request_ids)),
        "window": None if m.window is None else [m.window.read_from.tolist(),
                                                  m.window.last_start.tolist(),
                                                  m.window.keep_from.tolist()],
    })
    return out


def outcome_of(out: object) -> object:
    """A step's outcome as plain values (a per-request call's result as it is)."""
    if not dataclasses.is_dataclass(out):
        return out
    return {f.name: (str(getattr(out, f.name).dtype), getattr(out, f.name).tolist())
            for f in dataclasses.fields(out)}


def run_both(pair: tuple[KVCacheManager, KVCacheManager], call) -> str:
    """Apply ``call`` to both managers; assert they agree. Returns "ok" or the error's name."""
    results = []
    for m in pair:
        before = state_of(m)
        try:
            out = call(m)
        except KVAllocError as err:
            after = copy.deepcopy(state_of(m))
            refusal = {k: after["counters"][k] - before["counters"][k] for k in after["counters"]}
            # Only the refusal counter an error may bump moved (row_overflows).
            assert {k: v for k, v in refusal.items() if v} in ({}, {"row_overflows": 1})
            after["counters"] = before["counters"]
            assert after == before, "an error changed the state"
            results.append(("error", type(err).__name__, err.field, str(err)))
        else:
            results.append(("ok", outcome_of(out)))
        m.check_invariants()
    assert results[0] == results[1]
    assert state_of(pair[0]) == state_of(pair[1])
    return results[0][0] if results[0][0] == "ok" else results[0][1]


def checked_then_run(pair: tuple[KVCacheManager, KVCacheManager], plan: StepPlan) -> str:
    """The step stopped before its first change (``apply=False``) says what the step then
    does, in both managers, and changes nothing."""
    def check(m: KVCacheManager) -> None:
        before = state_of(m)
        arrays = step_plan.coerce(plan)
        tokens = step_plan.prompt_token_arrays(plan.prompt_tokens, arrays.prompt_lens)
        assert m.step_arrays(arrays, tokens, apply=False) is None
        assert state_of(m) == before

    checked = run_both(pair, check)
    ran = run_both(pair, lambda m: m.step(plan))
    assert checked == ("ok" if ran == "ok" else ran)
    return ran


def categories(m: KVCacheManager) -> dict[str, list[int]]:
    r = m.rows
    live = m.live_rows.tolist()
    return {
        "pending": [x for x in live if r.pending[x]],
        "idle": [x for x in live if not r.pending[x] and r.history[x] >= r.prompt_len[x]],
        "prefilling": [x for x in live if r.history[x] < r.prompt_len[x]],
        "live": live,
    }


@st.composite
def plans(draw, m: KVCacheManager) -> StepPlan:
    cfg = m.config
    n = cfg.max_batch_size
    groups = categories(m)
    def pick(rows: list[int], most: int | None = None) -> list[int]:
        return draw(st.lists(st.sampled_from(rows), unique=True, max_size=most)) if rows else []

    pending = pick(groups["pending"])
    split = draw(st.integers(0, len(pending)))
    reverts, results = pending[:split], pending[split:]
    idle_and_settled = [x for x in groups["idle"] + results if x not in reverts]
    # At lag 2 a grant may also find a step unsettled (sometimes two: an error both must name).
    lag = draw(st.sampled_from([1, 2]))
    grants = pick(idle_and_settled + ([x for x in groups["pending"] if x not in idle_and_settled]
                                      if lag == 2 else []))
    padding = pick([x for x in groups["pending"] + grants if x not in reverts and x not in results])
    prefill = pick(groups["prefilling"])
    scheduled = set(grants) | set(padding) | set(prefill)
    finished = pick([x for x in groups["live"] if x not in scheduled], most=1)
    d = cfg.max_draft_len
    plan = {
        "revert_rows": reverts,
        "result_rows": results,
        "num_accepted": [draw(st.integers(0, int(m.rows.behind_draft[x] if m.rows.behind[x]
                                                 else m.rows.draft_len[x]))) for x in results],
        "finished_rows": finished,
        "grant_rows": grants,
        "draft_lens": [draw(st.integers(0, d)) for _ in grants],
        "padding_rows": padding,
        "padded_draft_lens": [draw(st.integers(0, d)) for _ in padding],
        "prefill_rows": prefill,
        "prefill_tokens": [draw(st.integers(1, max(1, int(m.rows.prompt_len[x]
                                                         - m.rows.history[x]))))
                           for x in prefill],
    }
    top = cfg.max_seq_len  # long prompts weigh more: pools run dry and rows overflow
    prompts = draw(st.lists(st.integers(1, top) | st.integers(top - 3, top), max_size=3))
    plan["prompt_lens"] = prompts
    plan["first_chunks"] = [draw(st.integers(0, p)) for p in prompts] if draw(st.booleans()) \
        else []
    if m.cache is not None and draw(st.integers(0, 3)):
        # A few prompt families: requests of one family share every block up to the shorter.
        families = [draw(st.sampled_from([None, *range(len(FAMILIES))])) for _ in prompts]
        plan["prompt_tokens"] = [None if k is None else FAMILIES[k][:p]
                                 for k, p in zip(families, prompts, strict=True)]
    # Break it, often, in one of the ways a caller can.
    damage = draw(st.sampled_from(["none", "none", "none", "row", "twice", "overlap", "value",
                                   "length", "state"]))
    if damage == "row":
        name = draw(st.sampled_from(LISTS))
        bad = draw(st.sampled_from([-1, n, n + 5, *sorted(set(range(n)) - set(groups["live"]))]))
        plan[name] = [*plan[name], bad]
        plan.update(_pad_values(plan, name, draw))
    elif damage == "twice":
        name = draw(st.sampled_from(LISTS))
        if plan[name]:
            plan[name] = [*plan[name], plan[name][0]]
            plan.update(_pad_values(plan, name, draw))
    elif damage == "overlap" and groups["live"]:
        first, second = draw(st.lists(st.sampled_from(LISTS), min_size=2, max_size=2,
                                      unique=True))
        row = draw(st.sampled_from(groups["live"]))
        for name in (first, second):
            if row not in plan[name]:
                plan[name] = [*plan[name], row]
                plan.update(_pad_values(plan, name, draw))
    elif damage == "value":
        name = draw(st.sampled_from([k for k in VALUES if plan[k]] or ["prompt_lens"]))
        values = list(plan[name]) or [0]
        i = draw(st.integers(0, len(values) - 1))
        values[i] = draw(st.sampled_from([-1, 0, d + 1, cfg.max_seq_len + 1, 10**6]))
        plan[name] = values
        if name == "prompt_lens" and plan["first_chunks"]:
            plan["first_chunks"] = [*plan["first_chunks"], 0][: len(values)]
    elif damage == "state" and groups["live"]:
        # A live row in a list its state does not allow (a grant during prefill, a revert
        # without a grant, a chunk past the prompt, ...).
        name = draw(st.sampled_from(LISTS))
        row = draw(st.sampled_from(groups["live"]))
        if row not in plan[name]:
            plan[name] = [*plan[name], row]
            plan.update(_pad_values(plan, name, draw))
    elif damage == "length":
        name = draw(st.sampled_from(list(VALUES)))
        plan[name] = [*plan[name], 1]
    return StepPlan(**plan, strict_grants=draw(st.integers(0, 5)) == 0, lag=lag)


FAMILIES = [np.arange(100) % 5 + 10 * k for k in range(2)]


def _pad_values(plan: dict, name: str, draw) -> dict:
    """Keep the value list that goes with row list ``name`` the same length."""
    for values, rows in VALUES.items():
        if rows == name:
            return {values: [*plan[values], draw(st.integers(0, 2))]}
    return {}


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_compiled_step_equals_the_numpy_step_on_random_plans(config, data):
    pair = make_pair(config)
    outcomes = []
    for _ in range(data.draw(st.integers(5, 30), label="steps")):
        plan = data.draw(plans(pair[0]), label="plan")
        outcomes.append(checked_then_run(pair, plan))
    # Everything freed returns the whole pool in both.
    run_both(pair, lambda m: m.step(StepPlan(finished_rows=m.live_rows)))
    assert pair[0].free_blocks == pair[0].pool.num_blocks


@pytest.mark.parametrize("config", ["overlap", "one_token_blocks"])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_compiled_step_equals_the_numpy_step_with_prefix_caching(config, data):
    """Shared prefixes, parked blocks, eviction under pressure: still the same step."""
    pair = make_pair(config, prefix_caching=True)
    for _ in range(data.draw(st.integers(5, 30), label="steps")):
        plan = data.draw(plans(pair[0]), label="plan")
        checked_then_run(pair, plan)
    run_both(pair, lambda m: m.step(StepPlan(finished_rows=m.live_rows)))
    pool = pair[0].pool
    assert pool.num_free + pool.num_parked == pool.num_blocks
    # Every parked block is reusable until evicted: the pool is whole again after clearing.
    for m in pair:
        m.clear_prefix_cache()
        m.check_invariants()
    assert pool.num_free == pool.num_blocks and not pair[0].cache.hash_of


@pytest.mark.parametrize("config", ["overlap", "no_overlap"])
def test_per_request_calls_agree_too(config):
    """The id edge over both steps: the same calls, the same results and errors."""
    pair = make_pair(config)
    calls = [
        lambda m: m.add_request("a", 10),
        lambda m: m.add_request("b", 20, first_chunk=8),
        lambda m: m.add_request("a", 3),  # duplicate
        lambda m: m.try_allocate_generation("a", 3),
        lambda m: m.extend_capacity_for_tokens("a", 1),  # below the granted D
        lambda m: m.update_resources("a", 2),
        lambda m: m.extend_prefill("b", 12),
        lambda m: m.prepare_draft_resources("b", 2),
        lambda m: m.revert_allocate_generation("b"),
        lambda m: m.update_resources("b", 0),  # no pending grant
        lambda m: m.free("a"),
        lambda m: m.free("a"),  # unknown by now
    ]
    for call in calls:
        run_both(pair, call)


def test_compiled_is_the_default_when_numba_imports(make_config):
    assert KVCacheManager(make_config()).compiled is True
    assert KVCacheManager(make_config(), compiled=False).compiled is False


def test_without_numba_the_default_is_the_numpy_step(make_config, monkeypatch):
    monkeypatch.setattr(driver, "numba", None)
    m = KVCacheManager(make_config())
    assert m.compiled is False
    assert m.step(StepPlan(prompt_lens=[5])).admitted_rows.tolist() == [0]
    with pytest.raises(ImportError, match="numba"):
        KVCacheManager(make_config(), compiled=True)


def test_read_only_and_strided_plan_arrays_are_accepted(make_config):
    """Arrays a transport hands over (read-only buffers, strided views) take the same path."""
    pair = (KVCacheManager(make_config(), compiled=False),
            KVCacheManager(make_config(), compiled=True))
    prompts = np.frombuffer(np.array([4, 9, 2], dtype=np.int64).tobytes(), dtype=np.int64)
    assert not prompts.flags.writeable
    run_both(pair, lambda m: m.step(StepPlan(prompt_lens=prompts)))
    rows = np.array([0, 99, 1, 99, 2, 99], dtype=np.int64)[::2]
    run_both(pair, lambda m: m.step(StepPlan(grant_rows=rows, draft_lens=np.array([1, 2, 3]))))


def test_a_checked_plan_runs_the_step_a_coerced_plan_runs(make_config):
    """`checked_plan` (the service's path) settles the array type alone: read-only and strided
    columns are copied into the one type the compiled step is built for, and the step is the
    one `coerce` gives, its errors included."""
    coerced, checked = (KVCacheManager(make_config(), compiled=True) for _ in range(2))

    def read_only(*values: int) -> np.ndarray:
        return np.frombuffer(np.array(values, dtype=np.int64).tobytes(), dtype=np.int64)

    empty = read_only()
    columns = {name: empty for name in ("revert_rows", "result_rows", "num_accepted",
                                         "finished_rows", "grant_rows", "draft_lens",
                                         "padding_rows", "padded_draft_lens", "prefill_rows",
                                         "prefill_tokens", "prompt_lens", "first_chunks")}
    steps = [{"prompt_lens": read_only(4, 9, 2)},
             {"grant_rows": np.array([0, 99, 1, 99, 2, 99], dtype=np.int64)[::2],
              "draft_lens": read_only(1, 2, 3)},
             {"result_rows": read_only(0, 1, 2), "num_accepted": read_only(1, 0, 3),
              "finished_rows": read_only(1)},
             {"grant_rows": read_only(0), "draft_lens": read_only(99)}]  # past max_draft_len
    for step in steps:
        outcomes, errors = [], []
        for run in (lambda c: coerced.step(StepPlan(**c)),
                    lambda c: checked.step_arrays(step_plan.checked_plan(**c))):
            try:
                outcomes.append(run({**columns, **step}))
            except KVAllocError as err:
                errors.append((type(err), str(err), err.field))
        assert errors == [] or (len(errors) == 2 and errors[0] == errors[1])
        if outcomes:
            a, b = outcomes
            assert all(np.array_equal(getattr(a, f.name), getattr(b, f.name))
                       for f in dataclasses.fields(a))
        assert state_of(coerced) == state_of(checked)
    assert len(driver._step.signatures) == 1  # every plan had the one type
