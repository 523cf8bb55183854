"""The batched step's input and output: `StepPlan` (rows as integer arrays) and `StepOutcome`.

A plan names live requests by block-table row. Int64 numpy arrays are the fast path; lists and
other integer arrays are accepted and converted here (`coerce`), which checks each list's length
and that it holds integers. A caller that already checked exactly that (the service, whose step
columns are validated at its edge) builds the arrays with `checked_plan` instead. Everything else
about the plan (rows live and listed once, value bounds, the grant state machine, blocks) is the
step's to check, before it changes anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from kvalloc.allocator.errors import InvalidValue
from numpy.typing import ArrayLike

# StepOutcome.new_refusals: why a new request was not admitted.
ADMITTED = 0
REFUSED_OUT_OF_BLOCKS = 1
REFUSED_BATCH_FULL = 2
# Its prefix is coming back from the host tier over more than this step's share of the link
# (`capacity.onboard`): asked again, it finds more of it in the pool.
REFUSED_ONBOARDING = 3

LAGS = (1, 2)  # StepPlan.lag: calls between a step's grant and its results


@dataclass(frozen=True)
class StepPlan:
    """One scheduler step, applied atomically in this order:

    1. ``revert_rows``: forwards that were skipped; their grants are undone exactly.
    2. ``result_rows`` / ``num_accepted``: the previous step's accepted draft counts.
    3. ``finished_rows``: requests whose blocks (and rows) go back to the pool.
    4. ``padding_rows`` / ``grant_rows``: CUDA-graph padding of grants made in earlier calls
       (served first, never refused: OutOfBlocks fails the step), then this step's generation
       grants with their draft lengths (and padding), served in order; one that does not fit is
       refused (``granted`` False) and changes nothing.
    5. ``prefill_rows`` / ``prefill_tokens``: further chunks of prompts being prefilled.
    6. ``prompt_lens`` / ``first_chunks``: new requests (first chunk 0: the whole prompt; with
       a cached prefix, the first chunk counts from its end).

    Running requests come before prefill and new requests when blocks are short, so a step never
    starves a request it already admitted. ``strict_grants``: a grant that does not fit raises
    OutOfBlocks (the step changes nothing) instead of being refused.

    ``lag``: 1 (a step's results come with the next call, before its next grant) or 2 (they
    come one call later: a grant may find the request's previous step still unsettled, and
    ``result_rows`` settle each request's oldest unsettled step; a revert undoes the newest).
    """

    revert_rows: ArrayLike = ()
    result_rows: ArrayLike = ()
    num_accepted: ArrayLike = ()
    finished_rows: ArrayLike = ()
    grant_rows: ArrayLike = ()
    draft_lens: ArrayLike = ()
    padding_rows: ArrayLike = ()
    padded_draft_lens: ArrayLike = ()
    prefill_rows: ArrayLike = ()
    prefill_tokens: ArrayLike = ()
    prompt_lens: ArrayLike = ()
    first_chunks: ArrayLike = ()
    strict_grants: bool = False
    lag: int = 1
    # Empty, or one per new request: its prompt's token ids (None: not shared), or a
    # `prefix_cache.Prompt` made when it arrived. With prefix caching on, the longest cached
    # run of its full blocks becomes its first blocks.
    prompt_tokens: Sequence[Any] = ()


@dataclass(eq=False)  # built every step, never changed: a frozen constructor costs more
class StepOutcome:
    """What a step did, as arrays (a worker or a service needs nothing else).

    The ``changed_*`` arrays describe every block-table row whose cells changed (grown, shrunk,
    freed or admitted), in ascending row order: after the step, row ``changed_rows[i]`` holds
    ``changed_block_ids``' next ``changed_num_blocks[i] - changed_from[i]`` ids in columns
    ``[changed_from[i], changed_num_blocks[i])``, its earlier columns are as before, and -1 from
    ``changed_num_blocks[i]`` on. In a windowed group those ids include the `RELEASED` marks of
    columns whose blocks went back to the pool (`capacity.windows`).
    """

    granted: np.ndarray  # bool, one per grant
    prefill_granted: np.ndarray  # bool, one per prefill chunk
    admitted_rows: np.ndarray  # int64, one per new request: its row, -1 if refused
    new_refusals: np.ndarray  # int8, one per new request: ADMITTED or a REFUSED_* code
    grant_starts: np.ndarray  # int64, one per grant: position of its first token
    prefill_starts: np.ndarray  # int64, one per prefill chunk: history before the chunk
    changed_rows: np.ndarray  # int64
    changed_from: np.ndarray  # int64, first column that changed
    changed_num_blocks: np.ndarray  # int64, block count after the step (0: freed)
    changed_block_ids: np.ndarray  # int32, concatenated
    num_blocks: np.ndarray  # int64 [max_batch_size], every row's block count after the step
    # int64, one per new request: prompt tokens already in cached blocks (0 if refused); the
    # worker skips their prefill.
    cached_tokens: np.ndarray


@dataclass(frozen=True)
class RequestView:
    """One live row's state, for inspection."""

    row: int
    capacity: int
    history: int
    pending_overlap_slack: int
    pending_draft_len: int | None  # None: no pending generation grant
    num_blocks: int
    block_ids: np.ndarray


class PlanArrays(NamedTuple):
    """A `StepPlan` after `coerce`: every list an int64 array, lengths checked."""

    revert_rows: np.ndarray
    result_rows: np.ndarray
    num_accepted: np.ndarray
    finished_rows: np.ndarray
    grant_rows: np.ndarray
    draft_lens: np.ndarray
    padding_rows: np.ndarray
    padded_draft_lens: np.ndarray
    prefill_rows: np.ndarray
    prefill_tokens: np.ndarray
    prompt_lens: np.ndarray
    first_chunks: np.ndarray  # one per new request; 0 (whole prompt) where the plan gave none
    strict_grants: bool
    lag: int = 1


# The name each plan list goes by in an error's ``field`` (the service's names for them).
FIELDS: dict[str, str] = {
    "revert_rows": "reverts",
    "result_rows": "results",
    "num_accepted": "num_accepted",
    "finished_rows": "finished",
    "grant_rows": "grants",
    "draft_lens": "draft_len",
    "padding_rows": "padding",
    "padded_draft_lens": "padded_draft_len",
    "prefill_rows": "prefill",
    "prefill_tokens": "prefill_tokens",
    "prompt_lens": "prompt_len",
    "first_chunks": "first_chunk",
}

_EMPTY = np.zeros(0, dtype=np.int64)  # (nothing can be written into it)


def coerce(plan: StepPlan) -> PlanArrays:
    """Every list of ``plan`` as a 1-D int64 array; InvalidValue (naming the field) when a list
    does not hold integers or its length does not match the list it goes with."""
    revert_rows = _integers(plan.revert_rows, "revert_rows")
    result_rows = _integers(plan.result_rows, "result_rows")
    num_accepted = _integers(plan.num_accepted, "num_accepted", result_rows.size)
    finished_rows = _integers(plan.finished_rows, "finished_rows")
    grant_rows = _integers(plan.grant_rows, "grant_rows")
    draft_lens = _integers(plan.draft_lens, "draft_lens", grant_rows.size)
    padding_rows = _integers(plan.padding_rows, "padding_rows")
    padded = _integers(plan.padded_draft_lens, "padded_draft_lens", padding_rows.size)
    prefill_rows = _integers(plan.prefill_rows, "prefill_rows")
    prefill_tokens = _integers(plan.prefill_tokens, "prefill_tokens", prefill_rows.size)
    prompt_lens = _integers(plan.prompt_lens, "prompt_lens")
    first_chunks = _integers(plan.first_chunks, "first_chunks")
    if first_chunks.size == 0 and prompt_lens.size:
        first_chunks = np.zeros(prompt_lens.size, dtype=np.int64)
    elif first_chunks.size != prompt_lens.size:
        raise InvalidValue(f"first_chunk: {first_chunks.size} values for {prompt_lens.size} "
                           "new requests (give none, or one per new request)", field="first_chunk")
    if type(plan.lag) is not int or plan.lag not in LAGS:
        raise InvalidValue(f"lag: {plan.lag!r} is not one of {LAGS}", field="lag")
    return PlanArrays(revert_rows, result_rows, num_accepted, finished_rows, grant_rows,
                      draft_lens, padding_rows, padded, prefill_rows, prefill_tokens, prompt_lens,
                      first_chunks, bool(plan.strict_grants), plan.lag)


def checked_plan(*, revert_rows: np.ndarray, result_rows: np.ndarray, num_accepted: np.ndarray,
                 finished_rows: np.ndarray, grant_rows: np.ndarray, draft_lens: np.ndarray,
                 padding_rows: np.ndarray, padded_draft_lens: np.ndarray,
                 prefill_rows: np.ndarray, prefill_tokens: np.ndarray, prompt_lens: np.ndarray,
                 first_chunks: np.ndarray, lag: int = 1) -> PlanArrays:
    """`coerce`'s result for lists the caller already checked: 1-D int64 arrays whose lengths
    match (``first_chunks`` empty or one per new request). Only the array type is settled here:
    a read-only or strided array (a transport's buffer, a view) is copied, since the compiled
    step is built for one type."""
    if first_chunks.size == 0 and prompt_lens.size:
        first_chunks = np.zeros(prompt_lens.size, dtype=np.int64)
    columns = (revert_rows, result_rows, num_accepted, finished_rows, grant_rows, draft_lens,
               padding_rows, padded_draft_lens, prefill_rows, prefill_tokens, prompt_lens,
               first_chunks)
    return PlanArrays(*[compiled_type(c) for c in columns], False, lag)


def compiled_type(values: np.ndarray) -> np.ndarray:
    """An int64 array as the compiled loops take it, contiguous, aligned and writable:
    ``values`` itself, or a copy (numba compiles a loop again for a read-only, strided or
    unaligned array)."""
    if values.flags.carray:
        return values
    return np.array(values) if values.size else _EMPTY


def prompt_token_arrays(values: Sequence[Any], prompt_lens: np.ndarray) -> list[Any]:
    """``StepPlan.prompt_tokens`` checked: none, or one entry per new request, each None,
    ``prompt_len`` non-negative integers, or an object whose ``tokens`` are (a
    `prefix_cache.Prompt`, kept as it is). InvalidValue (field ``prompt_tokens``) otherwise."""
    if values is None or len(values) == 0:
        return []
    if len(values) != prompt_lens.size:
        raise InvalidValue(f"prompt_tokens: {len(values)} entries for {prompt_lens.size} new "
                           "requests (give none, or one per new request)", field="prompt_tokens")
    out: list[Any] = []
    for i, tokens in enumerate(values):
        if tokens is None:
            out.append(None)
            continue
        prompt = tokens if hasattr(tokens, "hashes") else None
        arr = _integers(tokens.tokens if prompt is not None else tokens, "prompt_tokens")
        if arr.size != prompt_lens[i] or (arr.size and arr.min() < 0):
            raise InvalidValue(f"prompt_tokens: entry {i} must be {int(prompt_lens[i])} "
                               "non-negative token ids (its prompt_len)", field="prompt_tokens")
        out.append(prompt if prompt is not None else arr)
    return out


def _integers(values: ArrayLike, name: str, expected: int | None = None) -> np.ndarray:
    field = FIELDS.get(name, name)
    if (type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1
            and values.flags.c_contiguous and values.flags.writeable):
        arr = values  # the fast path: nothing to convert
    elif isinstance(values, tuple | list) and not values:
        arr = _EMPTY
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError):
            raise InvalidValue(f"{field}: expected integers", field=field) from None
        if arr.ndim != 1:
            raise InvalidValue(f"{field}: expected a flat list of integers, got shape "
                               f"{arr.shape}", field=field)
        if arr.dtype.kind not in "iu":
            # Floats, bools and strings would be truncated or coerced silently by an int cast.
            if arr.size:
                raise InvalidValue(f"{field}: expected integers", field=field)
            arr = _EMPTY
        else:
            if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
                raise InvalidValue(f"{field}: {int(arr.max())} is out of range", field=field)
            # One array type for the compiled step: int64, contiguous, writeable (read-only
            # buffers from a transport are copied; the step never writes a plan array).
            arr = np.array(arr, dtype=np.int64)
    if expected is not None and arr.size != expected:
        raise InvalidValue(f"{field}: {arr.size} values for {expected} requests", field=field)
    return arr


def with_changes(outcome: StepOutcome, rows: np.ndarray, first: np.ndarray,
                 num_blocks: np.ndarray, host: np.ndarray) -> StepOutcome:
    """``outcome`` whose ``changed_*`` also cover columns ``first[i]`` onwards of ``rows[i]``."""
    start = dict(zip(outcome.changed_rows.tolist(), outcome.changed_from.tolist(), strict=True))
    for row, column in zip(rows.tolist(), first.tolist(), strict=True):
        start[row] = min(start.get(row, column), column)
    changed = np.array(sorted(start), dtype=np.int64)
    starts = np.array([start[r] for r in changed.tolist()], dtype=np.int64)
    ends = num_blocks[changed]
    ids = [host[r, s:e] for r, s, e in zip(changed.tolist(), starts.tolist(), ends.tolist(),
                                           strict=True)]
    return dataclasses.replace(
        outcome, changed_rows=changed, changed_from=starts, changed_num_blocks=ends.copy(),
        changed_block_ids=np.concatenate([np.zeros(0, dtype=np.int32), *ids]).astype(np.int32))
