"""A step's plan as the host knows it: entries on the spare row, plans packed one after the
other, and a decode-only plan grown to its batch bucket with its own entries first."""

from __future__ import annotations

import numpy as np
import pytest
from kvalloc.allocator.errors import InvariantViolation
from kvalloc.worker.step.device_step import LaunchPlan, _Columns, _DecodeTemplates

SPARE = 8


def _decodes(rows: list[int], width: int) -> LaunchPlan:
    """Decodes of ``width`` tokens on ``rows``, from position 10, behind nothing."""
    n = len(rows)
    return LaunchPlan(np.array(rows), width * np.arange(n), np.full(n, width),
                      np.full(n, 10), np.zeros(n, dtype=np.int64),
                      np.arange(1, 1 + n * width), np.arange(n), np.ones(n, dtype=bool),
                      np.full(n, width - 1))


def test_entries_on_the_spare_row_start_at_zero_and_emit() -> None:
    plan = LaunchPlan.on_spare_row(np.array([3, 1]), SPARE, decode=False)
    assert plan.rows.tolist() == [SPARE, SPARE]
    assert plan.offsets.tolist() == [0, 3] and plan.starts.tolist() == [0, 0]
    assert plan.host_ids.tolist() == [0, 0, 0, 0]
    assert plan.emitting.tolist() == [0, 1] and not plan.decode.any()
    assert plan.logit_rows.tolist() == [2, 3]  # a chunk keeps its last token's logits


def test_a_plan_then_another_packs_the_second_after_the_first() -> None:
    both = _decodes([2, 5], 3).then(LaunchPlan.on_spare_row(np.array([3]), SPARE, decode=True))
    assert both.rows.tolist() == [2, 5, SPARE]
    assert both.offsets.tolist() == [0, 3, 6] and both.emitting.tolist() == [0, 1, 2]
    assert both.host_ids.tolist() == [1, 2, 3, 4, 5, 6, 0, 0, 0]
    assert both.drafts.tolist() == [2, 2, 0] and both.decode_only


def test_a_decode_only_plan_grows_with_its_own_entries_first() -> None:
    plan = _decodes([4, 1, 6], 2)
    grown = plan.padded(4, SPARE)
    assert grown.rows.tolist() == [4, 1, 6, SPARE] and grown.decode_only
    assert grown.logit_rows[:6].tolist() == plan.logit_rows.tolist()
    assert grown.starts.tolist() == [10, 10, 10, 0] and grown.drafts.tolist() == [1, 1, 1, 0]
    assert plan.padded(3, SPARE) is plan


def test_only_a_decode_only_plan_grows() -> None:
    mixed = _decodes([0], 2).then(LaunchPlan.on_spare_row(np.array([5]), SPARE, decode=False))
    with pytest.raises(InvariantViolation, match="decode-only"):
        mixed.padded(4, SPARE)


@pytest.mark.parametrize("table_cells", [0, 4], ids=["shared-table", "own-table"])
@pytest.mark.parametrize(("entries", "width", "shape"), [(1, 1, 1), (3, 4, 8), (5, 2, 5),
                                                         (7, 3, 16)])
def test_a_captured_shapes_columns_from_its_template_are_the_grown_plans(
        entries: int, width: int, shape: int, table_cells: int) -> None:
    """A replayed step packs its columns from its shape's template (`_DecodeTemplates`) into
    its pinned buffer: the same values as packing the plan grown to that shape, twice over one
    template and one buffer (nothing of the earlier step, or of the buffer's garbage, stays);
    an own table's changes last."""
    rng = np.random.default_rng(entries * 100 + width)
    templates = _DecodeTemplates(SPARE, table_cells)
    out = None
    for _ in range(2):
        rows = rng.permutation(SPARE)[:entries]
        plan = LaunchPlan(rows, width * np.arange(entries), np.full(entries, width),
                          rng.integers(0, 99, entries), rng.integers(0, 2, entries),
                          rng.integers(0, 500, entries * width), np.arange(entries),
                          np.ones(entries, dtype=bool), rng.integers(0, width, entries))
        table = rng.integers(0, 99, table_cells * 3 // 2)
        grown = plan.padded(shape, SPARE)
        want = _Columns.pack(grown, table)
        if out is None:
            out = np.full(want.size, -7, dtype=np.int64)
        templates.pack_into(plan, (shape, width), out)[:] = table
        np.testing.assert_array_equal(out, want)
        assert _Columns.places(grown, table_cells)["table_cells"] == want.size - table.size
