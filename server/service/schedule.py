"""This step's forward, laid out: which requests run, and where their tokens sit in the step.

Input: the manager's `StepOutcome` and the call's columns, named in one `ForwardRequests`.
Output: the `Scheduled` columns of the reply and how many of its entries are decodes. Order:
granted decodes (in grant order), then granted prefill chunks, then admitted new requests, each
running ``min(prompt_tokens, prompt_len - start)`` tokens from its start (after its cached prompt
tokens). Request ``i`` owns tokens ``token_offsets[i] ..`` at positions ``start_positions[i] ..``,
its last ``num_drafts[i]`` are drafts. Where those tokens live in the pool is the manager's to
say (`KVCacheManager.token_slots` of the runs).

`schedule_reference` is the specification in numpy; `schedule_compiled` the same as one numba
loop (the per-step cost is a few dozen tiny array operations otherwise). Tests compare the two.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from allocator.common.jit import jit, numba
from server.contract.columns import Scheduled


class ForwardRequests(NamedTuple):
    """The requests this step's forward may run, in its three groups, and what the manager
    granted each: one entry per grant, per prefill chunk and per new request of the call, all
    int64 but the ``granted`` marks (bool). The compiled loop takes the fields in this order."""

    grant_handles: np.ndarray
    grant_rows: np.ndarray
    granted: np.ndarray
    drafts: np.ndarray
    grant_starts: np.ndarray
    prefill_handles: np.ndarray
    prefill_rows: np.ndarray
    prefill_granted: np.ndarray
    prefill_tokens: np.ndarray
    prefill_starts: np.ndarray
    new_handles: np.ndarray
    admitted_rows: np.ndarray  # -1: refused
    prompt_tokens: np.ndarray  # the most a new request runs: its first chunk, or its prompt
    prompt_lens: np.ndarray
    new_starts: np.ndarray  # its cached prompt tokens


def schedule_reference(requests: ForwardRequests) -> tuple[Scheduled, int]:
    r = requests
    new = r.admitted_rows >= 0
    decode_drafts = r.drafts[r.granted]
    new_tokens = np.minimum(r.prompt_tokens, r.prompt_lens - r.new_starts)
    num_tokens = np.concatenate([1 + decode_drafts, r.prefill_tokens[r.prefill_granted],
                                 new_tokens[new]])
    offsets = np.cumsum(num_tokens) - num_tokens
    rows = np.concatenate([r.grant_rows[r.granted], r.prefill_rows[r.prefill_granted],
                           r.admitted_rows[new]])
    starts = np.concatenate([r.grant_starts[r.granted], r.prefill_starts[r.prefill_granted],
                             r.new_starts[new]])
    scheduled = Scheduled(
        handles=np.concatenate([r.grant_handles[r.granted],
                                r.prefill_handles[r.prefill_granted], r.new_handles[new]]),
        rows=rows, token_offsets=offsets, num_tokens=num_tokens,
        num_drafts=np.concatenate([decode_drafts,
                                   np.zeros(rows.size - decode_drafts.size, dtype=np.int64)]),
        start_positions=starts)
    return scheduled, int(decode_drafts.size)


def _schedule_loop(grant_handles, grant_rows, granted, drafts, grant_starts, prefill_handles,
                   prefill_rows, prefill_granted, prefill_tokens, prefill_starts, new_handles,
                   admitted_rows, prompt_tokens, prompt_lens, new_starts):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    num_decodes = granted.sum()
    entries = num_decodes + prefill_granted.sum() + (admitted_rows >= 0).sum()
    # One block of columns instead of six arrays: each returned array costs a conversion.
    per_entry = np.zeros((6, entries), np.int64)  # `Scheduled`'s fields, in its order
    handles, rows, offsets, num_tokens, num_drafts, starts = per_entry
    e = 0
    for i in range(granted.size):
        if granted[i]:
            handles[e], rows[e] = grant_handles[i], grant_rows[i]
            num_tokens[e], num_drafts[e], starts[e] = 1 + drafts[i], drafts[i], grant_starts[i]
            e += 1
    for i in range(prefill_granted.size):
        if prefill_granted[i]:
            handles[e], rows[e] = prefill_handles[i], prefill_rows[i]
            num_tokens[e], starts[e] = prefill_tokens[i], prefill_starts[i]
            e += 1
    for i in range(admitted_rows.size):
        if admitted_rows[i] >= 0:
            handles[e], rows[e], starts[e] = new_handles[i], admitted_rows[i], new_starts[i]
            num_tokens[e] = min(prompt_tokens[i], prompt_lens[i] - new_starts[i])
            e += 1
    t = 0
    for e in range(entries):
        offsets[e] = t
        t += num_tokens[e]
    return per_entry, num_decodes


if numba is not None:
    _compiled_loop = jit(_schedule_loop)


def schedule_compiled(requests: ForwardRequests) -> tuple[Scheduled, int]:
    """`schedule_reference` as one compiled loop (same argument, same result). numba takes no
    record: the loop gets the arrays one by one, in the record's order."""
    per_entry, num_decodes = _compiled_loop(*requests)
    return Scheduled(*per_entry), int(num_decodes)


schedule = schedule_compiled if numba is not None else schedule_reference
