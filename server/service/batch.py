"""`ScheduledBatch`: the tokens of one step's forward, from the reply that schedules them to the
call that commits them, and `schedule`, which lays them out.

The worker stages token ``i`` of its step at ``staging[layer, 0 or 1, i]``. The batch lists the
scheduled requests in token order (granted decodes, then prefill chunks, then new requests); each
owns a contiguous run of tokens at consecutive positions, the last ``num_drafts`` of which are
drafts, and ``slots[g, i]`` is where token ``i`` lives in the pool of table ``g`` (one table;
a grouped pool's, one per group).

Settling the batch (the next call) says, per request, how many of its drafts were accepted and
whether it was dropped (reverted or finished), and yields the slots to commit: a dropped request
commits nothing, and no token is written past the blocks its request still owns after the
settlement, so even NWOR's write-everything fallback never touches a block another request may
have been given in the same call.

`schedule` lays the batch out from the manager's `StepOutcome` and the call's columns: the
reply's `Scheduled` columns and how many of its entries are decodes. A granted decode runs 1 +
its drafts, a prefill chunk its granted tokens, a new request ``min(prompt_tokens, prompt_len -
start)`` from its start (after its cached prompt tokens); where those tokens live in the pool is
the manager's to say (`KVCacheManager.token_slots` of the runs). `schedule_compiled` is
`schedule_reference` as one numba loop: the per-step cost is a few dozen tiny array operations
otherwise.

Each compiled loop here has a numpy reference (``*_reference``) that states what it computes;
tests compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from kvalloc.allocator.common.jit import jit, numba
from kvalloc.server.contract.columns import Scheduled
from kvalloc.server.contract.errors import StepNotSettled


class Settlement(NamedTuple):
    """Per request of a settled batch."""

    accepted: np.ndarray  # its accepted drafts: 0 unless it was reported (and not dropped)
    dropped: np.ndarray  # reverted or finished: it commits nothing


@dataclass(eq=False)  # not frozen, as `columns`' records: built every step, never changed
class ScheduledBatch:
    scheduled: Scheduled
    num_decodes: int  # the first entries are decodes: only they must be settled
    # [tables, tokens]: each token's slot in each table's pool (capacity covers it: -1 only
    # behind a windowed group's window)
    slots: np.ndarray
    tokens_per_block: int

    @property
    def total_tokens(self) -> int:
        return int(self.slots.shape[1])

    def settle(self, result_rows: np.ndarray, num_accepted: np.ndarray,
               revert_rows: np.ndarray, finished_rows: np.ndarray, *, num_rows: int,
               step_id: int | None) -> Settlement:
        """What the settling call says of each request: reported with ``num_accepted`` (per
        ``result_rows``), reverted or finished. `StepNotSettled` unless every decode request
        (``step_id`` ran it) is one of these; ``num_rows``: the block table's."""
        accepted, dropped, missing, unsettled = settle_rows(
            self.scheduled.rows, self.num_decodes, result_rows, num_accepted, revert_rows,
            finished_rows, num_rows)
        if missing >= 0:
            raise StepNotSettled(
                f"results: the request of handle {int(self.scheduled.handles[missing])} ran in "
                f"step {step_id}: report its accepted count, revert it or finish it "
                f"({unsettled} unsettled)")
        return Settlement(accepted, dropped)

    def owned_slots(self, dropped: np.ndarray, table: np.ndarray, index: int = 0) -> np.ndarray:
        """Slots to commit into table ``index``'s pool: -1 for ``dropped`` requests (per
        request) and for every token whose block is no longer its row's at that column once the
        settling call has applied (``table``: that block table's host copy after the step):
        past a row shrunk by a revert, and in a windowed row's leading columns the step gave
        back (`RELEASED`), whose blocks may already be another row's."""
        s = self.scheduled
        return mask_unowned_slots(s.rows, s.token_offsets, s.num_tokens, s.start_positions,
                                  self.slots[index], dropped, table, self.tokens_per_block)


