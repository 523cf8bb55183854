"""The batched step's failures as codes, and the one place that turns a code into a typed error.

Both implementations of the step (`step.reference`, numpy, and `step.compiled`, numba) report a
bad plan the same way: an int64 array ``[kind, subject, index, detail]`` (``kind`` 0: no error).
``subject`` is the plan list at fault (one of ``SUBJECTS``), ``index`` the position in that list
(or a row, for the block errors), ``detail`` a number the message quotes. `raise_step_error` turns
it into the typed error every caller sees, so the two implementations cannot word, type or field
an error differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from kvalloc.allocator.capacity.step.plan import FIELDS, PlanArrays
from kvalloc.allocator.errors import (
    AcceptedExceedsDrafts,
    BlockTableOverflow,
    DraftLenExceeded,
    DuplicateRequest,
    GrantPending,
    InvalidValue,
    KVAllocError,
    NoPendingGrant,
    OutOfBlocks,
    PrefillIncomplete,
    UnknownRequest,
)

# Subjects: the plan lists, in `PlanArrays` order.
SUBJECTS = tuple(FIELDS)
REVERTS, RESULTS, ACCEPTED, FINISHED, GRANTS, DRAFTS, PADDING, PADDED, PREFILL, CHUNK_TOKENS, \
    PROMPTS, FIRST_CHUNKS = range(len(SUBJECTS))

# Per plan list, in `PlanArrays` order (which is also the order the step checks them in): does
# it name rows (else it holds counts), and the least value a count may take.
NAMES_ROWS = (True, True, False, True, True, False, True, False, True, False, False, False)
LEAST_VALUE = (0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0)

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
TWO_UNSETTLED = 18  # a lag-2 grant for a request whose pending grant already has a step behind
LAG1_PENDING = 19  # a lag-2 grant for a request whose pending grant was made at lag 1

ERROR_SLOTS = 4


def no_error() -> np.ndarray:
    return np.zeros(ERROR_SLOTS, dtype=np.int64)


@dataclass(frozen=True)
class _Failure:
    """A decoded error array, with what its message quotes."""

    field: str
    value: int  # the plan entry at fault (the index itself for the block errors)
    index: int
    detail: int
    plan: PlanArrays
    request_of: Callable[[int], object]

    def describe(self, row: int) -> str:
        req = self.request_of(row)
        return f"row {row}" if req is None else f"row {row} (request {req!r})"

    def row_of(self, list_name: str) -> str:
        """The row at ``index`` of another plan list, described."""
        return self.describe(int(getattr(self.plan, list_name)[self.index]))


# kind -> (error class, its message after "<field>: ").
_MESSAGES: dict[int, tuple[type[KVAllocError], Callable[[_Failure], str]]] = {
    UNKNOWN_ROW: (UnknownRequest, lambda f: f"row {f.value} is not a live request"),
    DUPLICATE_ROW: (DuplicateRequest, lambda f: f"{f.describe(f.value)} is listed twice"),
    BELOW_MINIMUM: (InvalidValue, lambda f: f"{f.value} is below {f.detail}"),
    ABOVE_MAX_DRAFT: (DraftLenExceeded, lambda f: f"{f.value} is above max_draft_len={f.detail}"),
    PROMPT_TOO_LONG: (InvalidValue, lambda f: f"{f.value} is above max_seq_len={f.detail}"),
    CHUNK_PAST_PROMPT: (InvalidValue, lambda f: f"{f.value} is larger than the prompt "
                        f"({int(f.plan.prompt_lens[f.index])} tokens)"),
    REVERTED_AND_SETTLED: (InvalidValue, lambda f: f"{f.describe(f.value)} is already "
                           "reverted in this step"),
    FINISHED_AND_SCHEDULED: (InvalidValue, lambda f: f"{f.describe(f.value)} is also "
                             "scheduled in this step"),
    SCHEDULED_AND_PREFILLED: (InvalidValue, lambda f: f"{f.row_of('prefill_rows')} is also "
                              f"{'granted' if f.field == 'grants' else 'padded'} in this step"),
    NO_PENDING_GRANT: (NoPendingGrant, lambda f: f"{f.describe(f.value)} holds no generation "
                       "grant"),
    ACCEPTED_EXCEEDS_DRAFTS: (AcceptedExceedsDrafts, lambda f: f"{f.value} accepted for "
                              f"{f.detail} drafts ({f.row_of('result_rows')})"),
    GRANT_PENDING: (GrantPending, lambda f: f"{f.describe(f.value)} already holds a grant"),
    TWO_UNSETTLED: (GrantPending, lambda f: f"{f.describe(f.value)} already has two unsettled "
                    "steps (lag 2 allows one besides the grant): report the older one's results"),
    LAG1_PENDING: (GrantPending, lambda f: f"{f.describe(f.value)} holds a grant made at lag 1: "
                   "settle it before granting at lag 2"),
    PREFILL_INCOMPLETE: (PrefillIncomplete, lambda f: f"{f.describe(f.value)}'s prompt is not "
                         "fully scheduled"),
    PADDING_BELOW_DRAFT: (InvalidValue, lambda f: f"{f.value} is below the granted "
                          f"draft_len={f.detail}"),
    PREFILL_PAST_PROMPT: (InvalidValue, lambda f: f"{f.value} tokens go past the end of "
                          f"{f.row_of('prefill_rows')}'s prompt ({f.detail} tokens)"),
    ROW_OVERFLOW: (BlockTableOverflow, lambda f: f"{f.describe(f.index)} would need more than "
                   f"max_blocks_per_seq={f.detail} blocks"),
    OUT_OF_BLOCKS: (OutOfBlocks, lambda f: f"{f.detail} blocks available, not enough for "
                    f"{f.describe(f.index)}"),
}

# The errors whose field is their own, not the plan list's.
_OWN_FIELD = {SCHEDULED_AND_PREFILLED: "prefill", ROW_OVERFLOW: "capacity",
              OUT_OF_BLOCKS: "num_blocks"}


def raise_step_error(error: np.ndarray, plan: PlanArrays,
                     request_of: Callable[[int], object]) -> NoReturn:
    """Raise the typed error ``error`` reports. ``request_of(row)``: the request id a row was
    admitted under, or None; messages name both."""
    kind, subject, index, detail = (int(v) for v in error)
    values = plan[subject]
    failure = _Failure(FIELDS[SUBJECTS[subject]],
                       int(values[index]) if 0 <= index < values.size else index, index,
                       detail, plan, request_of)
    cls, message = _MESSAGES[kind]
    field = _OWN_FIELD.get(kind, failure.field)
    text = f"{field}: {message(failure)}"
    if cls is BlockTableOverflow:
        raise BlockTableOverflow(text, row=index, req_id=request_of(index))
    raise cls(text, field=field)
