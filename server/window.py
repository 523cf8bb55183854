"""`Window`: the tokens of one step's forward, from the reply that schedules them to the call that
commits them.

The worker stages token ``i`` of its step at ``staging[layer, 0 or 1, i]``. The reply lists the
scheduled requests in token order (decode grants, then prefill chunks, then new requests); each
owns a contiguous run of tokens at consecutive positions, the last ``num_drafts`` of which are
drafts, and ``slots[i]`` is where token ``i`` lives in the pool.

Settling a window (the next call) yields the slots to commit: a request that was reverted or
finished commits nothing, and no token is written past the blocks its request still owns after
the settlement, so even NWOR's write-everything fallback never touches a block another request
may have been given in the same call.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from allocator.block_table import BlockTable

from . import wire


class Window:
    def __init__(self, req_ids: Sequence[str], decode: Sequence[bool] | np.ndarray,
                 rows: Sequence[int] | np.ndarray, starts: Sequence[int] | np.ndarray,
                 num_tokens: Sequence[int] | np.ndarray, num_drafts: Sequence[int] | np.ndarray,
                 table: BlockTable, tokens_per_block: int) -> None:
        """``table`` is the block table as it stands after the step that schedules the window."""
        self.req_ids = list(req_ids)
        self.decode = np.asarray(decode, dtype=bool)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.num_tokens = np.asarray(num_tokens, dtype=np.int64)
        self.num_drafts = np.asarray(num_drafts, dtype=np.int64)
        self.tokens_per_block = tokens_per_block
        self.offsets = np.cumsum(self.num_tokens) - self.num_tokens
        self.token_req = np.repeat(np.arange(len(self.req_ids)), self.num_tokens)
        self.positions = (self.starts[self.token_req]
                          + np.arange(self.token_req.size) - self.offsets[self.token_req])
        # Capacity covers every scheduled position, so no slot is -1; it keeps a bug from faulting.
        self.slots = table.host_slot_mapping(self.rows[self.token_req], self.positions,
                                             tokens_per_block)

    @property
    def total_tokens(self) -> int:
        return int(self.token_req.size)

    def scheduled(self) -> list[wire.Scheduled]:
        return [
            wire.Scheduled(req_id=r, kind="decode" if d else "prefill", row=row,
                           token_offset=off, num_tokens=n, num_drafts=nd, start_position=s)
            for r, d, row, off, n, nd, s in zip(
                self.req_ids, self.decode.tolist(), self.rows.tolist(), self.offsets.tolist(),
                self.num_tokens.tolist(), self.num_drafts.tolist(), self.starts.tolist(),
                strict=True)
        ]

    def unsettled(self, settled: Collection[str]) -> list[str]:
        """Decode requests of this window that ``settled`` does not mention."""
        return [r for r, d in zip(self.req_ids, self.decode.tolist(), strict=True)
                if d and r not in settled]

    def mask(self, req_ids: Collection[str]) -> np.ndarray:
        """Per request: is it one of ``req_ids``."""
        return np.fromiter((r in req_ids for r in self.req_ids), dtype=bool,
                           count=len(self.req_ids))

    def accepted_counts(self, accepted: Mapping[str, int]) -> np.ndarray:
        """Per request: its accepted drafts, 0 where ``accepted`` has none (prefill, dropped)."""
        return np.fromiter((accepted.get(r, 0) for r in self.req_ids), dtype=np.int64,
                           count=len(self.req_ids))

    def commit_slots(self, dropped: np.ndarray, blocks_after: np.ndarray) -> np.ndarray:
        """Slots to commit: -1 for ``dropped`` requests (per-request mask) and for positions past
        a request's ``blocks_after`` (its block count once the settling call has applied)."""
        owned = self.positions < blocks_after[self.token_req] * self.tokens_per_block
        return np.where(~dropped[self.token_req] & owned, self.slots, -1)
