"""`Engine`: continuous batching with speculative decoding, KV in the kvalloc pool, one service
call per step.

How the loop maps onto the step protocol (a pool with ``overlap_scheduler=True``):

- Step ``n``'s call carries, in its columns:
  ``results``  (handle, accepted drafts) of every request that decoded in step ``n - 1`` and goes
               on: the service commits its verified token and accepted drafts from the staging
               buffer, rewinds the rejected drafts and reclaims the overlap slack;
  ``finished`` requests that produced their last token in step ``n - 1`` (their step-``n - 1``
               tokens are never committed: nothing will read them), and requests preempted in
               step ``n - 1``;
  ``grants``   (handle, D) for every decoding request: its pending token plus D drafts, with
               D = min(draft_len, what the drafter proposes, tokens still to generate - 1);
  ``prefill``  (handle, chunk) for admitted prompts not yet fully scheduled;
  ``new``      (id, prompt length, first chunk) for waiting prompts, while the batch has rows and
               the step has tokens.
  Everything is sized so the step fits ``max_step_tokens``: decodes first, then prefill chunks,
  then new prompts, as a chunked-prefill scheduler that never starves running requests does.
- The reply schedules tokens in packed order; the model runs them as one sequence (batch 1,
  positions from ``start_positions``) and the kvalloc attention stages each layer's K/V at
  ``staging[layer, :, token_offset + i]``, reading history through the attached block table.
  Prefill chunks are history as soon as scheduled; their K/V is committed by the next call.
- Verification is greedy: a request accepts the longest prefix of its drafts that matches the
  model's own argmax, plus the model's token after it (the bonus), which becomes the next
  step's pending token. A prompt's last prefill chunk yields its first generated token.
- A grant or prefill chunk the service refuses (out of blocks) preempts its request: it is
  finished in the next call and waits to be admitted again with its prompt and the tokens it
  generated so far as a new prompt (recompute). A refused new prompt simply waits.

Under overlap the service grants each decode ``1 + D`` plus a slack of D (or the last step's
accepted drafts when D shrank). This worker settles each step before its next call (the result
columns need the accepted counts), so its device never runs ahead of history; the slack it is
granted is reclaimed by every result, and block-boundary growth is exercised exactly as for an
engine that does run ahead.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from server.client import Client
from server.contract import wire
from server.contract.columns import StepResult
from worker.attention import PoolStep
from worker.drafters import Drafter
from worker.model import kv_shape
from worker.pool_attention import PagedLayout


class EngineError(RuntimeError):
    """The service and the worker disagree, or the work cannot proceed."""


class LayoutMismatch(EngineError):
    """The service's pool does not fit the model (layers, heads, head size or dtype)."""


class PoolTooSmall(EngineError):
    """A prompt cannot be admitted even with nothing else running."""


@dataclass(frozen=True)
class NamedPrompt:
    """A request's id and its prompt's token ids: what the engine is asked to generate from."""

    req_id: str
    token_ids: Sequence[int]


@dataclass
class Request:
    """One prompt's progress; the engine's only per-request object."""

    req_id: str
    prompt: np.ndarray
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    handle: int = -1  # the service's handle while admitted
    admitted: np.ndarray | None = None  # the prompt it was (re)admitted with
    scheduled: int = 0  # tokens of `admitted` scheduled so far
    drafts: np.ndarray | None = None  # drafts of the step in flight (decodes)
    accepted: int = 0  # drafts the step in flight accepted
    chunk: int = 0  # prompt tokens scheduled in the step being planned
    done: bool = False
    preempted: bool = False

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int64)])

    @property
    def decoding(self) -> bool:
        return self.admitted is not None and self.scheduled == self.admitted.size

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)


@dataclass
class RunStats:
    steps: int = 0
    wall_s: float = 0.0
    call_s: float = 0.0  # inside the service call
    forward_s: float = 0.0
    generated_tokens: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    preemptions: int = 0
    refused_new: int = 0
    # Prompt tokens found in the service's cached prefix blocks: prefill the forward skipped.
    cached_prompt_tokens: int = 0
    # Steps that only decode (no prefill chunk, no new prompt): the steady state of serving.
    decode_steps: int = 0
    decode_wall_s: float = 0.0
    decode_call_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else 0.0

    @property
    def call_share(self) -> float:
        """The share of step wall time spent in the service call."""
        return self.call_s / self.wall_s if self.wall_s else 0.0

    @property
    def decode_call_share(self) -> float:
        """The call's share of the wall time of decode-only steps."""
        return self.decode_call_s / self.decode_wall_s if self.decode_wall_s else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s,
                "acceptance_rate": self.acceptance_rate, "call_share": self.call_share,
                "decode_call_share": self.decode_call_share}


