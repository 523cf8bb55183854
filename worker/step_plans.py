"""What the loop asks the service each step: `StepPlanner.plan` settles what the host has read,
then fills the step's ``max_step_tokens`` with decodes (their drafts proposed on the host when
the drafter is a host one), prefill chunks and new prompts, in that order, as a chunked-prefill
scheduler that never starves running requests does; `StepPlan` is the result: the requests of
each kind and the client's ``step()`` keywords built from them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvalloc.server.contract import wire
from kvalloc.worker.drafters import Drafter
from kvalloc.worker.requests import Request, handles, int64s


@dataclass
class StepPlan:
    """One step's call and the requests it names, by kind."""

    call: dict[str, Any] = field(default_factory=dict)  # the client's step() keywords
    finished: list[Request] = field(default_factory=list)
    granted: list[Request] = field(default_factory=list)
    padded: list[Request] = field(default_factory=list)  # granted, padded to draft_len drafts
    prefilling: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class StepPlanner:
    """The rules a step's call is planned by: the pool's ``layout`` (its step and batch sizes),
    ``draft_len``, the ``host_drafter`` (None where drafts come from the device, or none are
    made), ``pad_decodes`` (a decode-only step's decodes padded to ``draft_len`` drafts) and
    ``share_prefixes`` (prompts' token ids sent for the service's prefix cache)."""

    layout: wire.PoolLayout
    draft_len: int
    host_drafter: Drafter | None
    pad_decodes: bool
    share_prefixes: bool

    def plan(self, waiting: deque[Request], live: dict[int, Request],
             results: list[tuple[Request, int]]) -> StepPlan:
        """The step's call: settle what the host has read, then fill ``max_step_tokens`` with
        decodes, prefill chunks and new prompts, in that order."""
        plan = StepPlan()
        decoding, prefilling = self._by_kind(plan, live)
        results = [(r, a) for r, a in results if not (r.done or r.preempted or r.handle < 0)]
        budget = self._grant(plan, decoding, self.layout.max_step_tokens)
        for r in prefilling:
            if budget < 1:
                break
            r.chunk = min(r.admitted.size - r.scheduled, budget)
            budget -= r.chunk
            plan.prefilling.append(r)
        rows_free = self.layout.max_batch_size - (len(live) - len(plan.finished))
        while waiting and budget > 0 and len(plan.new) < rows_free:
            r = waiting.popleft()
            r.admitted, r.scheduled = r.tokens, 0
            r.chunk = min(r.admitted.size, budget)
            budget -= r.chunk
            plan.new.append(r)
        if self.pad_decodes and not (plan.prefilling or plan.new):
            self._pad(plan)
        self._columns(plan, results)
        return plan

    @staticmethod
    def _by_kind(plan: StepPlan, live: dict[int, Request]) -> tuple[list[Request], list[Request]]:
        """One pass over ``live``: the requests that end (into ``plan.finished``), then those
        decoding and those with prompt tokens left, each in ``live``'s order; no request is a
        decode of the step until it is granted."""
        decoding, prefilling = [], []
        for r in live.values():
            r.drafts, r.num_drafts = None, -1
            if r.done or r.preempted:
                plan.finished.append(r)
            elif r.decoding:
                decoding.append(r)
            else:
                prefilling.append(r)
        return decoding, prefilling

    def _grant(self, plan: StepPlan, decoding: list[Request], budget: int) -> int:
        """Grant each of ``decoding`` its pending token and drafts within ``budget``; returns
        the budget left."""
        granted, draft_len, drafter = plan.granted, self.draft_len, self.host_drafter
        for r in decoding:
            if budget < 1:
                break
            # An unread step emits at least one token: the request may end in it.
            ahead = r.remaining - r.unread
            if ahead < 1:
                continue
            num = min(draft_len, ahead - 1, budget - 1)  # >= 0: ahead and budget are >= 1
            if num > 0 and drafter is not None:
                proposed = drafter.propose(r.req_id, r.tokens, len(r.output), num)
                r.drafts = np.asarray(proposed, dtype=np.int64)[:num]
                num = r.drafts.size
            r.num_drafts = r.padded_drafts = num
            budget -= 1 + num
            granted.append(r)
        return budget

    def _pad(self, plan: StepPlan) -> None:
        """A decode-only step with every decode at ``draft_len`` drafts, the shape a graph
        replays: decodes with fewer are padded through the padding grant, when the step fits."""
        width = 1 + self.draft_len
        if len(plan.granted) * width > self.layout.max_step_tokens:
            return
        plan.padded = [r for r in plan.granted if r.num_drafts < self.draft_len]
        for r in plan.padded:
            r.padded_drafts = self.draft_len

    def _columns(self, plan: StepPlan, results: list[tuple[Request, int]]) -> None:
        call = plan.call
        if results:
            call["results"] = (handles([r for r, _ in results]), int64s(a for _, a in results))
        if plan.finished:
            call["finished"] = handles(plan.finished)
        if plan.granted:
            call["grants"] = (handles(plan.granted), int64s(r.num_drafts for r in plan.granted))
        if plan.padded:
            call["padding"] = (handles(plan.padded),
                               np.full(len(plan.padded), self.draft_len, dtype=np.int64))
        if plan.prefilling:
            call["prefill"] = (handles(plan.prefilling),
                               int64s(r.chunk for r in plan.prefilling))
        if plan.new:
            call["new"] = ([r.req_id for r in plan.new], int64s(r.admitted.size for r in plan.new),
                           int64s(r.chunk for r in plan.new))
            if self.share_prefixes:
                call["prompt_token_ids"] = np.concatenate([r.admitted for r in plan.new])
