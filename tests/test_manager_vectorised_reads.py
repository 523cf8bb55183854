"""`KVCacheManager.histories`: the batched read equals the per-request getter, in the caller's
order, and an unknown id raises `UnknownRequest` naming it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from allocator import KVCacheManager, StepPlan, UnknownRequest


def _running(make_manager: Callable[..., KVCacheManager]) -> KVCacheManager:
    mgr = make_manager()
    mgr.step(StepPlan(new_ids=["a", "b", "c"], prompt_lens=[5, 17, 3], first_chunks=[5, 9, 3]))
    mgr.step(StepPlan(grant_ids=["a", "c"], draft_lens=[2, 1], prefill_ids=["b"],
                      prefill_tokens=[4]))
    mgr.step(StepPlan(result_ids=["a", "c"], num_accepted=[2, 0]))
    return mgr


def test_histories_match_the_per_request_getter(make_manager: Callable[..., KVCacheManager]
                                                ) -> None:
    mgr = _running(make_manager)
    ids = ["c", "a", "b", "a"]  # any order, repeats allowed
    got = mgr.histories(ids)
    assert got.dtype == np.int64
    assert got.tolist() == [mgr.history(r) for r in ids] == [4, 8, 13, 8]


def test_histories_of_nothing_is_empty(make_manager: Callable[..., KVCacheManager]) -> None:
    got = make_manager().histories([])
    assert got.dtype == np.int64 and got.shape == (0,)


def test_histories_is_a_copy(make_manager: Callable[..., KVCacheManager]) -> None:
    mgr = _running(make_manager)
    mgr.histories(["a"])[0] = 99
    assert mgr.history("a") == 8


@pytest.mark.parametrize("bad", ["zz", ["unhashable"]])
def test_histories_unknown_request_raises(make_manager: Callable[..., KVCacheManager],
                                          bad: object) -> None:
    mgr = _running(make_manager)
    with pytest.raises(UnknownRequest, match="unknown request"):
        mgr.histories(["a", bad])


def test_row_block_counts_locate_what_a_step_rewrote(make_manager: Callable[..., KVCacheManager]
                                                     ) -> None:
    """Counts around a step differ exactly for the rows whose blocks changed, and the cells past
    the smaller count are the only ones that differ."""
    mgr = _running(make_manager)
    rows = np.array([mgr.row(r) for r in ("a", "b", "c")])
    before_counts = mgr.row_block_counts(rows)
    before_table = mgr.table.host[rows].copy()
    mgr.step(StepPlan(grant_ids=["a", "c"], draft_lens=[3, 0]))
    after_counts = mgr.row_block_counts(rows)
    assert after_counts.tolist() == [mgr.num_blocks(r) for r in ("a", "b", "c")]
    after_table = mgr.table.host[rows]
    for i in range(3):
        lo = min(before_counts[i], after_counts[i])
        assert (before_table[i, :lo] == after_table[i, :lo]).all()
        if before_counts[i] == after_counts[i]:
            assert (before_table[i] == after_table[i]).all()
    assert (before_counts != after_counts).any(), "the scenario must change some row"
