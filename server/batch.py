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
        owned = self.positions < blocks_after[self.token_request] * self.tokens_per_block
        return np.where(~dropped[self.token_request] & owned, self.slots, -1)
