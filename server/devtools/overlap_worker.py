"""`OverlapSimulatedWorker`: `kvalloc loadgen --overlap`'s simulated worker, one step ahead,
registered with ``overlap=True`` (docs/protocol.md, "Overlap workers (lag 2)").

Its device runs each granted forward as soon as the reply that scheduled it arrives, and draws
the forward's accepted drafts then (or skips it, at ``skip_rate``); the service hears of it with
a lag of two calls, as an overlap scheduler that prepares step k+1 while step k runs tells it:

- a forward that ran in step k is reported (``results``) by the call for step k+2, which settles
  the request's oldest unsettled step; the call for step k+1 may grant the request again, behind
  step k;
- a skipped forward of step k is reverted by the call for step k+1, which undoes the request's
  newest step; the same call may report the request's step k-1;
- a request whose output is complete on the device, or whose grant or prefill chunk was refused,
  is finished by the next call, with whatever of it is still unsettled.

Scheduling (token budget, padding, chunked prefill, admissions, preemption) is `SimulatedWorker`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvalloc.server.contract.columns import StepResult
from kvalloc.server.devtools.simulated_worker import SimulatedWorker, Workload


@dataclass(frozen=True)
class Forward:
    """One granted forward as the device ran it; the service has not heard of it yet."""

    due: int  # the call that reports it (reverts it, when skipped)
    accepted: int
    skipped: bool


class OverlapSimulatedWorker(SimulatedWorker):
    """`SimulatedWorker` whose results reach the service two calls late (lag 2)."""

    def __init__(self, workload: Workload, *, max_draft_len: int, max_step_tokens: int,
                 seed: int = 0) -> None:
        super().__init__(workload, max_draft_len=max_draft_len, max_step_tokens=max_step_tokens,
                         seed=seed)
        self.calls = 0  # calls built so far: the next one is call number ``calls``
        self.forwards: dict[int, list[Forward]] = {}  # unsettled, oldest first, by handle

    def next_step(self) -> dict[str, Any]:
        step = super().next_step()
        self.calls += 1
        return step

    def _settle(self) -> tuple[tuple[list[int], list[int]], list[int], list[int]]:
        """What this call reports, reverts and finishes; a request done on the device or
        preempted goes with its unsettled steps."""
        call = self.calls
        handles, accepted_counts, reverts, finished = [], [], [], []
        for handle, req in self.live.items():
            req.in_flight = None
            forwards = self.forwards.get(handle, [])
            if req.preempted or req.remaining <= 0:
                finished.append(handle)
                continue
            for forward in forwards:
                if forward.due != call:
                    continue
                if forward.skipped:
                    reverts.append(handle)
                else:
                    handles.append(handle)
                    accepted_counts.append(forward.accepted)
            self.forwards[handle] = [f for f in forwards if f.due > call]
        for handle in finished:
            self.forwards.pop(handle, None)
            self.stats["preempted" if self.live.pop(handle).preempted else "finished"] += 1
        return (handles, accepted_counts), reverts, finished

    def take_reply(self, reply: StepResult) -> None:
        """Learn the refusals and handles, then run the step's granted forwards on the device."""
        super().take_reply(reply)
        call, w = self.calls - 1, self.w  # the call this reply answers
        for handle in self._call.grants:
            req = self.live[handle]
            if req.in_flight is None:
                continue  # refused: preempted
            forwards = self.forwards.setdefault(handle, [])
            self.stats["grants_behind"] += any(not f.skipped for f in forwards)
            if self.rng.random() < w.skip_rate:
                forwards.append(Forward(call + 1, 0, skipped=True))
                self.stats["reverts"] += 1
                continue
            accepted = int(w.acceptance.sample(self.rng, req.in_flight, 1)[0])
            forwards.append(Forward(call + 2, accepted, skipped=False))
            req.remaining -= 1 + accepted
            self.stats["accepted_tokens"] += accepted
            self.stats["output_tokens"] += 1 + accepted

    def reset(self) -> None:
        super().reset()
        self.forwards.clear()