@dataclass(frozen=True)
class StepRecord:
    """What one step ran, for observers (tests check the pool and the logits with it)."""

    call: dict[str, Any]  # the client's step() keywords: settles the previous step
    reply: StepResult
    requests: list[Request]  # one per scheduled entry, in reply order
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    logit_rows: np.ndarray  # packed token index of each row of `logits`
    logits: torch.Tensor  # [len(logit_rows), vocab]


class Engine:
    """Serves prompts with ``model`` through ``client`` (registered and attached)."""

    def __init__(self, model: PreTrainedModel, client: Client, drafter: Drafter | None, *,
                 draft_len: int, stop_token_ids: Iterable[int] = (),
                 share_prefixes: bool = False) -> None:
        """``share_prefixes``: send prompts' token ids so that a service with prefix caching
        reuses cached prefix blocks; their prefill is skipped."""
        if client.registration is None or client.pool is None:
            raise EngineError("client: register() with the pool attached first")
        self.model, self.client, self.drafter = model, client, drafter
        self.pool = client.pool
        layout = client.registration.layout
        self.layout = layout
        self._check_layout(model, layout, self.pool.staging.dtype)
        self.device = next(model.parameters()).device
        if self.pool.kv.device != self.device:
            raise LayoutMismatch(f"device: the pool is on {self.pool.kv.device}, the model on "
                                 f"{self.device}; run the model where the pool is")
        if draft_len and drafter is None:
            raise EngineError("drafter: draft_len > 0 needs a drafter")
        if not 0 <= draft_len <= layout.max_draft_len:
            raise EngineError(f"draft_len: {draft_len} is outside the pool's 0.."
                              f"{layout.max_draft_len} (max_draft_len)")
        self.draft_len = draft_len
        self.share_prefixes = share_prefixes
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        # A decode near the end of a row still needs room for 1 + D tokens and D of slack.
        self.max_seq_len = (layout.max_blocks_per_seq * layout.tokens_per_block
                            - 1 - 2 * layout.max_draft_len)
        self.stats = RunStats()

    @staticmethod
    def _check_layout(model: PreTrainedModel, layout: wire.PoolLayout,
                      staging_dtype: torch.dtype) -> None:
        want = dict(zip(("num_layers", "num_kv_heads", "head_dim"), kv_shape(model.config),
                        strict=True))
        for name, value in want.items():
            if getattr(layout, name) != value:
                raise LayoutMismatch(f"{name}: the pool has {getattr(layout, name)}, the model "
                                     f"needs {value}")
        if model.dtype != staging_dtype:
            raise LayoutMismatch(f"dtype: the pool stages {staging_dtype}, the model runs in "
                                 f"{model.dtype}")
        if layout.dtype == "fp8_e4m3":
            raise LayoutMismatch("dtype: fp8 pools are not supported by the worker")

    # ------------------------------------------------------------------ the loop

    def run(self, prompts: Sequence[NamedPrompt], max_new_tokens: int, *,
            on_step: Callable[[StepRecord], None] | None = None,
            on_progress: Callable[[int], None] | None = None) -> dict[str, list[int]]:
        """Generate up to ``max_new_tokens`` for every prompt (fewer when a stop token comes);
        returns the generated token ids per request id. ``on_progress`` gets each step's count
        of new tokens."""
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens: {max_new_tokens} must be >= 1")
        requests = [self._request(p, max_new_tokens) for p in prompts]
        if len({r.req_id for r in requests}) != len(requests):
            raise EngineError("req_id: prompt ids must be unique")
        waiting: deque[Request] = deque(requests)
        live: dict[int, Request] = {}  # handle -> admitted request
        in_flight: list[Request] = []  # the previous step's decodes
        while waiting or live:
            step_started = time.perf_counter()
            plan = self._plan(waiting, live, in_flight)
            called = time.perf_counter()
            reply = self.client.step(**plan.call)
            call_s = time.perf_counter() - called
            for r in reversed(plan.finished):
                del live[r.handle]
                r.handle = -1
                if r.preempted:  # recompute from its prompt and output so far, from the next step
                    r.preempted, r.admitted = False, None
                    waiting.appendleft(r)
            self._admit(reply, plan, waiting, live)
            scheduled = [live[h] for h in np.asarray(reply.scheduled.handles).tolist()]
            in_flight = [r for r in scheduled if r.drafts is not None]
            if scheduled:
                generated = self._forward(plan.call, reply, scheduled, on_step)
                if on_progress is not None:
                    on_progress(generated)
            elif not live and waiting:
                raise PoolTooSmall(f"prompt {waiting[0].req_id!r} ({waiting[0].tokens.size} "
                                   f"tokens) was refused with nothing else running: the pool is "
                                   f"too small for it")
            self._count_step(time.perf_counter() - step_started, call_s,
                             decode_only=not (plan.prefilling or plan.new))
        return {r.req_id: r.output for r in requests}

    def _count_step(self, wall_s: float, call_s: float, *, decode_only: bool) -> None:
        stats = self.stats
        stats.steps += 1
        stats.wall_s += wall_s
        stats.call_s += call_s
        if decode_only:
            stats.decode_steps += 1
            stats.decode_wall_s += wall_s
            stats.decode_call_s += call_s

    def _request(self, prompt: NamedPrompt, max_new_tokens: int) -> Request:
        ids = np.asarray(prompt.token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise EngineError(f"token_ids: prompt {prompt.req_id!r} needs at least one token")
        vocab = self.model.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise EngineError(f"token_ids: prompt {prompt.req_id!r} has a token outside the "
                              f"vocabulary [0, {vocab})")
        # The last generated token is never fed to the model, hence the - 1.
        longest = ids.size + max_new_tokens - 1
        if longest > self.max_seq_len:
            raise EngineError(f"max_new_tokens: prompt {prompt.req_id!r} would reach {longest} "
                              f"tokens, more than the pool's max_seq_len {self.max_seq_len}")
        return Request(prompt.req_id, ids, max_new_tokens)

    def _plan(self, waiting: deque[Request], live: dict[int, Request],
              in_flight: list[Request]) -> _Plan:
        """The step's call: settle the previous step, then fill ``max_step_tokens`` with decodes,
        prefill chunks and new prompts, in that order."""
        plan = _Plan()
        plan.finished = [r for r in live.values() if r.done or r.preempted]
        results = [r for r in in_flight if not (r.done or r.preempted)]
        budget = self.layout.max_step_tokens
        for r in live.values():
            r.drafts = None
            if r.done or r.preempted or budget < 1:
                continue
            if r.decoding:
                num = min(self.draft_len, r.remaining - 1, budget - 1)
                proposed = (self.drafter.propose(r.req_id, r.tokens, len(r.output), num)
                            if num > 0 and self.drafter is not None else ())
                r.drafts = np.asarray(proposed, dtype=np.int64)[:num]
                budget -= 1 + r.drafts.size
                plan.granted.append(r)
        for r in live.values():
            if r.done or r.preempted or r.decoding or budget < 1:
                continue
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
        call = plan.call
        if results:
            call["results"] = (_handles(results), _ints(r.accepted for r in results))
        if plan.finished:
            call["finished"] = _handles(plan.finished)
        if plan.granted:
            call["grants"] = (_handles(plan.granted), _ints(r.drafts.size for r in plan.granted))
        if plan.prefilling:
            call["prefill"] = (_handles(plan.prefilling), _ints(r.chunk for r in plan.prefilling))
        if plan.new:
            call["new"] = ([r.req_id for r in plan.new], _ints(r.admitted.size for r in plan.new),
                           _ints(r.chunk for r in plan.new))
            if self.share_prefixes:
                call["prompt_token_ids"] = np.concatenate([r.admitted for r in plan.new])
        return plan

    def _admit(self, reply: StepResult, plan: _Plan, waiting: deque[Request],
               live: dict[int, Request]) -> None:
        """Take the reply's handles for admitted prompts; preempt refused grants and chunks."""
        for r, handle, cached in zip(plan.new, np.asarray(reply.admitted).tolist(),
                                     np.asarray(reply.cached_tokens).tolist(), strict=True):
            if handle >= 0:
                r.handle = handle
                r.scheduled = cached  # a cached prefix is in the pool already
                self.stats.cached_prompt_tokens += cached
                live[handle] = r
        refused = reply.refused
        for kind, requests in (("grant", plan.granted), ("prefill", plan.prefilling)):
            for i in refused.of_kind(kind).tolist():
                requests[i].preempted, requests[i].drafts = True, None
                self.stats.preemptions += 1
        refused_new = [plan.new[i] for i in refused.of_kind("new").tolist()]
        for r in reversed(refused_new):
            r.admitted = None
            waiting.appendleft(r)  # keeps its place at the head of the queue
        self.stats.refused_new += len(refused_new)

    def _forward(self, call: dict[str, Any], reply: StepResult, scheduled: list[Request],
                 on_step: Callable[[StepRecord], None] | None) -> int:
        """Run the step's packed tokens through the model; verify, emit. Returns the number of
        tokens generated."""
        sched = reply.scheduled
        offsets = np.asarray(sched.token_offsets, dtype=np.int64)
        num_tokens = np.asarray(sched.num_tokens, dtype=np.int64)
        starts = np.asarray(sched.start_positions, dtype=np.int64)
        rows = np.asarray(sched.rows, dtype=np.int64)
        total = int(num_tokens.sum())
        ids = np.empty(total, dtype=np.int64)
        keep: list[np.ndarray] = []  # packed indices whose logits the step needs
        for r, off, n, start in zip(scheduled, offsets.tolist(), num_tokens.tolist(),
                                    starts.tolist(), strict=True):
            if r.drafts is not None:
                expected = r.prompt.size + len(r.output) - 1  # the pending token's position
                tokens = np.concatenate([r.output[-1:], r.drafts])
                keep.append(np.arange(off, off + n))
            else:
                expected = r.scheduled
                tokens = r.admitted[r.scheduled:r.scheduled + n]
                r.scheduled += n
                if r.decoding:
                    keep.append(np.array([off + n - 1]))
            if start != expected or tokens.size != n:
                raise EngineError(f"scheduled: request {r.req_id!r} got {n} tokens at position "
                                  f"{start}; the worker expected {tokens.size} at {expected}")
            ids[off:off + n] = tokens
        positions = np.repeat(starts - offsets, num_tokens) + np.arange(total)
        logit_rows = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
        forward_started = time.perf_counter()
        layout = PagedLayout.build(self.pool.block_table, self.layout.tokens_per_block,
                                   rows=rows, query_starts=offsets, query_lens=num_tokens,
                                   starts=starts, group_width=1 + self.layout.max_draft_len)
        step = PoolStep(self.pool.kv, self.pool.staging, layout)
        dev = self.device
        input_ids = torch.as_tensor(ids, device=dev)
        position_ids = torch.as_tensor(positions, device=dev)
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False,
                logits_to_keep=torch.as_tensor(logit_rows, device=dev), kvalloc_step=step,
            ).logits[0]
            predicted = logits.argmax(dim=-1).cpu().numpy()
        self.stats.forward_s += time.perf_counter() - forward_started
        if on_step is not None:
            on_step(StepRecord(call, reply, scheduled, input_ids, position_ids, logit_rows,
                               logits))
        return self._verify(scheduled, offsets, logit_rows, predicted)

    def _verify(self, scheduled: list[Request], offsets: np.ndarray, logit_rows: np.ndarray,
                predicted: np.ndarray) -> int:
        """Greedy verification: each request emits its accepted drafts and the bonus token."""
        first_row = np.searchsorted(logit_rows, offsets)
        generated = 0
        for r, row in zip(scheduled, first_row.tolist(), strict=True):
            if r.drafts is not None:
                guesses = predicted[row:row + 1 + r.drafts.size]
                matches = np.cumprod(r.drafts == guesses[:-1])
                r.accepted = int(matches.sum())
                self.stats.proposed_drafts += r.drafts.size
                self.stats.accepted_drafts += r.accepted
                emitted = guesses[:r.accepted + 1]
            elif r.decoding:
                emitted = predicted[row:row + 1]  # the prompt's last chunk: first new token
            else:
                continue
            generated += self._emit(r, emitted.tolist())
        self.stats.generated_tokens += generated
        return generated

    def _emit(self, r: Request, tokens: list[int]) -> int:
        tokens = tokens[:r.remaining]
        for i, t in enumerate(tokens):
            if t in self.stop_token_ids:
                tokens = tokens[:i + 1]
                r.done = True
                break
        r.output.extend(tokens)
        r.done = r.done or r.remaining == 0
        return len(tokens)


@dataclass
class _Plan:
    call: dict[str, Any] = field(default_factory=dict)  # the client's step() keywords
    finished: list[Request] = field(default_factory=list)
    granted: list[Request] = field(default_factory=list)
    prefilling: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)


def _handles(requests: list[Request]) -> np.ndarray:
    return np.fromiter((r.handle for r in requests), dtype=np.int64, count=len(requests))


def _ints(values: Iterable[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64)
