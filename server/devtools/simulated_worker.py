"""`SimulatedWorker`: the inference worker `kvalloc loadgen` simulates, one call per step. No I/O:
it builds each step's call and learns from its reply; `loadgen.drive` sends the calls.

The worker behaves like an engine's overlap scheduler running one-model MTP with chunked
prefill: each call settles the previous step (accepted drafts drawn at random, or a revert when
the forward was skipped), finishes requests that produced their output, grants every running
request ``1 + D`` (sometimes padded to ``max_draft_len`` as a CUDA-graph bucket would be),
continues prompts being prefilled, and admits new arrivals (a Poisson number per step). A
request whose grant or prefill chunk is refused is preempted (freed the next step), as a
scheduler short of KV blocks does, so a full pool keeps turning over instead of stalling.

Invariants the worker keeps, so the service never sees a protocol error from it:
- every request of the previous step appears in exactly one of results, reverts, finished;
- a request gets a generation grant only once its whole prompt was scheduled in earlier steps;
- a step schedules at most the service's ``max_step_tokens``;
- accepted <= the draft length it was granted.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvalloc.allocator.commands.simulated_acceptance import Acceptance
from kvalloc.server.contract.columns import StepResult


@dataclass(frozen=True)
class Workload:
    """What the simulated engine does each step."""

    draft_len: int = 3
    acceptance: Acceptance = field(default_factory=lambda: Acceptance("geometric", 0.7))
    arrival_rate: float = 0.5  # expected new requests per step
    prompt_len: tuple[int, int] = (16, 512)  # inclusive range, uniform
    output_len: tuple[int, int] = (16, 256)
    max_live: int = 32
    skip_rate: float = 0.02  # forwards skipped (reverted)
    pad_rate: float = 0.1  # grants padded to max_draft_len
    # Tokens of a system prompt every new prompt starts with, sent with token ids (0: prompts
    # go without ids and share nothing).
    shared_prefix: int = 0


@dataclass
class _Request:
    prompt: int  # prompt tokens
    prompt_left: int  # prompt tokens not scheduled yet (chunked prefill)
    remaining: int  # output tokens still to produce
    in_flight: int | None = None  # D of this step's grant, None when not scheduled
    preempted: bool = False  # its grant or prefill chunk was refused: free it next step


@dataclass
class _Call:
    """What the last call asked for, to read its reply's refusals (indices into these)."""

    grants: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    new: list[_Request] = field(default_factory=list)


class SimulatedWorker:
    """Builds each step's call and learns from its reply. No I/O: the driver sends the calls.

    A step schedules at most ``max_step_tokens`` tokens (the service's staging capacity): decode
    grants first (1 + D each, padding included), then prefill chunks, then new prompts' first
    chunks, as a chunked-prefill scheduler that never starves running requests does. Requests are
    named by the handles the service gives them.
    """

    def __init__(self, workload: Workload, *, max_draft_len: int, max_step_tokens: int,
                 seed: int = 0) -> None:
        self.w = workload
        self.max_draft_len = max_draft_len
        self.max_step_tokens = max_step_tokens
        self.rng = np.random.default_rng(seed)
        self.live: dict[int, _Request] = {}  # by handle
        self._call = _Call()
        self._ids = itertools.count()
        self.stats: Counter[str] = Counter()
        self._system = self.rng.integers(0, 32000, workload.shared_prefix)

    def next_step(self) -> dict[str, Any]:
        """The step's columns, as `Client.step` takes them."""
        results, reverts, finished = self._settle()
        w, rng = self.w, self.rng
        budget = self.max_step_tokens
        call = self._call = _Call()
        drafts, pad_handles, pads, chunks = [], [], [], []
        for handle, req in self.live.items():
            if req.prompt_left:
                continue
            d = min(w.draft_len, self.max_draft_len, req.remaining - 1)
            pad = self.max_draft_len if d < self.max_draft_len and rng.random() < w.pad_rate else d
            if 1 + pad > budget:
                continue  # no room this step: it simply is not scheduled
            budget -= 1 + pad
            call.grants.append(handle)
            drafts.append(d)
            req.in_flight = d
            if pad > d:
                pad_handles.append(handle)
                pads.append(pad)
        for handle, req in self.live.items():
            chunk = min(req.prompt_left, budget)
            if chunk:
                budget -= chunk
                req.prompt_left -= chunk
                call.prefill.append(handle)
                chunks.append(chunk)

        new_ids, prompts, firsts, token_ids = [], [], [], []
        room = w.max_live - len(self.live)
        for _ in range(min(room, int(rng.poisson(w.arrival_rate)))):
            if not budget:
                break
            own = int(rng.integers(*w.prompt_len, endpoint=True))
            prompt = w.shared_prefix + own
            if w.shared_prefix:
                token_ids += [self._system, rng.integers(0, 32000, own)]
            first = min(prompt, budget)
            budget -= first
            new_ids.append(f"r{next(self._ids)}")
            prompts.append(prompt)
            firsts.append(first)
            call.new.append(_Request(prompt=prompt, prompt_left=prompt - first,
                                     remaining=int(rng.integers(*w.output_len, endpoint=True))))
        return {"results": results, "reverts": reverts, "finished": finished,
                "grants": (call.grants, drafts), "padding": (pad_handles, pads),
                "prefill": (call.prefill, chunks), "new": (new_ids, prompts, firsts),
                "prompt_token_ids": np.concatenate(token_ids) if token_ids else ()}

    def _settle(self) -> tuple[tuple[list[int], list[int]], list[int], list[int]]:
        """The previous step's outcome for every request it scheduled, and preemptions."""
        w, rng = self.w, self.rng
        handles, accepted_counts, reverts, finished = [], [], [], []
        for handle, req in self.live.items():
            if req.preempted:
                finished.append(handle)
            if req.in_flight is None:
                continue
            if rng.random() < w.skip_rate:
                reverts.append(handle)
                self.stats["reverts"] += 1
            else:
                accepted = int(w.acceptance.sample(rng, req.in_flight, 1)[0])
                req.remaining -= 1 + accepted
                self.stats["accepted_tokens"] += accepted
                self.stats["output_tokens"] += 1 + accepted
                if req.remaining <= 0:
                    finished.append(handle)
                else:
                    handles.append(handle)
                    accepted_counts.append(accepted)
            req.in_flight = None
        for handle in finished:
            self.stats["preempted" if self.live.pop(handle).preempted else "finished"] += 1
        return (handles, accepted_counts), reverts, finished

    def take_reply(self, reply: StepResult) -> None:
        """Learn which grants, prefill chunks and new requests the service refused, and the
        handles of the admitted ones."""
        call = self._call
        for kind, listed in (("grant", call.grants), ("prefill", call.prefill)):
            for i in reply.refused.of_kind(kind).tolist():
                req = self.live[listed[i]]
                req.in_flight, req.preempted = None, True
                self.stats[f"{kind}s_refused"] += 1  # grants_refused, prefills_refused
        for handle, cached, req in zip(reply.admitted.tolist(), reply.cached_tokens.tolist(),
                                       call.new, strict=True):
            if handle < 0:
                self.stats["requests_refused"] += 1
            else:
                # A cached prefix is in the pool already: the prompt is that much shorter.
                req.prompt_left = max(0, req.prompt_left - cached)
                self.live[handle] = req
                self.stats["admitted"] += 1
                if self.w.shared_prefix:
                    self.stats["prompt_tokens"] += req.prompt
                    self.stats["cached_tokens"] += cached

    def reset(self) -> None:
        """Forget every request (the service freed them: re-registration or a new epoch)."""
        self.live.clear()
        self._call = _Call()
