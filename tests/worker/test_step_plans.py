"""Planning a step's call: decodes first (each its pending token and drafts), then prefill
chunks, then new prompts, within ``max_step_tokens`` and the batch's free rows; a decode-only
step's decodes padded to ``draft_len`` drafts when asked; what the host read settled, except for
requests the call finishes."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
from kvalloc.worker.requests import Request
from kvalloc.worker.step_plans import StepPlanner


class _Proposes:
    """A host drafter that proposes ``tokens`` (cut to what is asked)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, req_id: str, context: np.ndarray, num_generated: int,
                num: int) -> np.ndarray:
        return np.array(self.tokens[:num], dtype=np.int64)


def _planner(max_step_tokens: int, draft_len: int, drafted: list[int], *,
             pad_decodes: bool = False) -> StepPlanner:
    layout = SimpleNamespace(max_step_tokens=max_step_tokens, max_batch_size=4)
    return StepPlanner(layout, draft_len, _Proposes(drafted), pad_decodes, share_prefixes=False)


def _decoding(handle: int, prompt_len: int = 3) -> Request:
    r = Request(f"d{handle}", np.arange(prompt_len), max_new_tokens=10, output=[5],
                handle=handle)
    r.admitted, r.scheduled = r.prompt, prompt_len
    return r


def _prefilling(handle: int, prompt_len: int, scheduled: int) -> Request:
    r = Request(f"p{handle}", np.arange(prompt_len), max_new_tokens=10, handle=handle)
    r.admitted, r.scheduled = r.prompt, scheduled
    return r


def _columns(call: dict) -> dict:
    return {k: tuple(np.asarray(c).tolist() for c in v) if isinstance(v, tuple)
            else np.asarray(v).tolist() for k, v in call.items()}


def test_decodes_come_first_then_chunks_then_new_prompts_within_the_budget() -> None:
    decode, chunk = _decoding(0), _prefilling(1, prompt_len=10, scheduled=2)
    waiting = deque([Request("new", np.arange(4), max_new_tokens=3)])
    plan = _planner(8, draft_len=2, drafted=[7, 8]).plan(waiting, {0: decode, 1: chunk}, [])
    assert plan.granted == [decode] and decode.drafts.tolist() == [7, 8]
    assert plan.prefilling == [chunk] and chunk.chunk == 5  # 8 - (1 + 2)
    assert plan.new == [] and len(waiting) == 1  # no budget left
    assert _columns(plan.call) == {"grants": ([0], [2]), "prefill": ([1], [5])}


def test_a_new_prompt_takes_what_is_left() -> None:
    waiting = deque([Request("new", np.arange(6), max_new_tokens=3)])
    plan = _planner(8, draft_len=2, drafted=[7]).plan(waiting, {0: _decoding(0)}, [])
    assert [r.req_id for r in plan.new] == ["new"] and plan.new[0].chunk == 6
    assert _columns(plan.call) == {"grants": ([0], [1]), "new": (["new"], [6], [6])}


def test_a_decode_only_step_pads_its_decodes_to_draft_len_when_asked() -> None:
    decode = _decoding(3)
    plan = _planner(8, draft_len=3, drafted=[7], pad_decodes=True).plan(deque(), {3: decode},
                                                                          [])
    assert decode.num_drafts == 1 and decode.padded_drafts == 3
    assert _columns(plan.call) == {"grants": ([3], [1]), "padding": ([3], [3])}


def test_what_the_host_read_is_settled_unless_the_call_finishes_its_request() -> None:
    going, done = _decoding(0), _decoding(1)
    done.done = True
    plan = _planner(8, draft_len=0, drafted=[]).plan(deque(), {0: going, 1: done},
                                                     [(going, 2), (done, 1)])
    assert plan.finished == [done]
    assert _columns(plan.call) == {"results": ([0], [2]), "finished": [1], "grants": ([0], [0])}


def test_a_decode_its_unread_steps_may_end_is_not_granted_and_the_next_one_is() -> None:
    ending, going, done = _decoding(0), _decoding(1), _decoding(2)
    ending.unread = ending.remaining  # its unread steps may emit every token it has left
    done.done = True
    plan = _planner(2, draft_len=3, drafted=[7, 8, 9]).plan(
        deque(), {2: done, 0: ending, 1: going}, [])
    assert plan.finished == [done] and plan.granted == [going]
    assert (ending.num_drafts, going.num_drafts) == (-1, 1)  # the budget of 2 cuts its drafts
    assert _columns(plan.call) == {"finished": [2], "grants": ([1], [1])}
