"""A reply's schedule checked into the device step's plan: a decode runs its pending token and
drafts, a prefill chunk the next tokens of its prompt (the host's ids), emitting entries are the
decodes and the chunks that end their prompt, and a reply that disagrees with the plan is an
`EngineError` naming the request."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from kvalloc.worker.errors import EngineError
from kvalloc.worker.launch_plans import launch_plan
from kvalloc.worker.requests import Request


def _reply(rows: list[int], offsets: list[int], num_tokens: list[int],
           starts: list[int]) -> SimpleNamespace:
    return SimpleNamespace(scheduled=SimpleNamespace(
        rows=np.array(rows), token_offsets=np.array(offsets), num_tokens=np.array(num_tokens),
        start_positions=np.array(starts)))


def _requests() -> tuple[Request, Request, Request]:
    decode = Request("d", np.arange(4), max_new_tokens=8, output=[9, 9], handle=0)
    decode.admitted, decode.scheduled = decode.prompt, 4
    decode.drafts, decode.num_drafts, decode.padded_drafts = np.array([7, 8]), 2, 2
    last_chunk = Request("c", np.arange(10, 16), max_new_tokens=8, handle=1)
    last_chunk.admitted, last_chunk.scheduled = last_chunk.prompt, 4
    first_chunk = Request("f", np.arange(20, 30), max_new_tokens=8, handle=2)
    first_chunk.admitted = first_chunk.prompt
    return decode, last_chunk, first_chunk


def test_decodes_and_chunks_become_the_device_steps_plan() -> None:
    decode, last_chunk, first_chunk = _requests()
    plan, emitting = launch_plan(_reply([5, 6, 7], [0, 3, 5], [3, 2, 3], [5, 4, 0]),
                                 [decode, last_chunk, first_chunk])
    assert plan.host_ids.tolist() == [0, 7, 8, 14, 15, 20, 21, 22]
    assert plan.emitting.tolist() == [0, 1] and emitting == [decode, last_chunk]
    assert plan.decode.tolist() == [True, False] and plan.drafts.tolist() == [2, 0]
    assert (last_chunk.scheduled, first_chunk.scheduled) == (6, 3)


def test_a_reply_that_disagrees_with_the_plan_names_the_request() -> None:
    decode, last_chunk, first_chunk = _requests()
    with pytest.raises(EngineError, match="request 'd' got 3 tokens at position 6; the worker "
                                          "expected 3 at 5"):
        launch_plan(_reply([5, 6, 7], [0, 3, 5], [3, 2, 3], [6, 4, 0]),
                    [decode, last_chunk, first_chunk])


def test_a_prefill_chunk_at_another_position_names_its_request_and_advances_none() -> None:
    decode, last_chunk, first_chunk = _requests()
    with pytest.raises(EngineError, match="request 'c' got 2 tokens at position 3; the worker "
                                          "expected 2 at 4"):
        launch_plan(_reply([5, 6, 7], [0, 3, 5], [3, 2, 3], [5, 3, 0]),
                    [decode, last_chunk, first_chunk])
    assert (last_chunk.scheduled, first_chunk.scheduled) == (4, 0)


def test_a_chunk_past_its_prompt_and_a_decode_of_another_width_are_named() -> None:
    decode, last_chunk, _ = _requests()
    with pytest.raises(EngineError, match="request 'c' got 3 tokens at position 4; the worker "
                                          "expected 2 at 4"):
        launch_plan(_reply([6], [0], [3], [4]), [last_chunk])
    decode.padded_drafts = 3  # padded to 3 drafts: the reply must run 1 + 3 tokens
    with pytest.raises(EngineError, match="request 'd' got 3 tokens at position 5; the worker "
                                          "expected 4 at 5"):
        launch_plan(_reply([5], [0], [3], [5]), [decode])


def test_the_first_entry_that_disagrees_is_named() -> None:
    decode, last_chunk, first_chunk = _requests()
    with pytest.raises(EngineError, match="request 'c' got 2 tokens at position 0"):
        launch_plan(_reply([5, 6, 7], [0, 3, 5], [3, 2, 3], [5, 0, 9]),
                    [decode, last_chunk, first_chunk])


def test_decodes_behind_an_unread_step_start_past_it_and_keep_device_drafts_out() -> None:
    ahead = Request("a", np.arange(4), max_new_tokens=8, output=[9], handle=3, unread=1)
    ahead.admitted, ahead.scheduled = ahead.prompt, 4
    ahead.num_drafts, ahead.padded_drafts = 1, 3  # one drafted on the device, padded to 3
    decode, _, _ = _requests()
    plan, emitting = launch_plan(_reply([2, 5], [0, 4], [4, 3], [5, 5]), [ahead, decode])
    assert plan.host_ids.tolist() == [0, 0, 0, 0, 0, 7, 8]  # the device fills in its own
    assert plan.behind.tolist() == [1, 0] and plan.drafts.tolist() == [1, 2]
    assert emitting == [ahead, decode] and plan.emitting.tolist() == [0, 1]
    with pytest.raises(EngineError, match="request 'a' got 4 tokens at position 4; the worker "
                                          "expected 4 at 5"):
        launch_plan(_reply([2], [0], [4], [4]), [ahead])
