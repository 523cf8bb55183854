"""Bad input: every typed error, raised through the public API, changes no state.

docs/design.md ("Errors and invariants"): each error is typed, its message names the field at fault
(``str(err)`` starts with ``err.field``), and the manager is exactly as it was before the call:
every request's capacity / history / slack / pending draft / blocks / row, the free blocks, the
block table on the host and on the device, the pool's free stack and reference counts, the
free-row stack, the request-id edge, and the counters. Batched steps name requests by row: a row
that is out of range or not live is an unknown request. The one documented exception is a
refusal counter (``requests_refused``, ``grants_refused``, ``row_overflows``): a refusal is an
event the metrics export, so it is counted once, and nothing else moves.

Also: `PoolConfig` rejects invalid combinations with a pydantic ValidationError naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import numpy as np
import pydantic
import pytest
import torch
from kvalloc.allocator import (
    REFUSED_OUT_OF_BLOCKS,
    AcceptedExceedsDrafts,
    BatchFull,
    BlockTableOverflow,
    DraftLenExceeded,
    DuplicateRequest,
    GrantPending,
    InvalidValue,
    KVAllocError,
    KVCacheManager,
    NoPendingGrant,
    OutOfBlocks,
    PrefillIncomplete,
    StepPlan,
    UnknownRequest,
)

# conftest.SMALL_POOL: 64 blocks of 4 tokens, 8 rows, max_seq_len 64, max_draft_len 3, overlap:
# max_blocks_per_seq = ceil((64 + 3 + 1 + 3) / 4) = 18.
TPB, ROWS, MAX_SEQ, MAX_D, ROW_BLOCKS = 4, 8, 64, 3, 18


def base(m: KVCacheManager) -> None:
    """Three requests in the three states a request can be in.

    - "run": generating, holds a pending grant of D=2 (cap 10 + 1 + 2 + 2 = 15, 4 blocks);
    - "idle": generating, no pending grant (9 -> grant 3 -> 1 accepted: cap = history = 11);
    - "pre": chunked prefill, 8 of its 20 prompt tokens scheduled.
    """
    m.add_request("run", 10)
    assert m.try_allocate_generation("run", 2)
    m.add_request("idle", 9)
    assert m.try_allocate_generation("idle", 3)
    m.update_resources("idle", 1)
    m.add_request("pre", 20, first_chunk=8)


def exhausted(m: KVCacheManager) -> None:
    """base, then hogs take every free block (one row stays free)."""
    base(m)
    i = 0
    while m.free_blocks:
        m.add_request(f"hog{i}", min(m.free_blocks, MAX_SEQ // TPB) * TPB)
        i += 1
    assert m.free_blocks == 0 and m.table.num_free_rows > 0


def full_rows(m: KVCacheManager) -> None:
    """base, then one-token requests take every row (blocks are left)."""
    base(m)
    for i in range(ROWS - 3):
        m.add_request(f"tiny{i}", 1)
    assert m.table.num_free_rows == 0 and m.free_blocks > 0


def edge(m: KVCacheManager) -> None:
    """base, plus two requests at the end of their rows.

    "edge": prompt 64, one step with all 3 drafts accepted: cap = history = 68 (17 blocks); a
    D=3 grant would need 68 + 7 = 75 tokens = 19 blocks > 18.
    "edge0": the same, then a D=0 grant (69 tokens, 18 blocks); padding it to 3 needs 75.
    """
    base(m)
    for req in ("edge", "edge0"):
        m.add_request(req, MAX_SEQ)
        assert m.try_allocate_generation(req, 3)
        m.update_resources(req, 3)
    assert m.try_allocate_generation("edge0", 0)


def freed(m: KVCacheManager) -> None:
    """base, then a request that was admitted and freed: its row is stale."""
    base(m)
    m.freed_row = m.add_request("gone", 4)
    m.free("gone")


SETUPS: dict[str, Callable[[KVCacheManager], None]] = {
    "base": base, "exhausted": exhausted, "full_rows": full_rows, "edge": edge, "freed": freed,
}


def rows(m: KVCacheManager, *names: str) -> np.ndarray:
    """The rows of requests added by id; "nope" stands for a row no live request holds."""
    free = sorted(set(range(ROWS)) - set(m.live_rows.tolist()))
    return np.array([free[0] if n == "nope" else m.row(n) for n in names], dtype=np.int64)


def plain(value: object) -> object:
    """A comparable, detached copy of one attribute."""
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tolist())
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), str(value.device), value.cpu().tolist())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return copy.deepcopy(value)


def snapshot(m: KVCacheManager) -> dict:
    """ALL manager state: the public view, and every attribute of the manager, its pool and its
    block table (so state the queries do not show is covered too)."""
    public = {
        req: (m.capacity(req), m.history(req), m.pending_overlap_slack(req),
              m.pending_draft_len(req), m.num_blocks(req), m.row(req), m.block_ids(req).tolist())
        for req in m.request_ids
    }
    internals = {}
    for owner_name, owner in (("manager", m), ("rows", m.rows), ("pool", m.pool),
                              ("table", m.table)):
        for k, v in vars(owner).items():
            # The device copies (``_copies``) are compared as ``device`` below.
            if k in ("config", "pool", "table", "rows", "state", "device", "counters",
                     "device_table", "_copies", "_run"):
                continue
            internals[f"{owner_name}.{k}"] = plain(v)
    return {
        "requests": public,
        "views": [m.view(row) for row in m.live_rows.tolist()].__repr__(),
        "free_blocks": m.free_blocks,
        "host": m.table.host.tolist(),
        "device": m.table.device_table.cpu().tolist(),
        "counters": dataclasses.asdict(m.counters),
        "internals": internals,
    }


def assert_unchanged(before: dict, after: dict, counted: dict[str, int] | None = None) -> None:
    expected = copy.deepcopy(before)
    for name, delta in (counted or {}).items():
        expected["counters"][name] += delta
    for key in expected:
        assert after[key] == expected[key], f"{key} changed"


# (setup, call, expected error, refusal counters it bumps)
Case = tuple[str, Callable[[KVCacheManager], object], type[KVAllocError], dict[str, int]]

CASES: dict[str, Case] = {
    # ---- unknown request
    "capacity unknown": ("base", lambda m: m.capacity("nope"), UnknownRequest, {}),
    "history unknown": ("base", lambda m: m.history("nope"), UnknownRequest, {}),
    "slack unknown": ("base", lambda m: m.pending_overlap_slack("nope"), UnknownRequest, {}),
    "num_blocks unknown": ("base", lambda m: m.num_blocks("nope"), UnknownRequest, {}),
    "row unknown": ("base", lambda m: m.row("nope"), UnknownRequest, {}),
    "unhashable id": ("base", lambda m: m.capacity(["run"]), UnknownRequest, {}),
    "try_allocate unknown": ("base", lambda m: m.try_allocate_generation("nope", 1),
                             UnknownRequest, {}),
    "prepare_draft unknown": ("base", lambda m: m.prepare_draft_resources("nope", 1),
                              UnknownRequest, {}),
    "padding unknown": ("base", lambda m: m.extend_capacity_for_tokens("nope", 1),
                        UnknownRequest, {}),
    "revert unknown": ("base", lambda m: m.revert_allocate_generation("nope"), UnknownRequest, {}),
    "update unknown": ("base", lambda m: m.update_resources("nope", 0), UnknownRequest, {}),
    "free unknown": ("base", lambda m: m.free("nope"), UnknownRequest, {}),
    "prefill unknown": ("base", lambda m: m.extend_prefill("nope", 1), UnknownRequest, {}),
    "step: one unknown among valid entries": (
        "base", lambda m: m.step(StepPlan(result_rows=rows(m, "run"), num_accepted=[1],
                                          grant_rows=rows(m, "idle", "nope"), draft_lens=[1, 1])),
        UnknownRequest, {}),
    "step: finish unknown": ("base", lambda m: m.step(StepPlan(
        finished_rows=rows(m, "run", "nope"))),
        UnknownRequest, {}),
    # ---- duplicate request
    "add existing": ("base", lambda m: m.add_request("run", 5), DuplicateRequest, {}),
    "step: revert listed twice": ("base", lambda m: m.step(StepPlan(
        revert_rows=rows(m, "run", "run"))),
        DuplicateRequest, {}),
    "step: padding listed twice": ("base", lambda m: m.step(StepPlan(
        padding_rows=rows(m, "run", "run"), padded_draft_lens=[3, 3])), DuplicateRequest, {}),
    "step: prefill listed twice": ("base", lambda m: m.step(StepPlan(
        prefill_rows=rows(m, "pre", "pre"), prefill_tokens=[1, 1])), DuplicateRequest, {}),
    "step: grant listed twice": ("base", lambda m: m.step(StepPlan(
        grant_rows=rows(m, "idle", "idle"),
        draft_lens=[1, 1])),
        DuplicateRequest, {}),
    "step: result listed twice": ("base", lambda m: m.step(StepPlan(
        result_rows=rows(m, "run", "run"),
        num_accepted=[0, 0])),
        DuplicateRequest, {}),
    "step: finish listed twice": ("base", lambda m: m.step(StepPlan(
        finished_rows=rows(m, "run", "run"))),
        DuplicateRequest, {}),
    # ---- draft_len above max_draft_len
    "try_allocate D too big": ("base", lambda m: m.try_allocate_generation("idle", MAX_D + 1),
                               DraftLenExceeded, {}),
    "prepare_draft D too big": ("base", lambda m: m.prepare_draft_resources("idle", MAX_D + 1),
                                DraftLenExceeded, {}),
    "padding D too big": ("base", lambda m: m.extend_capacity_for_tokens("run", MAX_D + 1),
                          DraftLenExceeded, {}),
    "step: grant D too big": ("base", lambda m: m.step(StepPlan(grant_rows=rows(m, "idle"),
                                                                draft_lens=[MAX_D + 1])),
                              DraftLenExceeded, {}),
    # ---- accepted > drafts
    "update accepted > D": ("base", lambda m: m.update_resources("run", 3),
                            AcceptedExceedsDrafts, {}),
    "step: accepted > D": ("base", lambda m: m.step(StepPlan(result_rows=rows(m, "run"),
                                                             num_accepted=[3])),
                           AcceptedExceedsDrafts, {}),
    # ---- negative / out-of-range / non-integer values
    "negative draft_len": ("base", lambda m: m.try_allocate_generation("idle", -1),
                           InvalidValue, {}),
    "negative accepted": ("base", lambda m: m.update_resources("run", -1), InvalidValue, {}),
    "negative padding": ("base", lambda m: m.extend_capacity_for_tokens("run", -1),
                         InvalidValue, {}),
    "padding below granted D": ("base", lambda m: m.extend_capacity_for_tokens("run", 1),
                                InvalidValue, {}),
    "prompt 0": ("base", lambda m: m.add_request("n", 0), InvalidValue, {}),
    "negative prompt": ("base", lambda m: m.add_request("n", -5), InvalidValue, {}),
    "prompt above max_seq_len": ("base", lambda m: m.add_request("n", MAX_SEQ + 1),
                                 InvalidValue, {}),
    "first_chunk 0": ("base", lambda m: m.add_request("n", 10, first_chunk=0), InvalidValue, {}),
    "first_chunk > prompt": ("base", lambda m: m.add_request("n", 10, first_chunk=11),
                             InvalidValue, {}),
    "prefill 0 tokens": ("base", lambda m: m.extend_prefill("pre", 0), InvalidValue, {}),
    "negative prefill": ("base", lambda m: m.extend_prefill("pre", -1), InvalidValue, {}),
    "prefill past the prompt": ("base", lambda m: m.extend_prefill("pre", 13), InvalidValue, {}),
    "prefill of a generating request": ("base", lambda m: m.extend_prefill("idle", 1),
                                        InvalidValue, {}),
    "float draft_len": ("base", lambda m: m.try_allocate_generation("idle", 1.5),
                        InvalidValue, {}),
    "bool accepted": ("base", lambda m: m.update_resources("run", True), InvalidValue, {}),
    "string prompt": ("base", lambda m: m.add_request("n", "10"), InvalidValue, {}),
    "None draft_len": ("base", lambda m: m.try_allocate_generation("idle", None),
                       InvalidValue, {}),
    "unhashable new id": ("base", lambda m: m.add_request(["n"], 4), InvalidValue, {}),
    # ---- grant state machine
    "update without grant": ("base", lambda m: m.update_resources("idle", 0), NoPendingGrant, {}),
    "revert without grant": ("base", lambda m: m.revert_allocate_generation("idle"),
                             NoPendingGrant, {}),
    "padding without grant": ("base", lambda m: m.extend_capacity_for_tokens("idle", 2),
                              NoPendingGrant, {}),
    "step: revert without grant": ("base", lambda m: m.step(StepPlan(revert_rows=rows(m, "idle"))),
                                   NoPendingGrant, {}),
    "step: padding after its revert": (
        "base", lambda m: m.step(StepPlan(revert_rows=rows(m, "run"), padding_rows=rows(m, "run"),
                                          padded_draft_lens=[3])), NoPendingGrant, {}),
    "grant while pending": ("base", lambda m: m.try_allocate_generation("run", 1),
                            GrantPending, {}),
    "draft grant while pending": ("base", lambda m: m.prepare_draft_resources("run", 1),
                                  GrantPending, {}),
    "step: grant while pending": ("base", lambda m: m.step(StepPlan(
        grant_rows=rows(m, "idle", "run"),
        draft_lens=[1, 1])),
        GrantPending, {}),
    "grant during prefill": ("base", lambda m: m.try_allocate_generation("pre", 1),
                             PrefillIncomplete, {}),
    "draft grant during prefill": ("base", lambda m: m.prepare_draft_resources("pre", 1),
                                   PrefillIncomplete, {}),
    "step: grant during prefill": ("base", lambda m: m.step(StepPlan(grant_rows=rows(m, "pre"),
                                                                     draft_lens=[0])),
                                   PrefillIncomplete, {}),
    # ---- rows and blocks run out
    "add to a full batch": ("full_rows", lambda m: m.add_request("n", 1), BatchFull,
                            {"requests_refused": 1}),
    "add without blocks": ("exhausted", lambda m: m.add_request("n", 5), OutOfBlocks,
                           {"requests_refused": 1}),
    "draft grant without blocks": ("exhausted", lambda m: m.prepare_draft_resources("idle", 3),
                                   OutOfBlocks, {}),
    "padding without blocks": ("exhausted", lambda m: m.extend_capacity_for_tokens("run", 3),
                               OutOfBlocks, {}),
    "prefill without blocks": ("exhausted", lambda m: m.extend_prefill("pre", 12), OutOfBlocks,
                               {}),
    "step: strict grants without blocks": (
        "exhausted", lambda m: m.step(StepPlan(grant_rows=rows(m, "idle"), draft_lens=[3],
                                               strict_grants=True)), OutOfBlocks, {}),
    "step: padding of an earlier grant without blocks": (
        "exhausted", lambda m: m.step(StepPlan(padding_rows=rows(m, "run"), padded_draft_lens=[3])),
        OutOfBlocks, {}),
    # ---- row overflow (max_blocks_per_seq)
    "grant past the row": ("edge", lambda m: m.try_allocate_generation("edge", 3),
                           BlockTableOverflow, {"row_overflows": 1}),
    "draft grant past the row": ("edge", lambda m: m.prepare_draft_resources("edge", 3),
                                 BlockTableOverflow, {"row_overflows": 1}),
    "padding past the row": ("edge", lambda m: m.extend_capacity_for_tokens("edge0", 3),
                             BlockTableOverflow, {"row_overflows": 1}),
    "step: a grant past the row among valid ones": (
        "edge", lambda m: m.step(StepPlan(result_rows=rows(m, "run"), num_accepted=[2],
                                          grant_rows=rows(m, "idle", "edge", "run"),
                                          draft_lens=[1, 3, 3])),
        BlockTableOverflow, {"row_overflows": 1}),
    # ---- StepPlan list lengths
    "step: fewer accepted counts than results": (
        "base", lambda m: m.step(StepPlan(
        result_rows=rows(m, "run"), num_accepted=[])), InvalidValue, {}),
    "step: more accepted counts than results": (
        "base", lambda m: m.step(StepPlan(result_rows=rows(m, "run"), num_accepted=[0, 1])),
        InvalidValue, {}),
    "step: draft_lens length": ("base", lambda m: m.step(StepPlan(grant_rows=rows(m, "idle"),
                                                                  draft_lens=[1, 1])),
                                InvalidValue, {}),
    "step: padded_draft_lens length": (
        "base", lambda m: m.step(StepPlan(padding_rows=rows(m, "run"), padded_draft_lens=[])),
        InvalidValue, {}),
    "step: prefill_tokens length": ("base", lambda m: m.step(StepPlan(prefill_rows=rows(m, "pre"),
                                                                      prefill_tokens=[1, 2])),
                                    InvalidValue, {}),
    "step: more first chunks than prompts": ("base", lambda m: m.step(StepPlan(
        prompt_lens=[3], first_chunks=[1, 2])), InvalidValue, {}),
    "step: first_chunks length": ("base", lambda m: m.step(StepPlan(prompt_lens=[3, 4],
                                                                    first_chunks=[1])),
                                  InvalidValue, {}),
    # ---- StepPlan combinations that cannot both happen
    "step: reverted and settled": ("base", lambda m: m.step(StepPlan(
        revert_rows=rows(m, "run"), result_rows=rows(m, "run"), num_accepted=[0])),
        InvalidValue, {}),
    "step: finished and granted": ("base", lambda m: m.step(StepPlan(
        finished_rows=rows(m, "idle"), grant_rows=rows(m, "idle"), draft_lens=[1])),
        InvalidValue, {}),
    "step: finished and padded": ("base", lambda m: m.step(StepPlan(
        finished_rows=rows(m, "run"), padding_rows=rows(m, "run"), padded_draft_lens=[3])),
        InvalidValue, {}),
    "step: finished and prefilled": ("base", lambda m: m.step(StepPlan(
        finished_rows=rows(m, "pre"), prefill_rows=rows(m, "pre"), prefill_tokens=[1])),
        InvalidValue, {}),
    "step: granted and prefilled": ("base", lambda m: m.step(StepPlan(
        grant_rows=rows(m, "pre"), draft_lens=[1],
        prefill_rows=rows(m, "pre"), prefill_tokens=[1])),
        InvalidValue, {}),
    "step: padded and prefilled": ("base", lambda m: m.step(StepPlan(
        padding_rows=rows(m, "run"), padded_draft_lens=[3],
        prefill_rows=rows(m, "run"), prefill_tokens=[1])),
        InvalidValue, {}),
    # ---- rows that name no live request
    "step: row past the batch": ("base", lambda m: m.step(StepPlan(
        grant_rows=[ROWS], draft_lens=[1])), UnknownRequest, {}),
    "step: negative row": ("base", lambda m: m.step(StepPlan(
        result_rows=[-1], num_accepted=[0])), UnknownRequest, {}),
    "step: row of a freed request": ("freed", lambda m: m.step(StepPlan(
        prefill_rows=[m.freed_row], prefill_tokens=[1])), UnknownRequest, {}),
    "step: float rows": ("base", lambda m: m.step(StepPlan(
        finished_rows=np.array([0.0]))), InvalidValue, {}),
    "step: nested rows": ("base", lambda m: m.step(StepPlan(
        revert_rows=[[0]])), InvalidValue, {}),
    "step: negative first chunk": ("base", lambda m: m.step(StepPlan(
        prompt_lens=[4], first_chunks=[-1])), InvalidValue, {}),
    "view of a free row": ("base", lambda m: m.view(ROWS - 1), UnknownRequest, {}),
    "view past the batch": ("base", lambda m: m.view(ROWS), UnknownRequest, {}),
    "rows_of unknown": ("base", lambda m: m.rows_of(["run", "nope"]), UnknownRequest, {}),
    "step: valid work plus one bad prompt": ("base", lambda m: m.step(StepPlan(
        result_rows=rows(m, "run"), num_accepted=[1],
        grant_rows=rows(m, "idle", "run"), draft_lens=[2, 2],
        prefill_rows=rows(m, "pre"), prefill_tokens=[4], finished_rows=rows(m),
        prompt_lens=[4, 0])), InvalidValue, {}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_typed_error_names_its_field_and_changes_nothing(make_each_manager, case):
    setup, call, error, counted = CASES[case]
    m = make_each_manager()
    SETUPS[setup](m)
    m.check_invariants()
    before = snapshot(m)
    with pytest.raises(error) as info:
        call(m)
    err = info.value
    assert isinstance(err, KVAllocError)
    assert err.field, "the error must say which field was at fault"
    assert str(err).startswith(f"{err.field}:"), (err.field, str(err))
    assert_unchanged(before, snapshot(m), counted)
    m.check_invariants()


@pytest.mark.parametrize("site", ["per_request", "batched"])
def test_refused_grant_when_out_of_blocks_changes_nothing_but_the_refusal_count(make_each_manager,
                                                                                 site):
    """try_allocate_generation returns False (and a batched grant comes back granted=False)
    when the pool cannot cover it; the request keeps its state and can be granted later."""
    m = make_each_manager()
    exhausted(m)
    before = snapshot(m)
    if site == "per_request":
        assert m.try_allocate_generation("idle", 3) is False
    else:
        out = m.step(StepPlan(grant_rows=rows(m, "idle"), draft_lens=[3]))
        assert out.granted.tolist() == [False]
    assert_unchanged(before, snapshot(m), {"grants_refused": 1})
    assert m.pending_draft_len("idle") is None
    m.free("hog0")
    assert m.try_allocate_generation("idle", 3) is True


def test_refused_new_request_in_a_step_changes_nothing_but_the_refusal_count(make_each_manager):
    m = make_each_manager()
    exhausted(m)
    before = snapshot(m)
    out = m.step(StepPlan(prompt_lens=[4]))
    assert out.admitted_rows.tolist() == [-1]
    assert out.new_refusals.tolist() == [REFUSED_OUT_OF_BLOCKS]
    assert_unchanged(before, snapshot(m), {"requests_refused": 1})


@pytest.mark.parametrize("req", [None, 0, ("a", 1)])
def test_any_hashable_id_is_a_duplicate_when_added_twice(make_each_manager, req):
    """Request ids are any hashable, None and 0 included: adding one twice is a duplicate."""
    m = make_each_manager()
    m.add_request(req, 4)
    before = snapshot(m)
    with pytest.raises(DuplicateRequest):
        m.add_request(req, 4)
    assert_unchanged(before, snapshot(m))
    m.check_invariants()


def test_errors_leave_the_manager_usable(make_each_manager):
    """After a burst of rejected calls the same requests still step normally."""
    m = make_each_manager()
    base(m)
    for _, call, error, _ in (CASES[c] for c in CASES if CASES[c][0] == "base"):
        with pytest.raises(error):
            call(m)
    m.update_resources("run", 2)
    assert m.capacity("run") == m.history("run") == 13
    m.extend_prefill("pre", 12)
    assert m.try_allocate_generation("pre", 3)
    m.check_invariants()


# ---------------------------------------------------------------------- PoolConfig

CONFIG_CASES: dict[str, tuple[dict, tuple[str, ...]]] = {
    "num_blocks and memory_budget_bytes": ({"memory_budget_bytes": 1 << 20},
                                           ("num_blocks", "memory_budget_bytes")),
    "neither num_blocks nor memory_budget_bytes": ({"num_blocks": None},
                                                   ("num_blocks", "memory_budget_bytes")),
    "memory budget below one block": ({"num_blocks": None, "memory_budget_bytes": 10},
                                      ("memory_budget_bytes",)),
    "zero num_blocks": ({"num_blocks": 0}, ("num_blocks",)),
    "fp8 k_scales with bfloat16": ({"k_scales": (1.0,)}, ("k_scales",)),
    "fp8 v_scales with float16": ({"dtype": "float16", "v_scales": (1.0,)}, ("v_scales",)),
    "wrong number of k_scales": ({"dtype": "fp8_e4m3", "k_scales": (1.0, 2.0)}, ("k_scales",)),
    "wrong number of v_scales": ({"dtype": "fp8_e4m3", "num_layers": 2, "v_scales": (1.0,)},
                                 ("v_scales",)),
    "non-positive scale": ({"dtype": "fp8_e4m3", "k_scales": (0.0,)}, ("k_scales",)),
    "infinite scale": ({"dtype": "fp8_e4m3", "v_scales": (float("inf"),)}, ("v_scales",)),
    "unknown dtype": ({"dtype": "int8"}, ("dtype",)),
    "max_seq_len too large for the pool": ({"max_seq_len": 1000}, ("max_seq_len",)),
    "tokens_per_block 0": ({"tokens_per_block": 0}, ("tokens_per_block",)),
    "num_layers 0": ({"num_layers": 0}, ("num_layers",)),
    "num_kv_heads 0": ({"num_kv_heads": 0}, ("num_kv_heads",)),
    "head_dim 0": ({"head_dim": 0}, ("head_dim",)),
    "max_batch_size 0": ({"max_batch_size": 0}, ("max_batch_size",)),
    "max_seq_len 0": ({"max_seq_len": 0}, ("max_seq_len",)),
    "negative max_draft_len": ({"max_draft_len": -1}, ("max_draft_len",)),
    "unknown slack_policy": ({"slack_policy": "sometimes"}, ("slack_policy",)),
    "not a device": ({"device": "tpu"}, ("device",)),
    "garbage device": ({"device": "cuda:x"}, ("device",)),
    "misspelt field": ({"num_blokcs": 4}, ("num_blokcs",)),
    "unknown kv_layout": ({"kv_layout": "mla"}, ("kv_layout",)),
    "latent pool with two heads": ({"kv_layout": "latent", "num_kv_heads": 2},
                                   ("num_kv_heads",)),
    "latent pool with v_scales": ({"kv_layout": "latent", "num_kv_heads": 1,
                                   "dtype": "fp8_e4m3", "v_scales": (1.0,)}, ("v_scales",)),
    "latent pool with v_scales, not fp8": ({"kv_layout": "latent", "num_kv_heads": 1,
                                            "v_scales": (1.0,)}, ("v_scales",)),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES), ids=list(CONFIG_CASES))
def test_invalid_pool_config_is_rejected_naming_the_field(make_config, case):
    overrides, fields = CONFIG_CASES[case]
    with pytest.raises(pydantic.ValidationError) as info:
        make_config(**overrides)
    errors = info.value.errors()
    for name in fields:
        # In the error's location (a field validator) or its message (a model validator); not
        # merely in the echoed input, which lists every field.
        assert any(name in e["loc"] or name in e["msg"] for e in errors), (name, errors)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_device_without_cuda_is_rejected_naming_the_field(make_config):
    with pytest.raises(pydantic.ValidationError) as info:
        make_config(device="cuda")
    assert any("device" in e["loc"] for e in info.value.errors())


def test_memory_budget_sets_num_blocks(make_config):
    """The derived pool size: floor(budget / bytes per block), K and V for every layer."""
    cfg = make_config(num_blocks=None, memory_budget_bytes=10_000, num_layers=2, head_dim=8,
                      num_kv_heads=1, tokens_per_block=4, max_seq_len=8, dtype="bfloat16")
    per_block = 2 * 2 * 4 * 1 * 8 * 2  # K+V, layers, tokens, heads, head_dim, bytes (bf16)
    assert cfg.bytes_per_block == per_block
    assert cfg.total_blocks == 10_000 // per_block


def test_a_latent_pool_holds_one_plane_and_counts_its_bytes(make_config):
    """A DeepSeek-V3-shaped latent (512 + 64 wide, 61 layers, bf16): one plane, no V, so a block
    costs half a K/V pool of the same width; the block and slot geometry is the same."""
    cfg = make_config(num_blocks=None, memory_budget_bytes=10 * 70_272 * 16, num_layers=61,
                      num_kv_heads=1, head_dim=576, kv_layout="latent", tokens_per_block=16,
                      max_seq_len=16, dtype="bfloat16")
    assert cfg.kv_planes == 1 and make_config().kv_planes == 2
    assert cfg.bytes_per_block == 70_272 * 16  # 61 * 576 * 2 bytes a token
    assert cfg.total_blocks == 10
    assert cfg.max_blocks_per_seq == make_config(max_seq_len=16, tokens_per_block=16,
                                                 num_blocks=10).max_blocks_per_seq


def test_row_overflow_in_a_batch_names_the_overflowing_request(make_each_manager):
    """In a batched step the error carries which request would overflow its row, so a scheduler
    can finish or preempt exactly that one."""
    m = make_each_manager()
    short = m.add_request("short", 4)
    full = m.step(StepPlan(prompt_lens=[m.config.max_seq_len])).admitted_rows[0]
    for _ in range(4):  # walk "full" to its row limit one committed token at a time
        m.step(StepPlan(grant_rows=[full], draft_lens=[0]))
        m.step(StepPlan(result_rows=[full], num_accepted=[0]))
    with pytest.raises(BlockTableOverflow) as err:
        m.step(StepPlan(grant_rows=[short, full], draft_lens=[3, 3]))
    assert err.value.row == full and err.value.req_id is None  # admitted by row, no id
    with pytest.raises(BlockTableOverflow) as err:
        m.step(StepPlan(grant_rows=[full, short], draft_lens=[3, 3]))
    assert err.value.row == full
    m.free("short")
    m.add_request("named", m.config.max_seq_len)
    for _ in range(4):
        assert m.try_allocate_generation("named", 0)
        m.update_resources("named", 0)
    with pytest.raises(BlockTableOverflow) as err:
        m.step(StepPlan(grant_rows=m.rows_of(["named"]), draft_lens=[3]))
    assert err.value.req_id == "named" and err.value.row == m.row("named")
