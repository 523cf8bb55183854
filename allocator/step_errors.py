"""The batched step's failures as codes, and the one place that turns a code into a typed error.

Both implementations of the step (`step_reference`, numpy, and `step_compiled`, numba) report a
bad plan the same way: an int64 array ``[kind, subject, index, detail]`` (``kind`` 0: no error).
``subject`` is the plan list at fault (one of ``SUBJECTS``), ``index`` the position in that list
(or a row, for the block errors), ``detail`` a number the message quotes. `raise_step_error` turns
it into the typed error every caller sees, so the two implementations cannot word, type or field
an error differently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import numpy as np

from .errors import (
    AcceptedExceedsDrafts,
    BlockTableOverflow,
    DraftLenExceeded,
    DuplicateRequest,
    GrantPending,
    InvalidValue,
    NoPendingGrant,
    OutOfBlocks,
    PrefillIncomplete,
    UnknownRequest,
)
from .step_plan import FIELDS, PlanArrays

# Subjects: the plan lists, in `PlanArrays` order.
SUBJECTS = tuple(FIELDS)
REVERTS, RESULTS, ACCEPTED, FINISHED, GRANTS, DRAFTS, PADDING, PADDED, PREFILL, CHUNK_TOKENS, \
    PROMPTS, FIRST_CHUNKS = range(len(SUBJECTS))

# Kinds, in no particular order (the order the step checks them is the step's).
OK = 0
UNKNOWN_ROW = 1  # a row that is out of range or not live
DUPLICATE_ROW = 2  # a row listed twice in one list
BELOW_MINIMUM = 3  # detail: the minimum
ABOVE_MAX_DRAFT = 4  # detail: max_draft_len
PROMPT_TOO_LONG = 5  # detail: max_seq_len
CHUNK_PAST_PROMPT = 6
REVERTED_AND_SETTLED = 7
FINISHED_AND_SCHEDULED = 8  # finished, and granted, padded or prefilled
SCHEDULED_AND_PREFILLED = 9  # subject: grants or padding; index: in prefill_rows
NO_PENDING_GRANT = 10
ACCEPTED_EXCEEDS_DRAFTS = 11  # detail: the pending draft length
GRANT_PENDING = 12
PREFILL_INCOMPLETE = 13
PADDING_BELOW_DRAFT = 14  # detail: the granted draft length
PREFILL_PAST_PROMPT = 15  # detail: the prompt length
ROW_OVERFLOW = 16  # index: the row; detail: max_blocks_per_seq
OUT_OF_BLOCKS = 17  # index: the first row refused; detail: blocks available

ERROR_SLOTS = 4


def no_error() -> np.ndarray:
    return np.zeros(ERROR_SLOTS, dtype=np.int64)


def raise_step_error(error: np.ndarray, plan: PlanArrays,
                     request_of: Callable[[int], object]) -> NoReturn:
    """Raise the typed error ``error`` reports. ``request_of(row)``: the request id a row was
    admitted under, or None; messages name both."""
    kind, subject, index, detail = (int(v) for v in error)

    def describe(row: int) -> str:
        req = request_of(row)
        return f"row {row}" if req is None else f"row {row} (request {req!r})"

    name = SUBJECTS[subject]
    field = FIELDS[name]
    values = plan[subject]
    value = int(values[index]) if 0 <= index < values.size else index
    if kind == UNKNOWN_ROW:
        raise UnknownRequest(f"{field}: row {value} is not a live request", field=field)
    if kind == DUPLICATE_ROW:
        raise DuplicateRequest(f"{field}: {describe(value)} is listed twice", field=field)
    if kind == BELOW_MINIMUM:
        raise InvalidValue(f"{field}: {value} is below {detail}", field=field)
    if kind == ABOVE_MAX_DRAFT:
        raise DraftLenExceeded(f"{field}: {value} is above max_draft_len={detail}", field=field)
    if kind == PROMPT_TOO_LONG:
        raise InvalidValue(f"{field}: {value} is above max_seq_len={detail}", field=field)
    if kind == CHUNK_PAST_PROMPT:
        raise InvalidValue(f"{field}: {value} is larger than the prompt "
                           f"({int(plan.prompt_lens[index])} tokens)", field=field)
    if kind == REVERTED_AND_SETTLED:
        raise InvalidValue(f"{field}: {describe(value)} is already reverted in this step",
                           field=field)
    if kind == FINISHED_AND_SCHEDULED:
        raise InvalidValue(f"{field}: {describe(value)} is also scheduled in this step",
                           field=field)
    if kind == SCHEDULED_AND_PREFILLED:
        what = "granted" if subject == GRANTS else "padded"
        row = int(plan.prefill_rows[index])
        raise InvalidValue(f"prefill: {describe(row)} is also {what} in this step",
                           field="prefill")
    if kind == NO_PENDING_GRANT:
        raise NoPendingGrant(f"{field}: {describe(value)} holds no generation grant",
                             field=field)
    if kind == ACCEPTED_EXCEEDS_DRAFTS:
        row = int(plan.result_rows[index])
        raise AcceptedExceedsDrafts(f"num_accepted: {value} accepted for {detail} drafts "
                                    f"({describe(row)})")
    if kind == GRANT_PENDING:
        raise GrantPending(f"{field}: {describe(value)} already holds a grant", field=field)
    if kind == PREFILL_INCOMPLETE:
        raise PrefillIncomplete(f"{field}: {describe(value)}'s prompt is not fully scheduled",
                                field=field)
    if kind == PADDING_BELOW_DRAFT:
        raise InvalidValue(f"{field}: {value} is below the granted draft_len={detail}",
                           field=field)
    if kind == PREFILL_PAST_PROMPT:
        row = int(plan.prefill_rows[index])
        raise InvalidValue(f"{field}: {value} tokens go past the end of {describe(row)}'s "
                           f"prompt ({detail} tokens)", field=field)
    if kind == ROW_OVERFLOW:
        raise BlockTableOverflow(f"capacity: {describe(index)} would need more than "
                                 f"max_blocks_per_seq={detail} blocks", row=index,
                                 req_id=request_of(index))
    if kind == OUT_OF_BLOCKS:
        raise OutOfBlocks(f"num_blocks: {detail} blocks available, not enough for "
                          f"{describe(index)}")
    raise AssertionError(f"unknown step error kind {kind}")