def mask_unowned_slots_reference(rows: np.ndarray, token_offsets: np.ndarray,
                                 num_tokens: np.ndarray, start_positions: np.ndarray,
                                 slots: np.ndarray, dropped: np.ndarray, table: np.ndarray,
                                 tokens_per_block: int) -> np.ndarray:
    """`ScheduledBatch.owned_slots` over the batch's columns (`Scheduled`'s, ``slots`` per
    token), in numpy."""
    request = np.repeat(np.arange(rows.size), num_tokens)
    positions = start_positions[request] + np.arange(request.size) - token_offsets[request]
    cols = positions // tokens_per_block
    in_row = cols < table.shape[1]
    held = np.where(in_row, table[rows[request], np.where(in_row, cols, 0)], -1)
    owned = (slots >= 0) & (held == slots // tokens_per_block)
    return np.where(~dropped[request] & owned, slots, -1)


def _mask_unowned_slots_loop(rows, token_offsets, num_tokens,  # type: ignore[no-untyped-def]
                             start_positions, slots, dropped, table,
                             tokens_per_block):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    out = np.empty(slots.size, np.int64)
    width = table.shape[1]
    for e in range(rows.size):
        first = token_offsets[e]
        for t in range(first, first + num_tokens[e]):
            col = (start_positions[e] + t - first) // tokens_per_block
            slot = slots[t]
            keep = (not dropped[e] and slot >= 0 and col < width
                    and table[rows[e], col] == slot // tokens_per_block)
            out[t] = slot if keep else -1
    return out


# Several whole-batch array operations a step otherwise, over a thousand tokens.
mask_unowned_slots = (jit(_mask_unowned_slots_loop) if numba is not None
                      else mask_unowned_slots_reference)


_REPORTED, _DROPPED = 1, 2  # a row's settlement; 0: none


def settle_rows_reference(rows: np.ndarray, num_decodes: int, result_rows: np.ndarray,
                          num_accepted: np.ndarray, revert_rows: np.ndarray,
                          finished_rows: np.ndarray,
                          num_rows: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`ScheduledBatch.settle` over the batch's ``rows`` (its first ``num_decodes`` are decodes):
    accepted and dropped per request, then the index of the first unsettled decode (-1: none)
    and how many there are. A dropped row counts as dropped even if it was reported too."""
    settlement = np.zeros(num_rows, dtype=np.int8)
    settlement[result_rows] = _REPORTED
    settlement[revert_rows] = settlement[finished_rows] = _DROPPED
    accepted_by_row = np.zeros(num_rows, dtype=np.int64)
    accepted_by_row[result_rows] = num_accepted
    settled = settlement[rows]
    unsettled = np.flatnonzero(settled[:num_decodes] == 0)
    accepted = np.where(settled == _REPORTED, accepted_by_row[rows], 0)
    return (accepted, settled == _DROPPED, int(unsettled[0]) if unsettled.size else -1,
            int(unsettled.size))


def _settle_rows_loop(rows, num_decodes, result_rows, num_accepted,  # type: ignore[no-untyped-def]
                      revert_rows, finished_rows, num_rows):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    settlement = np.zeros(num_rows, np.int8)
    accepted_by_row = np.empty(num_rows, np.int64)
    for i in range(result_rows.size):
        settlement[result_rows[i]] = _REPORTED
        accepted_by_row[result_rows[i]] = num_accepted[i]
    for row in revert_rows:
        settlement[row] = _DROPPED
    for row in finished_rows:
        settlement[row] = _DROPPED
    accepted = np.zeros(rows.size, np.int64)
    dropped = np.empty(rows.size, np.bool_)
    missing, unsettled = -1, 0
    for e in range(rows.size):
        state = settlement[rows[e]]
        dropped[e] = state == _DROPPED
        if state == _REPORTED:
            accepted[e] = accepted_by_row[rows[e]]
        elif state == 0 and e < num_decodes:
            unsettled += 1
            if missing < 0:
                missing = e
    return accepted, dropped, missing, unsettled


# A handful of scatters and gathers over the block table's rows a step otherwise.
settle_rows = jit(_settle_rows_loop) if numba is not None else settle_rows_reference


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
    _compiled_schedule = jit(_schedule_loop)


def schedule_compiled(requests: ForwardRequests) -> tuple[Scheduled, int]:
    """`schedule_reference` as one compiled loop (same argument, same result). numba takes no
    record: the loop gets the arrays one by one, in the record's order."""
    per_entry, num_decodes = _compiled_schedule(*requests)
    # Row by row: unpacking the block iterates it, at twice the cost.
    return Scheduled(per_entry[0], per_entry[1], per_entry[2], per_entry[3], per_entry[4],
                     per_entry[5]), int(num_decodes)


schedule = schedule_compiled if numba is not None else schedule_reference
