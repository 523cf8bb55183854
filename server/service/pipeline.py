"""`StepPipeline`: one worker's step, from its `StepCall` to its `StepResult`, as arrays.

Order inside one call (all checks come first; from the manager's step on nothing raises):
1. handles -> rows (the registry checks ownership and generation), new ids unique, every decode
   of the previous batch settled (an overlap worker's: of the batch before it, see
   `server.service.inflight`), the step's token demand within ``max_step_tokens``;
2. the manager applies the whole step atomically (`allocator.StepPlan`, at lag 2 for an overlap
   worker) and returns one `allocator.StepOutcome`: what it granted, admitted and changed in the
   block table;
3. the registry frees finished requests and hands out handles for admitted ones;
4. this step's batch is laid out (`server.service.batch.schedule`), its tokens' slots read from the
   manager's table (`KVCacheManager.token_slots`);
5. the previous batch is committed from the worker's staging buffer: exactly its accepted
   tokens, into blocks their requests still own; with prefix caching, the manager learns which
   prompt tokens are now written, and what that (and the step) changed in its cache reaches the
   host tier's copies, the committer's write protection and the KV-event publisher
   (`sync_cache`), all before the worker's step fence is recorded (its next forward reads the
   blocks onboarded for it); the reply is built from the outcome. An overlap worker commits its
   own tokens: for it, 4 reads no slots and 5 writes nothing, and the batch that retires is the
   one whose results this call brought. Every pool keeps this order, a windowed one too: its
   window's release keeps a prompt block until it registers (`allocator.capacity.windows`), so
   a prompt block becomes a hit from the call after the one whose commit wrote it, whatever
   the pool's attention.

A grouped pool (`KVCacheGroups`, ``groups``) runs the same order: 2 steps every group (one
outcome for the request, each group's own table changes), 4 reads each group's slots from its
own table, 5 commits each group's staging at that group's slots (`ShardedCommitter`, grouped).
With prefix caching, 2 admits a new request with one hit every group serves (the reply's
``cached_tokens``), 5 marks the written prompt tokens in every group, and `sync_cache` drains
each group's cache into that group's write protection. The reply's ``free_blocks`` is the
fewest any group has: the group that refuses first.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence

import numpy as np
from kvalloc.allocator import (
    KVCacheEvent,
    KVCacheGroups,
    KVCacheManager,
    PlanArrays,
    Prompt,
    StepOutcome,
    TierCopies,
    checked_plan,
)
from kvalloc.allocator.common.jit import jit, numba
from kvalloc.server.contract import protocol, wire
from kvalloc.server.contract.columns import (
    NO_VALUES,
    Refused,
    Scheduled,
    StepCall,
    StepResult,
    TableChanges,
)
from kvalloc.server.contract.errors import LimitExceeded
from kvalloc.server.service.batch import ForwardRequests, ScheduledBatch, Settlement, schedule
from kvalloc.server.service.commit import NOTHING, ShardedCommitter
from kvalloc.server.service.inflight import Flight, Settled
from kvalloc.server.service.registry import Worker, WorkerRegistry

# The call's lists of handles, in the order `StepPipeline.execute` passes them to the registry.
_HANDLE_LISTS = ("reverts.handles", "results.handles", "finished.handles", "grants.handles",
                 "padding.handles", "prefill.handles")
_KIND = {name: code for code, name in protocol.REFUSED_KINDS.items()}
_OUT_OF_BLOCKS = next(c for c, r in protocol.REFUSAL_REASONS.items() if r == "out_of_blocks")
_NONE_REFUSED = Refused(NO_VALUES, NO_VALUES, NO_VALUES)
_FREE_BLOCKS = operator.attrgetter("free_blocks")


def _split(token_ids: np.ndarray, prompt_lens: np.ndarray) -> list[np.ndarray]:
    """The concatenated prompt token ids, one array per new request (none: no sharing)."""
    if token_ids.size == 0:
        return []
    return np.split(token_ids, np.cumsum(prompt_lens)[:-1])


def _prompts(manager: KVCacheManager | KVCacheGroups, worker: Worker,
             call: StepCall) -> list[Prompt] | list[dict[str, Prompt]]:
    """The new requests' prompts, hashed in the worker's namespace (once per group of a grouped
    pool): its blocks are shared with the workers of that namespace alone."""
    return [manager.prompt(tokens, worker.cache_salt)
            for tokens in _split(call.prompt_token_ids, call.prompt_lens)]


class StepPipeline:
    def __init__(self, manager: KVCacheManager, committer: ShardedCommitter,
                 registry: WorkerRegistry,
                 *, max_step_tokens: int,
                 publish: Callable[[list[KVCacheEvent]], None] | None = None,
                 copy_tier: Callable[[TierCopies, TierCopies], None] | None = None,
                 groups: KVCacheGroups | None = None) -> None:
        """``publish``: where the manager's KV events go after each step; ``copy_tier``: who
        carries out the host tier's copies (onboards, offloads); ``groups``: a grouped pool's
        groups, which every step steps (``manager`` is then its first group's)."""
        self.manager = manager
        self.groups = groups
        # Each block table's manager, in table order: the pool's, or every group's.
        self._managers = tuple(groups.managers.values()) if groups is not None else (manager,)
        self._caching = manager.prefix_caching
        self.publish = publish
        self.copy_tier = copy_tier
        self.committer = committer
        self.registry = registry
        self.max_step_tokens = max_step_tokens
        self._rows = manager.config.max_batch_size
        self._tpb = manager.config.tokens_per_block

    def execute(self, worker: Worker, call: StepCall, epoch: int) -> StepResult:
        registry = self.registry
        revert_rows, result_rows, finished_rows, grant_rows, padding_rows, prefill_rows = (
            registry.rows_of_handles(worker, _HANDLE_LISTS, (
                call.revert_handles, call.result_handles, call.finished_handles,
                call.grant_handles, call.padding_handles, call.prefill_handles)))
        registry.check_new(worker, call.new_req_ids)
        settled = self._settle(worker, result_rows, call.num_accepted, revert_rows,
                               finished_rows)
        drafts = self._drafts(grant_rows, padding_rows, call)
        prompt_tokens = (call.prompt_lens if call.first_chunks.size == 0
                         else np.where(call.first_chunks > 0, call.first_chunks, call.prompt_lens))
        self._check_demand(drafts, call.prefill_tokens, prompt_tokens)

        if worker.fence is not None:
            worker.fence.service_begin()
        # The call's columns were checked when it was built: the plan skips `coerce`.
        outcome, tables = self._step(worker, checked_plan(
            revert_rows=revert_rows, result_rows=result_rows, num_accepted=call.num_accepted,
            finished_rows=finished_rows, grant_rows=grant_rows, draft_lens=call.draft_lens,
            padding_rows=padding_rows, padded_draft_lens=call.padded_draft_lens,
            prefill_rows=prefill_rows, prefill_tokens=call.prefill_tokens,
            prompt_lens=call.prompt_lens, first_chunks=call.first_chunks,
            lag=2 if worker.overlap else 1),
            _prompts(self.groups or self.manager, worker, call) if self._caching else ())
        # ---- applied: nothing below raises on input.
        registry.release(worker, finished_rows)
        admitted = registry.admit(worker, call.new_req_ids, outcome.admitted_rows)
        cached = outcome.cached_tokens
        scheduled, num_decodes = schedule(ForwardRequests(
            grant_handles=call.grant_handles, grant_rows=grant_rows, granted=outcome.granted,
            drafts=drafts, grant_starts=outcome.grant_starts,
            prefill_handles=call.prefill_handles, prefill_rows=prefill_rows,
            prefill_granted=outcome.prefill_granted, prefill_tokens=call.prefill_tokens,
            prefill_starts=outcome.prefill_starts,
            new_handles=admitted, admitted_rows=outcome.admitted_rows,
            prompt_tokens=prompt_tokens, prompt_lens=call.prompt_lens, new_starts=cached))
        committed, slots = self._advance(worker, settled, scheduled, num_decodes, tables,
                                         call.step_id)
        self.sync_cache()  # before the fence: the worker's forward reads onboarded blocks
        if worker.fence is not None:
            worker.fence.service_end()
        return StepResult(
            epoch=epoch, step_id=call.step_id, admitted=admitted, scheduled=scheduled,
            refused=self._refused(outcome, len(scheduled)), committed=committed,
            free_blocks=self.scarcest.free_blocks,
            tables=TableChanges(
                outcome.changed_rows, outcome.changed_from, outcome.changed_num_blocks,
                outcome.changed_block_ids.astype(np.int64)) if worker.own_table else None,
            slot_mapping=slots if worker.own_table else None, cached_tokens=cached)

    def _step(self, worker: Worker, plan: PlanArrays,
              prompts: Sequence[Prompt] | Sequence[dict[str, Prompt]]
              ) -> tuple[StepOutcome, list[np.ndarray]]:
        """Apply ``plan`` (every group's step, for a grouped pool): what it did to the
        requests, and each block table's host copy after it, in table order. The rows of a
        worker that keeps its own table change on the host alone (only a pool of one table
        grants that)."""
        if self.groups is None:
            with (self.manager.table.left_to_worker() if worker.own_table
                  else contextlib.nullcontext()):
                outcome = self.manager.step_arrays(plan, prompts)
            assert outcome is not None  # applied: only a check returns None
        else:
            outcome = self.groups.step_arrays(plan, prompts).outcome
        return outcome, [m.table.host for m in self._managers]

    @property
    def scarcest(self) -> KVCacheManager:
        """The manager whose free blocks the replies report: the pool's, or a grouped pool's
        group with the fewest (the first such), which refuses first."""
        return min(self._managers, key=_FREE_BLOCKS)

    def _token_slots(self, scheduled: Scheduled) -> np.ndarray:
        """``[tables, tokens]``: where each scheduled token lives in each table's pool."""
        runs = (scheduled.rows, scheduled.start_positions, scheduled.num_tokens)
        return np.stack([m.token_slots(*runs) for m in self._managers])

    def _settle(self, worker: Worker, result_rows: np.ndarray, num_accepted: np.ndarray,
                revert_rows: np.ndarray, finished_rows: np.ndarray) -> Settlement | Settled | None:
        """What the call settles of the worker's steps in flight, before anything changes: the
        previous batch's `Settlement` (None before the first step), or for an overlap worker
        both of its batches as the call leaves them. Raises `StepNotSettled`."""
        if worker.overlap:
            return worker.flights.settle(result_rows, revert_rows, finished_rows,
                                         num_rows=self._rows)
        previous = worker.batch
        return None if previous is None else previous.settle(
            result_rows, num_accepted, revert_rows, finished_rows, num_rows=self._rows,
            step_id=worker.last_step_id)

    def _advance(self, worker: Worker, settled: Settlement | Settled | None,
                 scheduled: Scheduled, num_decodes: int, tables: list[np.ndarray],
                 step_id: int) -> tuple[wire.CommitSummary, np.ndarray]:
        """Keep the batch this call laid out and retire the one it settled; returns what the
        service committed and the new batch's slots (the first table's: a grouped pool's
        workers attach, and read their slots from each group's table). An overlap worker
        writes its own tokens and computes its own slots (the service knows only the host's
        start of a grant behind an unsettled step): neither is done here, and its slots are
        none (empty on every transport alike)."""
        if worker.overlap:
            assert isinstance(settled, Settled)
            retired = worker.flights.advance(settled, Flight.of(scheduled, num_decodes, step_id))
            if retired is not None:
                self._mark_written(retired.scheduled, retired.dropped)
            return NOTHING, NO_VALUES
        # Read before the commit, while the table rows the step just wrote are in the cache
        # (the commit streams the staged K/V through it); the commit changes no table cell.
        slots = self._token_slots(scheduled)
        previous, worker.batch = worker.batch, ScheduledBatch(scheduled, num_decodes, slots,
                                                              self._tpb)
        if previous is None:
            return NOTHING, slots[0]
        assert isinstance(settled, Settlement)
        return self._write_previous(worker, previous, settled, tables), slots[0]

    def sync_cache(self) -> None:
        """What each table's prefix cache (the pool's, or every group's) changed since the last
        call: the host tier's copies made, protection flips to that table's committers (blocks
        evicted since the last commit may be written by the next one, blocks just registered
        must not be), KV events to ``publish`` (a grouped pool has neither tier nor events)."""
        if not self._caching:
            return
        for table, manager in enumerate(self._managers):
            changes = manager.drain_cache_changes()
            if self.copy_tier is not None:
                self.copy_tier(changes.onboards, changes.offloads)
            self.committer.protect(changes.blocks, changes.protected, table)
            if self.publish is not None:
                self.publish(changes.events)

    def _drafts(self, grant_rows: np.ndarray, padding_rows: np.ndarray,
                call: StepCall) -> np.ndarray:
        """Drafts each grant runs with: its draft_len, or its padded_draft_len when padded (the
        manager refuses padding below the grant, so the padded value is the larger)."""
        if call.padding_handles.size == 0:
            return call.draft_lens
        by_row = np.zeros(self._rows, dtype=np.int64)
        by_row[grant_rows] = call.draft_lens
        by_row[padding_rows] = np.maximum(by_row[padding_rows], call.padded_draft_lens)
        return by_row[grant_rows]

    def _check_demand(self, drafts: np.ndarray, prefill: np.ndarray, prompts: np.ndarray) -> None:
        demand = token_demand(drafts, prefill, prompts)
        if sum(demand) <= self.max_step_tokens:  # the common step: no list is named
            return
        total = 0
        for name, tokens in zip(_DEMAND, demand, strict=True):
            total += tokens
            if total > self.max_step_tokens:
                raise LimitExceeded(f"{name}: the step would schedule {sum(demand)} tokens, "
                                    f"more than max_step_tokens={self.max_step_tokens}",
                                    field=name)

    def _write_previous(self, worker: Worker, batch: ScheduledBatch, settlement: Settlement,
                        tables: list[np.ndarray]) -> wire.CommitSummary:
        dropped = settlement.dropped
        slots = [batch.owned_slots(dropped, table, index) for index, table in enumerate(tables)]
        summary = self.committer.write_batch(worker.stagings, worker.writers, batch,
                                             settlement.accepted, dropped, slots)
        self._mark_written(batch.scheduled, dropped)
        return summary

    def _mark_written(self, scheduled: Scheduled, dropped: np.ndarray) -> None:
        """A retired batch's prompt blocks become shareable, and protected, now that their K/V
        is in the pool, every group's (``dropped`` requests, per entry, are skipped)."""
        if self._caching:
            kept = ~dropped
            (self.groups or self.manager).mark_written(
                scheduled.rows[kept], (scheduled.start_positions + scheduled.num_tokens)[kept])

    def _refused(self, outcome: StepOutcome, scheduled: int) -> Refused:
        """The entries the step did not schedule, out of ``scheduled`` that it did."""
        if scheduled == (outcome.granted.size + outcome.prefill_granted.size
                         + outcome.admitted_rows.size):
            return _NONE_REFUSED  # the common step: no array to build
        grants = np.flatnonzero(~outcome.granted)
        chunks = np.flatnonzero(~outcome.prefill_granted)
        new = np.flatnonzero(outcome.admitted_rows < 0)
        kinds = np.repeat([_KIND["grant"], _KIND["prefill"], _KIND["new"]],
                          [grants.size, chunks.size, new.size])
        reasons = np.concatenate([np.full(grants.size + chunks.size, _OUT_OF_BLOCKS),
                                  outcome.new_refusals[new].astype(np.int64)])
        return Refused(kinds.astype(np.int64), np.concatenate([grants, chunks, new]), reasons)


_DEMAND = ("grants", "prefill", "new")  # `token_demand`'s order


def token_demand_reference(drafts: np.ndarray, prefill_tokens: np.ndarray,
                           prompt_tokens: np.ndarray) -> tuple[int, int, int]:
    """Tokens the step schedules for its grants (each runs its drafts and one more), prefill
    chunks and new requests, in `_DEMAND`'s order."""
    return (int(drafts.sum()) + drafts.size, int(prefill_tokens.sum()),
            int(prompt_tokens.sum()))


def _token_demand_loop(drafts, prefill_tokens,  # type: ignore[no-untyped-def]
                       prompt_tokens):  # pragma: no cover
    # Compiled by numba; the reference above states what it computes.
    return drafts.sum() + drafts.size, prefill_tokens.sum(), prompt_tokens.sum()


# Three numpy reductions cost ten times one compiled call.
token_demand = jit(_token_demand_loop) if numba is not None else token_demand_reference
