"""`Lag2Worker`: an overlap worker (registered with ``overlap=True``) over any `Client`, with a
model device and its own account of every request's capacity.

The device runs each granted forward right after the call that granted it and accepts a random
number of its drafts; the service hears that count with the call after next (lag 2). One forward
in ten is skipped instead and reverted by the next call, which may also report the request's
older step; requests finish at random, some with two steps in flight; a few grants are padded.
After every call the worker checks the service against its model, per live request:

- history is the device's position less 1 + accepted of each step still unsettled;
- capacity is history plus 1 + D of each unsettled grant (``reclaim``: a lag-2 grant adds no
  slack), and the newest grant's reach leaves at most ``max_draft_len`` of it unused;
- a grant starts where the device is, less the accepted drafts the service has not heard of;
- with the pool attached, every token the device writes lies in its request's blocks, at its true
  position (`AttachedPool.slot_mapping` with the lead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from kvalloc.server.client import Client
from kvalloc.server.contract.columns import StepResult


@dataclass
class Forward:
    draft: int
    accepted: int  # what the device accepted; the service hears it two calls later
    start: int  # the device's position when it began
    due: int  # the call that reports it (or reverts it, when skipped)
    skipped: bool


@dataclass
class Request:
    handle: int
    position: int  # tokens the device has written and kept, accepted drafts included
    forwards: list[Forward] = field(default_factory=list)  # unsettled, oldest first

    def unheard(self) -> int:
        """Accepted drafts of forwards that ran and whose results the service has not had."""
        return sum(f.accepted for f in self.forwards if not f.skipped)


@dataclass
class Exercised:
    """What the schedule did, so a test can tell it met the lag-2 timeline."""

    calls: int = 0
    behind: int = 0  # grants made while the request's previous step was unsettled
    revert_with_result: int = 0  # calls that reverted a request's newer step and settled its older
    finished_in_flight: int = 0  # requests finished with two steps unsettled


class Lag2Worker:
    def __init__(self, client: Client, seed: int, *, max_live: int = 4,
                 after_call: Callable[[], None] | None = None) -> None:
        """``client`` registered with ``overlap=True``; ``after_call`` runs after every call
        (an in-process test checks the core's invariants there)."""
        assert client.registration is not None
        layout = client.registration.layout
        self.client, self.rng, self.after_call = client, np.random.default_rng(seed), after_call
        self.max_draft, self.max_live = layout.max_draft_len, max_live
        # Finish a request before a grant could need more than its row (two unsettled steps).
        self.end = layout.max_blocks_per_seq * layout.tokens_per_block - 3 * (1 + self.max_draft)
        self.live: dict[str, Request] = {}
        self.exercised = Exercised()
        self._names = 0

    def run(self, calls: int) -> Exercised:
        for _ in range(calls):
            self.call()
        return self.exercised

    def finish_all(self) -> StepResult:
        """One call that finishes every live request, steps in flight and all."""
        reply = self.client.step(finished=[r.handle for r in self.live.values()])
        self.live.clear()
        return reply

    def call(self) -> StepResult:
        n, rng = self.exercised.calls, self.rng
        # A finished request's results are not reported: preempted, its steps still in flight.
        finished = [name for name, r in self.live.items()
                    if r.position > self.end or rng.random() < 0.08]
        results: dict[int, int] = {}
        reverts: list[int] = []
        for name, req in self.live.items():
            if name in finished:
                self.exercised.finished_in_flight += len(req.forwards) == 2
                continue
            # Due now: a skipped forward granted last call, one that ran granted the call
            # before, or one of each.
            for f in req.forwards:
                if f.due == n and f.skipped:
                    reverts.append(req.handle)
                elif f.due == n:
                    results[req.handle] = f.accepted
        self.exercised.revert_with_result += len(set(reverts) & set(results))
        granted = [name for name in self.live if name not in finished and rng.random() < 0.9]
        drafts = [int(rng.integers(0, self.max_draft + 1)) for _ in granted]
        padded = [i for i in range(len(granted)) if rng.random() < 0.15]
        new = [f"r{self._names + i}" for i in range(int(rng.integers(0, 3)))
               if len(self.live) - len(finished) + i < self.max_live]
        self._names += len(new)
        prompts = [int(rng.integers(1, 12)) for _ in new]
        reply = self.client.step(
            results=(list(results), list(results.values())), reverts=reverts,
            finished=[self.live[name].handle for name in finished],
            grants=([self.live[g].handle for g in granted], drafts),
            padding=([self.live[granted[i]].handle for i in padded],
                     [self.max_draft for _ in padded]),
            new=(new, prompts))
        for name in finished:
            del self.live[name]
        for req in self.live.values():
            req.forwards = [f for f in req.forwards if f.due > n]
        for i in padded:
            drafts[i] = self.max_draft
        self._launch(reply, dict(zip(granted, drafts, strict=True)))
        for name, handle, prompt in zip(new, reply.admitted.tolist(), prompts, strict=True):
            if handle >= 0:
                self.live[name] = Request(handle, prompt)
        self.exercised.calls += 1
        if self.after_call is not None:
            self.after_call()
        self._check()
        return reply

    def _launch(self, reply: StepResult, drafts: dict[str, int]) -> None:
        """Run the forwards ``reply`` scheduled: check where the service says each grant starts,
        and, attached, where its tokens land; then advance the device (or skip the forward)."""
        by_handle = {r.handle: (name, r) for name, r in self.live.items()}
        s = reply.scheduled
        lead = np.zeros(len(s), dtype=np.int64)
        for i, (handle, start) in enumerate(zip(s.handles.tolist(), s.start_positions.tolist(),
                                                strict=True)):
            if handle in by_handle:
                req = by_handle[handle][1]
                assert start == req.position - req.unheard(), (handle, start, req)
                lead[i] = req.unheard()
                self.exercised.behind += any(not f.skipped for f in req.forwards)
        if self.client.pool is not None:
            slots = self.client.pool.slot_mapping(reply, torch.from_numpy(lead))
            assert bool((slots >= 0).all()), "a token the device writes lies past its blocks"
        n = self.exercised.calls
        for handle in s.handles.tolist():
            if handle not in by_handle:
                continue  # a new request's prefill: no grant
            name, req = by_handle[handle]
            draft = drafts[name]
            if self.rng.random() < 0.1:
                req.forwards.append(Forward(draft, 0, req.position, n + 1, skipped=True))
                continue
            accepted = int(self.rng.integers(0, draft + 1))
            req.forwards.append(Forward(draft, accepted, req.position, n + 2, skipped=False))
            req.position += 1 + accepted

    def _check(self) -> None:
        for name, req in self.live.items():
            state = self.client.get_request(name)
            ran = [f for f in req.forwards if not f.skipped]
            assert state.history == req.position - sum(1 + f.accepted for f in ran), name
            assert state.capacity == state.history + sum(1 + f.draft for f in req.forwards), name
            if req.forwards:
                newest = req.forwards[-1]
                assert 0 <= state.capacity - (newest.start + 1 + newest.draft) <= self.max_draft
