"""`KVCacheManager`: per-request capacity, history and overlap slack, and the blocks behind them.

This is where capacity is granted: every grant site (``try_allocate_generation``,
``prepare_draft_resources``, ``extend_capacity_for_tokens``, prefill) and every settlement
(``update_resources``, ``revert_allocate_generation``, ``free``) is one `StepPlan` applied by
``_apply``, the same code path the batched ``step`` takes.

Invariants (``check_invariants`` verifies all of them):
- history <= capacity, and num_blocks == ceil(capacity / tokens_per_block) <= max_blocks_per_seq;
- a request holds at most one generation grant at a time; while it does, that grant added
  exactly ``1 + draft + slack`` (slack per `accounting.slack_for`), which is what a revert
  takes back;
- blocks are conserved (free + owned == total) and no block sits in two rows;
- block-table rows hold the request's blocks and -1 beyond; the device copy equals the host.

Every public call validates its whole input before it changes anything: an error leaves the
manager exactly as it was.

Prefill tokens carry no speculation, so a prefill chunk counts as history as soon as it is
scheduled (capacity == history for it). A request takes generation grants once its whole
prompt is scheduled.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .accounting import blocks_for, grant_tokens, settle, slack_for
from .block_pool import BlockPool
from .block_table import BlockTable
from .config import PoolConfig, SlackPolicy
from .errors import (
    AcceptedExceedsDrafts,
    BatchFull,
    BlockTableOverflow,
    DraftLenExceeded,
    DuplicateRequest,
    GrantPending,
    InvalidValue,
    InvariantViolation,
    NoPendingGrant,
    OutOfBlocks,
    PrefillIncomplete,
    UnknownRequest,
)
from .kv_storage import KVStorage

ReqId = Hashable
_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass
class StepPlan:
    """One scheduler step, applied atomically in this order:

    1. ``reverts``: forwards that were skipped; their grants are undone exactly.
    2. ``results``: the previous step's accepted draft counts (``update_resources``).
    3. ``finished``: requests whose blocks go back to the pool.
    4. ``padding`` / ``grants``: CUDA-graph padding of grants made in earlier calls (served first,
       never refused: OutOfBlocks fails the step), then this step's generation grants with their
       draft lengths and padding, served in order; one that does not fit is refused
       (``granted`` False) and changes nothing.
    5. ``prefill``: further chunks of prompts being prefilled.
    6. ``new``: new requests with their prompt length and first chunk (None: the whole prompt).

    Running requests come before prefill and new requests when blocks are short, so a step never
    starves a request it already admitted.
    """

    reverts: Sequence[ReqId] = ()
    result_ids: Sequence[ReqId] = ()
    num_accepted: Sequence[int] = ()
    finished: Sequence[ReqId] = ()
    grant_ids: Sequence[ReqId] = ()
    draft_lens: Sequence[int] = ()
    padding_ids: Sequence[ReqId] = ()
    padded_draft_lens: Sequence[int] = ()
    prefill_ids: Sequence[ReqId] = ()
    prefill_tokens: Sequence[int] = ()
    new_ids: Sequence[ReqId] = ()
    prompt_lens: Sequence[int] = ()
    first_chunks: Sequence[int | None] = ()
    # Grants that must not be refused: a refusal raises OutOfBlocks and the step changes nothing.
    strict_grants: bool = False


@dataclass
class StepOutcome:
    granted: np.ndarray
    prefill_granted: np.ndarray
    admitted: np.ndarray
    rows: dict[ReqId, int] = field(default_factory=dict)


@dataclass
class ManagerCounters:
    """Cumulative event counts; the metrics layer exports them."""

    grants: int = 0
    draft_grants: int = 0
    grants_refused: int = 0
    reverts: int = 0
    updates: int = 0
    rewound_tokens: int = 0
    reclaimed_slack_tokens: int = 0
    padding_topups: int = 0
    requests_added: int = 0
    requests_refused: int = 0
    requests_freed: int = 0
    row_overflows: int = 0


class KVCacheManager:
    def __init__(self, config: PoolConfig, *, allocate_storage: bool = True) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.policy = SlackPolicy(config.slack_policy)
        self.tokens_per_block = config.tokens_per_block
        self.max_blocks_per_seq = config.max_blocks_per_seq
        self.pool = BlockPool(config.total_blocks)
        self.table = BlockTable(config.max_batch_size, self.max_blocks_per_seq, self.device)
        self.storage = KVStorage(config) if allocate_storage else None
        self.counters = ManagerCounters()
        n = config.max_batch_size
        self._rows: dict[ReqId, int] = {}
        self._ids: list[ReqId | None] = [None] * n
        self._cap = np.zeros(n, dtype=np.int64)
        self._hist = np.zeros(n, dtype=np.int64)
        self._prompt = np.zeros(n, dtype=np.int64)
        self._slack = np.zeros(n, dtype=np.int64)
        self._draft = np.zeros(n, dtype=np.int64)
        self._pending = np.zeros(n, dtype=bool)
        self._nblocks = np.zeros(n, dtype=np.int64)
        # Accepted drafts of the last settled step: the device's lead over history under overlap.
        self._lead = np.zeros(n, dtype=np.int64)

    # ------------------------------------------------------------------ per-request API

    def add_request(self, req_id: ReqId, prompt_len: int, first_chunk: int | None = None) -> None:
        """Admit a request and reserve its prompt (or its first prefill chunk).

        Raises OutOfBlocks / BatchFull when it cannot be admitted; nothing changes then.
        """
        out = self._apply(StepPlan(new_ids=[req_id], prompt_lens=[prompt_len],
                                   first_chunks=[first_chunk]))
        if not out.admitted[0]:
            if self.table.num_free_rows == 0:
                raise BatchFull(f"req_id: all {self.config.max_batch_size} rows are in use")
            raise OutOfBlocks(f"num_blocks: no room for request {req_id!r}'s prompt")

    def extend_prefill(self, req_id: ReqId, num_tokens: int) -> None:
        """Reserve the next chunk of a chunked prefill. Raises OutOfBlocks if it does not fit."""
        out = self._apply(StepPlan(prefill_ids=[req_id], prefill_tokens=[num_tokens]))
        if not out.prefill_granted[0]:
            raise OutOfBlocks(f"num_blocks: no room for request {req_id!r}'s prefill chunk")

    def try_allocate_generation(self, req_id: ReqId, draft_len: int) -> bool:
        """Grant 1 + D (+ D slack under overlap); False, changing nothing, when out of blocks."""
        out = self._apply(StepPlan(grant_ids=[req_id], draft_lens=[draft_len]))
        return bool(out.granted[0])

    def prepare_draft_resources(self, req_id: ReqId, draft_len: int) -> None:
        """The draft model's grant site: the same rule and bookkeeping; raises OutOfBlocks."""
        self._apply(StepPlan(grant_ids=[req_id], draft_lens=[draft_len], strict_grants=True))
        self.counters.draft_grants += 1

    def extend_capacity_for_tokens(self, req_id: ReqId, padded_draft_len: int) -> None:
        """CUDA-graph padding: grow the pending grant to ``padded_draft_len`` drafts (and slack)."""
        self._apply(StepPlan(padding_ids=[req_id], padded_draft_lens=[padded_draft_len]))

    def revert_allocate_generation(self, req_id: ReqId) -> None:
        """The forward was skipped: undo exactly what the pending grant added, slack included."""
        self._apply(StepPlan(reverts=[req_id]))

    def update_resources(self, req_id: ReqId, num_accepted: int) -> None:
        """Settle the pending grant: rewind rejected drafts, reclaim slack, commit 1 + accepted."""
        self._apply(StepPlan(result_ids=[req_id], num_accepted=[num_accepted]))

    def free(self, req_id: ReqId) -> None:
        """All of the request's blocks back to the pool; its row back to -1."""
        self._apply(StepPlan(finished=[req_id]))

    def step(self, plan: StepPlan) -> StepOutcome:
        """Apply a whole scheduler step in one call (see `StepPlan` for the order)."""
        return self._apply(plan)

    # ------------------------------------------------------------------ queries

    def _row(self, req_id: ReqId) -> int:
        try:
            return self._rows[req_id]
        except (KeyError, TypeError):
            raise UnknownRequest(f"req_id: unknown request {req_id!r}") from None

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._rows

    def capacity(self, req_id: ReqId) -> int:
        return int(self._cap[self._row(req_id)])

    def history(self, req_id: ReqId) -> int:
        return int(self._hist[self._row(req_id)])

    def pending_overlap_slack(self, req_id: ReqId) -> int:
        return int(self._slack[self._row(req_id)])

    def pending_draft_len(self, req_id: ReqId) -> int | None:
        """D of the pending generation grant, or None when the request holds none."""
        row = self._row(req_id)
        return int(self._draft[row]) if self._pending[row] else None

    def num_blocks(self, req_id: ReqId) -> int:
        return int(self._nblocks[self._row(req_id)])

    def row(self, req_id: ReqId) -> int:
        """The request's block-table row index."""
        return self._row(req_id)

    def histories(self, req_ids: Sequence[ReqId]) -> np.ndarray:
        """``history`` of each of ``req_ids`` (int64, in order; repeats allowed): one call per
        batch instead of one per request on a scheduler's hot path."""
        return self._hist[self._rows_for(req_ids, "req_id")]

    def row_block_counts(self, rows: np.ndarray) -> np.ndarray:
        """``num_blocks`` of block-table ``rows`` (a copy). Blocks only ever change at a row's
        tail, so two counts taken around a step say exactly which cells it rewrote."""
        return self._nblocks[rows]

    def _rows_for(self, ids: Sequence[ReqId], what: str) -> np.ndarray:
        if not ids:
            return _NO_ROWS
        rows_of = self._rows
        try:
            return np.fromiter(map(rows_of.__getitem__, ids), dtype=np.int64, count=len(ids))
        except (KeyError, TypeError):
            bad = next(i for i in ids if not _known(rows_of, i))
            raise UnknownRequest(f"{what}: unknown request {bad!r}", field=what) from None

    def block_ids(self, req_id: ReqId) -> np.ndarray:
        row = self._row(req_id)
        return self.table.host[row, : self._nblocks[row]].copy()

    @property
    def free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_requests(self) -> int:
        return len(self._rows)

    @property
    def request_ids(self) -> list[ReqId]:
        return list(self._rows)

    def totals(self) -> dict[str, int]:
        """Sums and maxima over live requests (for metrics and the pool endpoint)."""
        live = np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows))
        cap, hist, slack = self._cap[live], self._hist[live], self._slack[live]
        return {
            "capacity_tokens": int(cap.sum()),
            "history_tokens": int(hist.sum()),
            "pending_slack_tokens": int(slack.sum()),
            "max_pending_slack_tokens": int(slack.max(initial=0)),
            "max_uncommitted_tokens": int((cap - hist).max(initial=0)),
        }

    # ------------------------------------------------------------------ the one mutation path

    def _lookup(self, ids: Sequence[ReqId], what: str) -> np.ndarray:
        """Rows of a StepPlan list: known requests, each listed once."""
        arr = self._rows_for(ids, what)
        if arr.size > 1 and np.bincount(arr).max() > 1:
            raise DuplicateRequest(f"{what}: a request is listed twice", field=what)
        return arr

    def _check_new(self, new_ids: list[ReqId], prompt: np.ndarray, first: np.ndarray) -> None:
        if (prompt > self.config.max_seq_len).any():
            raise InvalidValue(f"prompt_len: above max_seq_len={self.config.max_seq_len}",
                               field="prompt_len")
        if (first > prompt).any():
            raise InvalidValue("first_chunk: larger than the prompt", field="first_chunk")
        try:
            distinct = len(set(new_ids))
        except TypeError:
            raise InvalidValue("new: request ids must be hashable", field="new") from None
        if distinct != len(new_ids):
            raise DuplicateRequest("new: a request is listed twice", field="new")
        known = [i for i in new_ids if _known(self._rows, i)]  # (None is a valid id too)
        if known:
            raise DuplicateRequest(f"new: request {known[0]!r} already exists", field="new")

    def _counts(self, values: Sequence[int | None], n: int, what: str,
                minimum: int = 0) -> np.ndarray:
        if len(values) != n:
            raise InvalidValue(f"{what}: {len(values)} values for {n} requests", field=what)
        if n == 0:
            return _NO_ROWS
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError, OverflowError):
            raise InvalidValue(f"{what}: expected integers", field=what) from None
        if arr.dtype.kind not in "iu":
            # Floats, bools and strings would be truncated or coerced silently by an int cast.
            if arr.size:
                raise InvalidValue(f"{what}: expected integers", field=what)
            arr = np.zeros(0, dtype=np.int64)
        elif arr.dtype != np.int64:
            arr = arr.astype(np.int64)
        if arr.size and arr.min() < minimum:
            raise InvalidValue(f"{what}: {int(arr.min())} is below {minimum}", field=what)
        return arr

    def _apply(self, plan: StepPlan) -> StepOutcome:
        cfg = self.config
        tpb = self.tokens_per_block
        policy = self.policy
        overlap = cfg.overlap_scheduler

        rev = self._lookup(plan.reverts, "reverts")
        res = self._lookup(plan.result_ids, "results")
        acc = self._counts(plan.num_accepted, res.size, "num_accepted")
        fin = self._lookup(plan.finished, "finished")
        gr = self._lookup(plan.grant_ids, "grants")
        dlen = self._counts(plan.draft_lens, gr.size, "draft_len")
        pad = self._lookup(plan.padding_ids, "padding")
        plen = self._counts(plan.padded_draft_lens, pad.size, "padded_draft_len")
        pf = self._lookup(plan.prefill_ids, "prefill")
        pft = self._counts(plan.prefill_tokens, pf.size, "prefill_tokens", minimum=1)
        new_ids = list(plan.new_ids)
        prompt = self._counts(plan.prompt_lens, len(new_ids), "prompt_len", minimum=1)
        if len(plan.first_chunks) not in (0, len(new_ids)):
            raise InvalidValue("first_chunk: one value per new request", field="first_chunk")
        chunks = [None] * len(new_ids) if not plan.first_chunks else list(plan.first_chunks)
        first = self._counts([p if c is None else c for p, c in zip(prompt, chunks, strict=True)],
                             len(new_ids), "first_chunk", minimum=1)

        if dlen.size and dlen.max() > cfg.max_draft_len:
            raise DraftLenExceeded(f"draft_len: above max_draft_len={cfg.max_draft_len}")
        if plen.size and plen.max() > cfg.max_draft_len:
            raise DraftLenExceeded(
                f"padded_draft_len: above max_draft_len={cfg.max_draft_len}",
                field="padded_draft_len",
            )
        if new_ids:
            self._check_new(new_ids, prompt, first)
        _disjoint(rev, res, "results", "already reverted in this step")
        if fin.size:
            _disjoint(fin, np.concatenate([gr, pad, pf]), "finished", "also granted in this step")
        _disjoint(gr, pf, "prefill", "also granted in this step")
        _disjoint(pad, pf, "prefill", "also padded in this step")

        cap = self._cap.copy()
        hist = self._hist.copy()
        slack = self._slack.copy()
        draft = self._draft.copy()
        pending = self._pending.copy()
        lead = self._lead

        # 1. reverts
        if rev.size:
            if not pending[rev].all():
                raise NoPendingGrant("reverts: a request holds no generation grant",
                                     field="reverts")
            cap[rev] -= 1 + draft[rev] + slack[rev]
            pending[rev] = False
            slack[rev] = draft[rev] = 0

        # 2. results
        if res.size:
            if not pending[res].all():
                raise NoPendingGrant("results: a request holds no generation grant",
                                     field="results")
            if (acc > draft[res]).any():
                i = int(np.argmax(acc > draft[res]))
                raise AcceptedExceedsDrafts(
                    f"num_accepted: {int(acc[i])} accepted for {int(draft[res][i])} drafts "
                    f"(request {plan.result_ids[i]!r})"
                )
            cap[res], hist[res] = settle(cap[res], hist[res], draft[res], slack[res], acc, policy)
            pending[res] = False
            lead = self._lead.copy()
            lead[res] = acc
            slack[res] = draft[res] = 0

        # 3. finished: their blocks count as available for this step's grants.
        base_cap = cap.copy()
        base_cap[fin] = 0

        # 4. grants and padding
        if gr.size:
            if pending[gr].any():
                i = int(np.argmax(pending[gr]))
                raise GrantPending(f"grants: request {plan.grant_ids[i]!r} already holds a grant",
                                   field="grants")
            if (hist[gr] < self._prompt[gr]).any():
                raise PrefillIncomplete("grants: a request's prompt is not fully scheduled",
                                        field="grants")
        is_new_grant = np.zeros(cfg.max_batch_size, dtype=bool)
        is_new_grant[gr] = True
        want_draft = draft.copy()
        want_draft[gr] = dlen
        if pad.size:
            if not (pending[pad] | is_new_grant[pad]).all():
                raise NoPendingGrant("padding: a request holds no generation grant",
                                     field="padding")
            if (plen < want_draft[pad]).any():
                raise InvalidValue("padded_draft_len: below the granted draft_len",
                                   field="padded_draft_len")
            want_draft[pad] = plen
        # Padding of grants made in earlier calls cannot be refused (the forward is already
        # planned), so it is served before this step's new grants.
        topups = pad[~is_new_grant[pad]] if pad.size else pad
        item_rows = np.concatenate([topups, gr]) if topups.size else gr
        item_cap = cap.copy()
        if item_rows.size:
            new_slack = slack_for(want_draft[item_rows], overlap, policy, lead[item_rows])
            add = np.where(
                is_new_grant[item_rows],
                grant_tokens(want_draft[item_rows], overlap, policy, lead[item_rows]),
                (want_draft[item_rows] - draft[item_rows]) + (new_slack - slack[item_rows]),
            )
            item_cap[item_rows] = cap[item_rows] + add

        # 5. prefill chunks
        if pf.size and (hist[pf] + pft > self._prompt[pf]).any():
            raise InvalidValue("prefill_tokens: past the end of the prompt", field="prefill_tokens")
        item_cap[pf] = cap[pf] + pft

        grow_rows = np.concatenate([item_rows, pf])
        grow_blocks = blocks_for(item_cap[grow_rows], tpb)
        over = grow_blocks > self.max_blocks_per_seq
        first_blocks = blocks_for(first, tpb)
        new_over = first_blocks > self.max_blocks_per_seq
        if over.any() or new_over.any():
            self.counters.row_overflows += 1
            who = self._ids[int(grow_rows[np.argmax(over)])] if over.any() else new_ids[
                int(np.argmax(new_over))]
            raise BlockTableOverflow(
                f"capacity: request {who!r} would need more than max_blocks_per_seq="
                f"{self.max_blocks_per_seq} blocks", req_id=who,
            )

        # Blocks: what the settled state frees, then each item's demand served in order.
        base_blocks = blocks_for(base_cap, tpb)
        available = self.pool.num_free + int((self._nblocks - base_blocks).sum())
        demands = np.concatenate([
            grow_blocks - base_blocks[grow_rows],
            first_blocks,
        ])
        ok = _serve_in_order(demands, available)
        n_items = item_rows.size
        item_ok, pf_ok_mask, new_ok = (ok[:n_items], ok[n_items : n_items + pf.size],
                                       ok[n_items + pf.size :])
        rows_needed = int(new_ok.sum())
        free_rows_after = self.table.num_free_rows + fin.size
        if rows_needed > free_rows_after:
            # Rows are the other resource: admit in order while rows last.
            keep = np.cumsum(new_ok) <= free_rows_after
            new_ok = new_ok & keep
        # Padding of an earlier grant, and strict grants, are not allowed to be refused.
        must = ~is_new_grant[item_rows] | plan.strict_grants
        if (must & ~item_ok).any():
            who = [self._ids[int(r)] for r in item_rows[must & ~item_ok]]
            raise OutOfBlocks(f"num_blocks: {available} blocks available, not enough for {who!r}")

        # ---- validated: from here on nothing raises; commit the new state.
        ok_rows = item_rows[item_ok]
        fresh_ok = ok_rows[is_new_grant[ok_rows]]
        cap[ok_rows] = item_cap[ok_rows]
        slack[ok_rows] = slack_for(want_draft[ok_rows], overlap, policy, lead[ok_rows])
        draft[ok_rows] = want_draft[ok_rows]
        pending[ok_rows] = True
        pf_ok = pf[pf_ok_mask]
        cap[pf_ok] += pft[pf_ok_mask]
        hist[pf_ok] += pft[pf_ok_mask]

        c = self.counters
        c.reverts += rev.size
        c.updates += res.size
        if res.size:
            c.rewound_tokens += int((self._draft[res] - acc).sum())
            if policy is SlackPolicy.RECLAIM:
                c.reclaimed_slack_tokens += int(self._slack[res].sum())
        c.grants += int(fresh_ok.size)
        c.grants_refused += int(gr.size - fresh_ok.size)
        c.padding_topups += int(pad.size)

        self._cap, self._hist, self._slack = cap, hist, slack
        self._draft, self._pending = draft, pending
        self._lead = lead
        self._move_blocks(fin)
        rows = self._admit(new_ids, prompt, first, new_ok) if new_ids else {}
        self.table.sync()
        return StepOutcome(granted=item_ok[topups.size :], prefill_granted=pf_ok_mask,
                           admitted=new_ok, rows=rows)

    def _move_blocks(self, finished_rows: np.ndarray) -> None:
        """Make every row's blocks match ceil(capacity / tokens_per_block); free finished rows."""
        tpb = self.tokens_per_block
        target = blocks_for(self._cap, tpb)
        target[finished_rows] = 0
        delta = target - self._nblocks
        shrink = np.flatnonzero(delta < 0)
        if shrink.size:
            removed = self.table.truncate(shrink, target[shrink], -delta[shrink])
            self.pool.release_unique(removed)
        grow = np.flatnonzero(delta > 0)
        if grow.size:
            ids = self.pool.allocate(int(delta[grow].sum()))
            self.table.append(grow, self._nblocks[grow], delta[grow], ids)
        self._nblocks = target
        for row in finished_rows.tolist():
            req = self._ids[row]
            del self._rows[req]
            self._ids[row] = None
            self._reset_row(row)
            self.table.release_row(row)
        self.counters.requests_freed += finished_rows.size

    def _reset_row(self, row: int) -> None:
        for arr in (self._cap, self._hist, self._prompt, self._slack, self._draft, self._lead,
                    self._nblocks):
            arr[row] = 0
        self._pending[row] = False

    def _admit(self, new_ids: list[ReqId], prompt: np.ndarray, first: np.ndarray,
               ok: np.ndarray) -> dict[ReqId, int]:
        rows: dict[ReqId, int] = {}
        for i in np.flatnonzero(ok).tolist():
            req = new_ids[i]
            row = self.table.acquire_row()
            n = int(blocks_for(first[i], self.tokens_per_block))
            ids = self.pool.allocate(n)
            self.table.append(np.array([row]), np.array([0]), np.array([n]), ids)
            self._rows[req] = row
            self._ids[row] = req
            self._cap[row] = self._hist[row] = first[i]
            self._prompt[row] = prompt[i]
            self._nblocks[row] = n
            rows[req] = row
        self.counters.requests_added += len(rows)
        self.counters.requests_refused += len(new_ids) - len(rows)
        return rows

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise InvariantViolation if any documented invariant does not hold."""
        self.pool.check_invariants()
        live = np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows))
        if (self._hist[live] > self._cap[live]).any():
            raise InvariantViolation("history > capacity")
        expected = blocks_for(self._cap[live], self.tokens_per_block)
        if not np.array_equal(expected, self._nblocks[live]):
            raise InvariantViolation("num_blocks != ceil(capacity / tokens_per_block)")
        if (self._nblocks[live] > self.max_blocks_per_seq).any():
            raise InvariantViolation("a row holds more than max_blocks_per_seq blocks")
        pend = live[self._pending[live]]
        want = slack_for(self._draft[pend], self.config.overlap_scheduler, self.policy,
                         self._lead[pend])
        if not np.array_equal(self._slack[pend], want):
            raise InvariantViolation("a pending grant's slack is not what its grant site adds")
        idle = live[~self._pending[live]]
        if (self._slack[idle] != 0).any() or (self._draft[idle] != 0).any():
            raise InvariantViolation("slack or drafts recorded without a pending grant")
        self.table.check_invariants(live, self._nblocks[live], self.pool.num_blocks, synced=True)
        held = self.table.host[live]
        held = held[held >= 0]
        if np.unique(held).size != held.size:
            raise InvariantViolation("a block is owned by two rows")
        refs = np.zeros(self.pool.num_blocks, dtype=np.int64)
        np.add.at(refs, held, 1)
        if not np.array_equal(refs, self.pool.refcount(np.arange(self.pool.num_blocks))):
            raise InvariantViolation("block-table ownership disagrees with reference counts")
        if len(self._rows) + self.table.num_free_rows != self.config.max_batch_size:
            raise InvariantViolation("block-table rows not conserved")


def _known(rows_of: dict[ReqId, int], req_id: object) -> bool:
    try:
        return req_id in rows_of
    except TypeError:
        return False


def _disjoint(a: np.ndarray, b: np.ndarray, what: str, why: str) -> None:
    if a.size and b.size and np.intersect1d(a, b).size:
        raise InvalidValue(f"{what}: a request is {why}", field=what)


def _serve_in_order(demands: np.ndarray, available: int) -> np.ndarray:
    """Which demands are met when served in order, each one only if it still fits."""
    if int(demands.sum()) <= available:
        return np.ones(demands.size, dtype=bool)
    ok = np.zeros(demands.size, dtype=bool)
    left = available
    for i, need in enumerate(demands.tolist()):
        if need <= left:
            ok[i] = True
            left -= need
    return ok
