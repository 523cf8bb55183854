"""The per-request API of docs/design.md, a thin facade over `KVCacheManager.step`.

A request is named by the id it was added under (``add_request``); every call that changes it is
one `StepPlan` for its block-table row, so the per-request methods and a batched step apply the
same rules through the same code. `RequestApi` is where `KVCacheManager` takes these methods
from; `RequestIds` is the id edge they translate through (rows admitted by a batched step have no
id and are named by row only).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from kvalloc.allocator.capacity.state import ManagerCounters, RowState
from kvalloc.allocator.capacity.step.plan import (
    REFUSED_BATCH_FULL,
    REFUSED_ONBOARDING,
    RequestView,
    StepOutcome,
    StepPlan,
)
from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.errors import (
    BatchFull,
    DuplicateRequest,
    InvalidValue,
    InvariantViolation,
    OnboardingPending,
    OutOfBlocks,
    UnknownRequest,
)
from numpy.typing import ArrayLike

ReqId = Hashable


@dataclass
class RequestIds:
    """Live requests added by id and their rows, both ways."""

    row_of: dict[ReqId, int] = field(default_factory=dict)
    id_of: dict[int, ReqId] = field(default_factory=dict)

    def check_new(self, req_id: ReqId) -> None:
        """InvalidValue for an unhashable id, DuplicateRequest for a live one."""
        try:
            known = req_id in self.row_of
        except TypeError:
            raise InvalidValue("new: request ids must be hashable", field="new") from None
        if known:
            raise DuplicateRequest(f"new: request {req_id!r} already exists", field="new")

    def add(self, req_id: ReqId, row: int) -> None:
        self.row_of[req_id] = row
        self.id_of[row] = req_id

    def forget(self, rows: np.ndarray) -> None:
        """``rows`` finished: their ids name nothing any more."""
        if self.id_of:
            for row in rows.tolist():
                if row in self.id_of:
                    del self.row_of[self.id_of.pop(row)]

    def name(self, row: int) -> ReqId | None:
        """The id of ``row``, None if it was admitted without one (for error messages)."""
        return self.id_of.get(row)

    def row(self, req_id: ReqId) -> int:
        try:
            return self.row_of[req_id]
        except (KeyError, TypeError):
            raise UnknownRequest(f"req_id: unknown request {req_id!r}") from None

    def rows(self, req_ids: Iterable[ReqId]) -> np.ndarray:
        ids = list(req_ids)
        try:
            return np.fromiter(map(self.row_of.__getitem__, ids), dtype=np.int64,
                               count=len(ids))
        except (KeyError, TypeError):
            bad = next(i for i in ids if i not in self)
            raise UnknownRequest(f"req_id: unknown request {bad!r}") from None

    def __contains__(self, req_id: object) -> bool:
        try:
            return req_id in self.row_of
        except TypeError:
            return False

    def __iter__(self) -> Iterator[ReqId]:
        return iter(self.row_of)

    def check_invariants(self, live: np.ndarray) -> None:
        """Every id names a live row (``live``: a bool per row) that names it back."""
        if any(not live[row] or self.row_of.get(req, -1) != row
               for row, req in self.id_of.items()) or len(self.row_of) != len(self.id_of):
            raise InvariantViolation("the request-id edge disagrees with the live rows")


class RequestApi:
    """The per-request methods of `KVCacheManager`, over what its batched core provides."""

    config: PoolConfig
    rows: RowState
    counters: ManagerCounters
    ids: RequestIds

    if TYPE_CHECKING:
        def step(self, plan: StepPlan) -> StepOutcome: ...

        def view(self, row: int) -> RequestView: ...

    # ------------------------------------------------------------------ changes

    def add_request(self, req_id: ReqId, prompt_len: int, first_chunk: int | None = None, *,
                    prompt_tokens: ArrayLike | None = None) -> int:
        """Admit a request, reserve its prompt (or its first prefill chunk), return its row.
        With ``prompt_tokens`` (and prefix caching on) its cached prefix is reused:
        ``view(row).history`` then starts past it.

        Raises OutOfBlocks / BatchFull when it cannot be admitted; nothing changes then.
        Raises OnboardingPending when its prefix is coming back from a host tier over several
        steps: what came back stays cached, and the same call again admits it once all has.
        """
        self.ids.check_new(req_id)
        if first_chunk is None:
            first_chunk = 0  # the plan's "whole prompt"
        elif isinstance(first_chunk, int | np.integer) and first_chunk < 1:
            raise InvalidValue(f"first_chunk: {first_chunk} is below 1", field="first_chunk")
        out = self.step(StepPlan(prompt_lens=[prompt_len], first_chunks=[first_chunk],
                                 prompt_tokens=() if prompt_tokens is None else [prompt_tokens]))
        row = int(out.admitted_rows[0])
        if row < 0:
            if out.new_refusals[0] == REFUSED_BATCH_FULL:
                raise BatchFull(f"req_id: all {self.config.max_batch_size} rows are in use")
            if out.new_refusals[0] == REFUSED_ONBOARDING:
                raise OnboardingPending(f"req_id: {req_id!r}'s cached prefix is coming back from "
                                        f"the host tier; add it again")
            raise OutOfBlocks(f"num_blocks: no room for request {req_id!r}'s prompt")
        self.ids.add(req_id, row)
        return row

    def extend_prefill(self, req_id: ReqId, num_tokens: int) -> None:
        """Reserve the next chunk of a chunked prefill. Raises OutOfBlocks if it does not fit."""
        out = self.step(StepPlan(prefill_rows=self._one_row(req_id), prefill_tokens=[num_tokens]))
        if not out.prefill_granted[0]:
            raise OutOfBlocks(f"num_blocks: no room for request {req_id!r}'s prefill chunk")

    def try_allocate_generation(self, req_id: ReqId, draft_len: int, *, lag: int = 1) -> bool:
        """Grant 1 + D (+ D slack under overlap at lag 1; at lag 2 the grant may find the
        previous step unsettled, see `StepPlan.lag`); False, changing nothing, when out of
        blocks."""
        out = self.step(StepPlan(grant_rows=self._one_row(req_id), draft_lens=[draft_len],
                                 lag=lag))
        return bool(out.granted[0])

    def prepare_draft_resources(self, req_id: ReqId, draft_len: int, *, lag: int = 1) -> None:
        """The draft model's grant site: the same rule and bookkeeping; raises OutOfBlocks."""
        self.step(StepPlan(grant_rows=self._one_row(req_id), draft_lens=[draft_len],
                           strict_grants=True, lag=lag))
        self.counters.draft_grants += 1

    def extend_capacity_for_tokens(self, req_id: ReqId, padded_draft_len: int) -> None:
        """CUDA-graph padding: grow the pending grant to ``padded_draft_len`` drafts (and slack)."""
        self.step(StepPlan(padding_rows=self._one_row(req_id),
                           padded_draft_lens=[padded_draft_len]))

    def revert_allocate_generation(self, req_id: ReqId) -> None:
        """The forward was skipped: undo exactly what the pending grant added, slack included."""
        self.step(StepPlan(revert_rows=self._one_row(req_id)))

    def update_resources(self, req_id: ReqId, num_accepted: int) -> None:
        """Settle the pending grant: rewind rejected drafts, reclaim slack, commit 1 + accepted."""
        self.step(StepPlan(result_rows=self._one_row(req_id), num_accepted=[num_accepted]))

    def free(self, req_id: ReqId) -> None:
        """All of the request's blocks back to the pool; its row back to -1."""
        self.step(StepPlan(finished_rows=self._one_row(req_id)))

    # ------------------------------------------------------------------ queries

    def row(self, req_id: ReqId) -> int:
        """The request's block-table row index."""
        return self.ids.row(req_id)

    def rows_of(self, req_ids: Iterable[ReqId]) -> np.ndarray:
        """Rows of ``req_ids`` (int64, in order, repeats allowed), to build a batched plan."""
        return self.ids.rows(req_ids)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.ids

    @property
    def request_ids(self) -> list[ReqId]:
        """Ids of the live requests added by id (``add_request``)."""
        return list(self.ids)

    def capacity(self, req_id: ReqId) -> int:
        return int(self.rows.capacity[self.row(req_id)])

    def history(self, req_id: ReqId) -> int:
        return int(self.rows.history[self.row(req_id)])

    def pending_overlap_slack(self, req_id: ReqId) -> int:
        return int(self.rows.slack[self.row(req_id)])

    def pending_draft_len(self, req_id: ReqId) -> int | None:
        """D of the pending generation grant, or None when the request holds none."""
        return self.view(self.row(req_id)).pending_draft_len

    def num_blocks(self, req_id: ReqId) -> int:
        return int(self.rows.num_blocks[self.row(req_id)])

    def block_ids(self, req_id: ReqId) -> np.ndarray:
        return self.view(self.row(req_id)).block_ids

    def _one_row(self, req_id: ReqId) -> np.ndarray:
        return np.array([self.row(req_id)], dtype=np.int64)
