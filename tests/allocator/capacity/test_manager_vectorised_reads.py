"""Row-based reads of `KVCacheManager`: ``rows_of`` translates ids for a batched step (in the
caller's order, an unknown id raises `UnknownRequest` naming it), ``view(row)`` equals the
per-request getters, a step's outcome says which block-table cells it rewrote, and
``token_slots`` says where runs of tokens live in the rows' blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from kvalloc.allocator import KVCacheManager, StepPlan, UnknownRequest


def _running(make_manager: Callable[..., KVCacheManager]) -> KVCacheManager:
    mgr = make_manager()
    for req, prompt, first in (("a", 5, 5), ("b", 17, 9), ("c", 3, 3)):
        mgr.add_request(req, prompt, first_chunk=first)
    a, b, c = mgr.rows_of(["a", "b", "c"])
    mgr.step(StepPlan(grant_rows=[a, c], draft_lens=[2, 1], prefill_rows=[b],
                      prefill_tokens=[4]))
    mgr.step(StepPlan(result_rows=[a, c], num_accepted=[2, 0]))
    return mgr


def test_rows_of_match_the_per_request_getter(make_manager: Callable[..., KVCacheManager]
                                              ) -> None:
    mgr = _running(make_manager)
    ids = ["c", "a", "b", "a"]  # any order, repeats allowed
    got = mgr.rows_of(ids)
    assert got.dtype == np.int64
    assert got.tolist() == [mgr.row(r) for r in ids]
    assert [mgr.view(row).history for row in got] == [mgr.history(r) for r in ids] == [
        4, 8, 13, 8]


def test_rows_of_nothing_is_empty(make_manager: Callable[..., KVCacheManager]) -> None:
    got = make_manager().rows_of([])
    assert got.dtype == np.int64 and got.shape == (0,)


@pytest.mark.parametrize("bad", ["zz", ["unhashable"]])
def test_rows_of_unknown_request_raises(make_manager: Callable[..., KVCacheManager],
                                        bad: object) -> None:
    mgr = _running(make_manager)
    with pytest.raises(UnknownRequest, match="unknown request"):
        mgr.rows_of(["a", bad])


def test_view_equals_the_per_request_getters_and_is_a_copy(
        make_manager: Callable[..., KVCacheManager]) -> None:
    mgr = _running(make_manager)
    assert mgr.try_allocate_generation("a", 3)
    for req in ("a", "b", "c"):
        view = mgr.view(mgr.row(req))
        assert view.row == mgr.row(req)
        assert (view.capacity, view.history, view.pending_overlap_slack,
                view.pending_draft_len, view.num_blocks) == (
            mgr.capacity(req), mgr.history(req), mgr.pending_overlap_slack(req),
            mgr.pending_draft_len(req), mgr.num_blocks(req))
        assert view.block_ids.tolist() == mgr.block_ids(req).tolist()
    view = mgr.view(mgr.row("a"))
    view.block_ids[0] = 99
    assert mgr.block_ids("a")[0] != 99


def test_outcome_names_exactly_the_cells_a_step_rewrote(
        make_manager: Callable[..., KVCacheManager]) -> None:
    """changed_rows / changed_from / changed_num_blocks / changed_block_ids rebuild the table
    from the one before the step; rows not listed did not change at all."""
    mgr = _running(make_manager)
    a, b = mgr.rows_of(["a", "b"])
    before = mgr.table.host.copy()
    out = mgr.step(StepPlan(grant_rows=[a], draft_lens=[3], finished_rows=[b],
                            prompt_lens=[6]))
    new_row = int(out.admitted_rows[0])
    assert new_row == b  # the freed row is handed out again at once (LIFO)
    assert out.changed_rows.tolist() == sorted({int(a), int(b)})  # c is not in the plan
    live = set(mgr.live_rows.tolist())
    assert out.num_blocks.tolist() == [mgr.view(r).num_blocks if r in live else 0
                                       for r in range(mgr.config.max_batch_size)]
    rebuilt = before.copy()
    offset = 0
    for row, start, count in zip(out.changed_rows, out.changed_from, out.changed_num_blocks,
                                 strict=True):
        rebuilt[row, start:count] = out.changed_block_ids[offset : offset + count - start]
        rebuilt[row, count:] = -1
        offset += count - start
    np.testing.assert_array_equal(rebuilt, mgr.table.host)
    unchanged = np.setdiff1d(np.arange(mgr.config.max_batch_size), out.changed_rows)
    np.testing.assert_array_equal(before[unchanged], mgr.table.host[unchanged])
    assert out.changed_from[list(out.changed_rows).index(b)] == 0  # freed and readmitted


def test_token_slots_are_each_run_in_its_rows_blocks_and_minus_one_past_them(
        make_manager: Callable[..., KVCacheManager]) -> None:
    mgr = _running(make_manager)
    tpb = mgr.config.tokens_per_block
    runs = [("b", 0, 3), ("a", mgr.history("a"), 2), ("c", mgr.num_blocks("c") * tpb - 1, 2)]
    want = []
    for req, start, count in runs:
        blocks = mgr.block_ids(req).tolist()
        want += [blocks[p // tpb] * tpb + p % tpb if p // tpb < len(blocks) else -1
                 for p in range(start, start + count)]
    got = mgr.token_slots(mgr.rows_of([req for req, _, _ in runs]),
                          np.array([start for _, start, _ in runs]),
                          np.array([count for _, _, count in runs]))
    assert got.dtype == np.int64
    assert got.tolist() == want
    assert want[-1] == -1  # c's last run reaches one position past its blocks
