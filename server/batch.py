"""`ScheduledBatch`: the tokens of one step's forward, from the reply that schedules them to the
call that commits them.

The worker stages token ``i`` of its step at ``staging[layer, 0 or 1, i]``. The batch lists the
scheduled requests in token order (granted decodes, then prefill chunks, then new requests); each
owns a contiguous run of tokens at consecutive positions, the last ``num_drafts`` of which are
drafts, and ``slots[i]`` is where token ``i`` lives in the pool.

Settling the batch (the next call) yields the slots to commit: a request that was reverted or
finished commits nothing, and no token is written past the blocks its request still owns after
the settlement, so even NWOR's write-everything fallback never touches a block another request
may have been given in the same call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from allocator.jit import jit, numba

from .columns import Scheduled
from .errors import StepNotSettled


@dataclass(frozen=True)
class ScheduledBatch:
    scheduled: Scheduled
    num_decodes: int  # the first entries are decodes: only they must be settled
    token_request: np.ndarray  # per token: index of its request in ``scheduled``
    positions: np.ndarray  # per token: its sequence position
    slots: np.ndarray  # per token: its pool slot (capacity covers it, so never -1)
    tokens_per_block: int

    @property
    def total_tokens(self) -> int:
        return int(self.token_request.size)

    def check_settled(self, settlement: np.ndarray, step_id: int | None) -> None:
        """Every decode request must be settled: ``settlement`` is non-zero, per block-table
        row, for the rows the settling call reports, reverts or finishes."""
        decode_rows = self.scheduled.rows[: self.num_decodes]
        missing = decode_rows[settlement[decode_rows] == 0]
        if missing.size:
            raise StepNotSettled(
                f"results: the request of handle {self._handle_of(int(missing[0]))} ran in step "
                f"{step_id}: report its accepted count, revert it or finish it "
                f"({missing.size} unsettled)")

    def _handle_of(self, row: int) -> int:
        return int(self.scheduled.handles[np.flatnonzero(self.scheduled.rows == row)[0]])

    def commit_slots(self, dropped: np.ndarray, blocks_after: np.ndarray) -> np.ndarray:
        """Slots to commit: -1 for ``dropped`` requests (per request) and for positions past a
        request's ``blocks_after`` (its block count once the settling call has applied)."""
        return commit_slots(self.token_request, self.positions, self.slots, dropped,
                            blocks_after, self.tokens_per_block)


def commit_slots_reference(token_request: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                           dropped: np.ndarray, blocks_after: np.ndarray,
                           tokens_per_block: int) -> np.ndarray:
    """`ScheduledBatch.commit_slots` over its per-token arrays, in numpy."""
    owned = positions < blocks_after[token_request] * tokens_per_block
    return np.where(~dropped[token_request] & owned, slots, -1)


def _commit_slots_loop(token_request, positions, slots, dropped,  # type: ignore[no-untyped-def]
                       blocks_after, tokens_per_block):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    out = np.empty(slots.size, np.int64)
    for t in range(slots.size):
        r = token_request[t]
        kept = not dropped[r] and positions[t] < blocks_after[r] * tokens_per_block
        out[t] = slots[t] if kept else -1
    return out


# Four whole-batch array operations a step otherwise, over a thousand tokens.
commit_slots = jit(_commit_slots_loop) if numba is not None else commit_slots_reference
