"""`Engine`: continuous batching with speculative decoding, KV in the kvalloc pool, one service
call per step, synchronous or one step ahead of the host (``overlap``).

How the loop maps onto the step protocol (a pool with ``overlap_scheduler=True``):

- Step ``n``'s call carries, in its columns:
  ``results``  (handle, accepted drafts) of every request whose oldest unsettled decode is being
               settled and that goes on: step ``n - 1``'s synchronously, step ``n - 2``'s for an
               overlap worker (docs/protocol.md, "Overlap workers");
  ``finished`` requests that produced their last token in a step the host has read, and
               requests preempted in step ``n - 1``: their unsettled steps are dropped;
  ``grants``   (handle, D) for every decoding request: its pending token plus D drafts, with
               D = min(draft_len, what the drafter proposes, tokens still to generate - 1);
  ``prefill``  (handle, chunk) for admitted prompts not yet fully scheduled;
  ``new``      (id, prompt length, first chunk) for waiting prompts, while the batch has rows and
               the step has tokens.
  Everything is sized so the step fits ``max_step_tokens``: decodes first, then prefill chunks,
  then new prompts, as a chunked-prefill scheduler that never starves running requests does.
- The reply schedules tokens in packed order; `DeviceStep` runs them as one sequence (batch 1)
  and the kvalloc attention stages each layer's K/V at ``staging[layer, :, token_offset + i]``,
  reading history through the attached block table. Verification is greedy and on the device:
  a request accepts the longest prefix of its drafts that matches the model's own argmax, plus
  the model's token after it (the bonus), which becomes the next step's pending token. A
  prompt's last prefill chunk yields its first generated token.
- A grant or prefill chunk the service refuses (out of blocks) preempts its request: it is
  finished in the next call and waits to be admitted again with its prompt and the tokens it
  generated so far as a new prompt (recompute). A refused new prompt simply waits.

Synchronously (the reference) the host reads each step's outcome before its next call, and the
service commits the accepted tokens from staging. With ``overlap`` the host makes the call for
step k+1 and launches its forward while the device still runs step k: step k+1's inputs (the
pending tokens, a device drafter's drafts, each history's lead) come from the device, the worker
commits its own accepted tokens on the device right after verification, and the host reads step
k's outcome only when it plans step k+2. A request that ends in step k may then be scheduled in
step k+1 already; that forward is wasted and commits nothing, and its grant is dropped when the
request is finished.
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

from allocator.capacity.table_validator import TableValidator
from server.client import Client
from server.contract import wire
from server.contract.columns import StepResult
from worker.drafters import DeviceOracleDrafter, Drafter
from worker.errors import EngineError, LayoutMismatch, PoolTooSmall
from worker.fusion import fuse_model
from worker.model import kv_shape
from worker.step.commit import WorkerCommit
from worker.step.decode_graphs import DecodeGraphs
from worker.step.device_step import DeviceStep, Launched, LaunchPlan, StepTensors
from worker.step.rows import DeviceRows


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
    drafts: np.ndarray | None = None  # host drafts of the step being planned (decodes)
    num_drafts: int = -1  # drafts of the step being planned; -1 when it is not a decode in it
    padded_drafts: int = 0  # drafts its step runs: num_drafts, or more through the padding grant
    unread: int = 0  # its steps that emit and whose outcome the host has not read
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
    forward_s: float = 0.0  # launching each step's device work (on a CPU: running it)
    metadata_s: float = 0.0  # of which laying out the step's inputs, positions and slots
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
    # Forwards launched before the host had read the previous step's outcome: the device ran
    # ahead of the host (overlap only).
    forwards_ahead: int = 0
    # CUDA only, from events on the worker's stream: time between one forward's end and the
    # next one's start, and inside forwards (inputs, forward, verification, commit).
    device_idle_s: float = 0.0
    device_busy_s: float = 0.0
    decode_busy_s: float = 0.0  # of which in decode-only steps (every entry a decode)
    # Block-table entries a step addressed that held no block (the validator, when on).
    table_violations: int = 0
    # An overlap worker's own commit: tokens it wrote, and kept tokens it refused because their
    # block was a protected (cached) prefix block.
    committed_tokens: int = 0
    refused_tokens: int = 0
    # Decode steps replayed as CUDA graphs, and the graphs captured for them (cuda_graphs).
    graph_replays: int = 0
    graphs_captured: int = 0
    # Entries decode steps ran past the planned ones, to reach their batch bucket (pad_decodes).
    padded_entries: int = 0
    # Before serving (`Engine.warm_up`): the shapes run, and how long that took.
    warm_up_shapes: int = 0
    warm_up_s: float = 0.0

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
    """What one step ran, for observers (tests check the pool and the logits with it). The
    tensors are the device's; on an overlap worker reading them waits for the step."""

    call: dict[str, Any]  # the client's step() keywords: settles an earlier step
    reply: StepResult
    requests: list[Request]  # one per scheduled entry, in reply order
    tensors: StepTensors


class Engine:
    """Serves prompts with ``model`` through ``client`` (registered and attached)."""

    def __init__(self, model: PreTrainedModel, client: Client,
                 drafter: Drafter | DeviceOracleDrafter | None, *, draft_len: int,
                 stop_token_ids: Iterable[int] = (), share_prefixes: bool = False,
                 overlap: bool = False, validate: bool = False, cuda_graphs: bool = False,
                 pad_decodes: bool | None = None) -> None:
        """``share_prefixes``: send prompts' token ids so that a service with prefix caching
        reuses cached prefix blocks; their prefill is skipped. ``overlap``: run one step ahead
        of the host (the client registered with ``overlap=True``; drafts, if any, from a
        `DeviceOracleDrafter`). ``validate``: count block-table entries each step addresses
        that hold no block (``RunStats.table_violations``). ``cuda_graphs``: replay decode steps
        as captured CUDA graphs (a CUDA pool), which pads every decode of a decode-only step to
        ``draft_len`` drafts through the padding grant and grows its batch to a bucket
        (`worker.step.batch_buckets`); ``pad_decodes`` pads so without graphs.
        On CUDA the model's modules are switched, in place, to the worker's fused forwards
        (`worker.fusion.fuse_model`: norms, rotary and staging, gated MLPs)."""
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
        if overlap != client.overlap:
            mode = "one step ahead" if overlap else "in step"
            raise EngineError(f"overlap: the engine runs {mode} but the client registered with "
                              f"overlap={client.overlap}")
        if draft_len and drafter is None:
            raise EngineError("drafter: draft_len > 0 needs a drafter")
        if overlap and drafter is not None and not isinstance(drafter, DeviceOracleDrafter):
            raise EngineError("drafter: an overlap worker drafts on the device; the n-gram "
                              "drafter reads the host's tokens (use oracle:RATE, or no overlap)")
        if not 0 <= draft_len <= layout.max_draft_len:
            raise EngineError(f"draft_len: {draft_len} is outside the pool's 0.."
                              f"{layout.max_draft_len} (max_draft_len)")
        self.draft_len, self.overlap = draft_len, overlap
        self.share_prefixes = share_prefixes
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        # A decode near the end of a row still needs room for 1 + D tokens and D of slack, and
        # an overlap worker's wasted step past a request's end another 1 + D.
        self.max_seq_len = (layout.max_blocks_per_seq * layout.tokens_per_block
                            - 1 - 2 * layout.max_draft_len)
        self.device_drafter = drafter if isinstance(drafter, DeviceOracleDrafter) else None
        self.rows = DeviceRows(layout.max_batch_size, self.device,
                               truth_width=self.device_drafter.width
                               if self.device_drafter is not None else 0)
        self.validator = TableValidator(self.device) if validate else None
        if cuda_graphs and self.device.type != "cuda":
            raise EngineError(f"cuda_graphs: the pool is on {self.device}; graphs need CUDA")
        self.pad_decodes = cuda_graphs if pad_decodes is None else pad_decodes
        if self.device.type == "cuda":  # a launch where transformers runs a dozen
            fuse_model(model)
        self.step = DeviceStep(model, self.pool.kv, self.pool.staging, self.pool.block_table,
                               self.rows, max_draft_len=layout.max_draft_len,
                               stop_token_ids=self.stop_token_ids,
                               drafter=self.device_drafter,
                               commit=WorkerCommit(self.pool) if overlap else None,
                               validator=self.validator,
                               graphs=DecodeGraphs() if cuda_graphs else None,
                               pad_batches=self.pad_decodes)
        if self.step.graphs is not None:  # none evicted by another while serving
            self.step.graphs.make_room(len(self._decode_shapes()))
        self.stats = RunStats()
        self._last_done: torch.cuda.Event | None = None

    @staticmethod
    def _check_layout(model: PreTrainedModel, layout: wire.PoolLayout,
                      staging_dtype: torch.dtype) -> None:
        want = dict(zip(("num_layers", "num_kv_heads", "head_dim"), kv_shape(model.config),
                        strict=True))
        # A tensor-parallel pool's shard, like the model's, holds its share of the KV heads.
        have = {"num_layers": layout.num_layers, "head_dim": layout.head_dim,
                "num_kv_heads": layout.num_kv_heads // layout.tensor_parallel}
        for name, value in want.items():
            if have[name] != value:
                raise LayoutMismatch(f"{name}: the pool has {have[name]}, the model "
                                     f"needs {value}")
        if model.dtype != staging_dtype:
            raise LayoutMismatch(f"dtype: the pool stages {staging_dtype}, the model runs in "
                                 f"{model.dtype}")
        if layout.dtype == "fp8_e4m3":
            raise LayoutMismatch("dtype: fp8 pools are not supported by the worker")

    # ------------------------------------------------------------------ before serving

    def warm_up(self) -> int:
        """Run once every shape this engine's decode steps take, and its widest prefill chunk,
        on the rows' spare row: nothing of the pool is read, nothing emitted or kept, no request
        is touched. It compiles every kernel those shapes use and, with ``cuda_graphs``,
        captures each decode shape's graph, so that serving never stalls on either. After each
        shape an empty call keeps the lease: a cold compile may take seconds, though one shape
        must compile within the lease. Call it outside `run`; returns the shapes run."""
        spare = self.rows.spare
        plans = [LaunchPlan.on_spare_row(np.array([self.step.capacity]), spare, decode=False)]
        plans += [LaunchPlan.on_spare_row(np.full(entries, width), spare, decode=True)
                  for entries, width in self._decode_shapes()]
        started = time.perf_counter()
        for plan in plans:
            self.step.launch(plan).outcome()
            self.client.step()
        self.stats.warm_up_shapes += len(plans)
        self.stats.warm_up_s += time.perf_counter() - started
        return len(plans)

    def _decode_shapes(self) -> list[tuple[int, int]]:
        """The decode shapes the warm-up runs (`DeviceStep.decode_shapes`), at each width the
        decodes may have (one when padded to ``draft_len`` drafts)."""
        widths = [1 + self.draft_len] if self.pad_decodes else range(1, 2 + self.draft_len)
        return self.step.decode_shapes(widths)

    # ------------------------------------------------------------------ the loop

    def run(self, prompts: Sequence[NamedPrompt], max_new_tokens: int, *,
            on_step: Callable[[StepRecord], None] | None = None,
            on_progress: Callable[[int], None] | None = None) -> dict[str, list[int]]:
        """Generate up to ``max_new_tokens`` for every prompt (fewer when a stop token comes);
        returns the generated token ids per request id. ``on_progress`` gets each step's count
        of new tokens as the host reads it."""
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens: {max_new_tokens} must be >= 1")
        requests = [self._request(p, max_new_tokens) for p in prompts]
        if len({r.req_id for r in requests}) != len(requests):
            raise EngineError("req_id: prompt ids must be unique")
        waiting: deque[Request] = deque(requests)
        live: dict[int, Request] = {}  # handle -> admitted request
        flights: deque[_Flight | None] = deque()  # launched steps not read yet, oldest first
        lag = 2 if self.overlap else 1
        while waiting or live:
            step_started = time.perf_counter()
            results: list[tuple[Request, int]] = []
            while len(flights) >= lag:
                results += self._read(flights.popleft(), on_progress)
            plan = self._plan(waiting, live, results)
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
            if scheduled:
                flights.append(self._launch(plan.call, reply, scheduled, bool(flights), on_step))
            else:
                flights.append(None)
                if not live and waiting:
                    raise PoolTooSmall(f"prompt {waiting[0].req_id!r} ({waiting[0].tokens.size} "
                                       f"tokens) was refused with nothing else running: the "
                                       f"pool is too small for it")
            self._count_step(time.perf_counter() - step_started, call_s,
                             decode_only=not (plan.prefilling or plan.new))
        for flight in flights:  # forwards past every request's end: nothing to emit
            self._read(flight, on_progress)
        if self.validator is not None:
            self.stats.table_violations = self.validator.count()
        if self.step.committer is not None:
            self.stats.committed_tokens = int(self.step.committer.committed)
            self.stats.refused_tokens = int(self.step.committer.refused)
        if self.step.graphs is not None:
            self.stats.graph_replays = self.step.graphs.replayed
            self.stats.graphs_captured = self.step.graphs.captured
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
              results: list[tuple[Request, int]]) -> _Plan:
        """The step's call: settle what the host has read, then fill ``max_step_tokens`` with
        decodes, prefill chunks and new prompts, in that order."""
        plan = _Plan()
        plan.finished = [r for r in live.values() if r.done or r.preempted]
        results = [(r, a) for r, a in results if not (r.done or r.preempted or r.handle < 0)]
        budget = self.layout.max_step_tokens
        for r in live.values():
            r.drafts, r.num_drafts = None, -1
            # An unread step emits at least one token: the request may end in it.
            ahead = r.remaining - r.unread
            if r.done or r.preempted or budget < 1 or not r.decoding or ahead < 1:
                continue
            num = min(self.draft_len, ahead - 1, budget - 1)
            if num > 0 and self.drafter is not None and self.device_drafter is None:
                proposed = self.drafter.propose(r.req_id, r.tokens, len(r.output), num)
                r.drafts = np.asarray(proposed, dtype=np.int64)[:num]
                num = r.drafts.size
            r.num_drafts = r.padded_drafts = max(num, 0)
            budget -= 1 + r.num_drafts
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
        if self.pad_decodes and not (plan.prefilling or plan.new):
            self._pad(plan)
        self._columns(plan, results)
        return plan

    def _pad(self, plan: _Plan) -> None:
        """A decode-only step with every decode at ``draft_len`` drafts, the shape a graph
        replays: decodes with fewer are padded through the padding grant, when the step fits."""
        width = 1 + self.draft_len
        if len(plan.granted) * width > self.layout.max_step_tokens:
            return
        plan.padded = [r for r in plan.granted if r.num_drafts < self.draft_len]
        for r in plan.padded:
            r.padded_drafts = self.draft_len

    def _columns(self, plan: _Plan, results: list[tuple[Request, int]]) -> None:
        call = plan.call
        if results:
            call["results"] = (_handles([r for r, _ in results]), _ints(a for _, a in results))
        if plan.finished:
            call["finished"] = _handles(plan.finished)
        if plan.granted:
            call["grants"] = (_handles(plan.granted), _ints(r.num_drafts for r in plan.granted))
        if plan.padded:
            call["padding"] = (_handles(plan.padded),
                               np.full(len(plan.padded), self.draft_len, dtype=np.int64))
        if plan.prefilling:
            call["prefill"] = (_handles(plan.prefilling), _ints(r.chunk for r in plan.prefilling))
        if plan.new:
            call["new"] = ([r.req_id for r in plan.new], _ints(r.admitted.size for r in plan.new),
                           _ints(r.chunk for r in plan.new))
            if self.share_prefixes:
                call["prompt_token_ids"] = np.concatenate([r.admitted for r in plan.new])

    def _admit(self, reply: StepResult, plan: _Plan, waiting: deque[Request],
               live: dict[int, Request]) -> None:
        """Take the reply's handles for admitted prompts; preempt refused grants and chunks."""
        admitted = []
        for r, handle, cached in zip(plan.new, np.asarray(reply.admitted).tolist(),
                                     np.asarray(reply.cached_tokens).tolist(), strict=True):
            if handle >= 0:
                r.handle = handle
                r.scheduled = cached  # a cached prefix is in the pool already
                self.stats.cached_prompt_tokens += cached
                live[handle] = r
                admitted.append(r)
        self._admit_rows(reply, admitted)
        refused = reply.refused
        for kind, requests in (("grant", plan.granted), ("prefill", plan.prefilling)):
            for i in refused.of_kind(kind).tolist():
                requests[i].preempted, requests[i].drafts = True, None
                requests[i].num_drafts = -1
                self.stats.preemptions += 1
        refused_new = [plan.new[i] for i in refused.of_kind("new").tolist()]
        for r in reversed(refused_new):
            r.admitted = None
            waiting.appendleft(r)  # keeps its place at the head of the queue
        self.stats.refused_new += len(refused_new)

    def _admit_rows(self, reply: StepResult, admitted: list[Request]) -> None:
        """The device's state of the rows the reply gave admitted requests."""
        if not admitted:
            return
        row_of = dict(zip(np.asarray(reply.scheduled.handles).tolist(),
                          np.asarray(reply.scheduled.rows).tolist(), strict=True))
        rows = _ints(row_of[r.handle] for r in admitted)
        truth = (self.device_drafter.truth_rows([r.req_id for r in admitted])
                 if self.device_drafter is not None else None)
        self.rows.admit(rows, _ints(len(r.output) for r in admitted),
                        _ints(r.max_new_tokens for r in admitted), truth)

    def _launch(self, call: dict[str, Any], reply: StepResult, scheduled: list[Request],
                ahead: bool, on_step: Callable[[StepRecord], None] | None) -> _Flight:
        """Check the reply against what the worker planned and launch the step's forward;
        ``ahead``: an earlier step's outcome is still unread."""
        plan, emitting = self._launch_plan(reply, scheduled)
        launching = time.perf_counter()
        launched = self.step.launch(plan)
        self.stats.forward_s += time.perf_counter() - launching
        self.stats.metadata_s += launched.metadata_s
        self.stats.padded_entries += launched.ran - plan.emitting.size
        self.stats.forwards_ahead += ahead and bool(self.overlap)
        for r in emitting:
            r.unread += 1
        if on_step is not None:
            on_step(StepRecord(call, reply, scheduled, launched.record))
        return _Flight(launched, emitting)

    def _launch_plan(self, reply: StepResult, scheduled: list[Request]
                     ) -> tuple[LaunchPlan, list[Request]]:
        sched = reply.scheduled
        offsets = np.asarray(sched.token_offsets, dtype=np.int64)
        num_tokens = np.asarray(sched.num_tokens, dtype=np.int64)
        starts = np.asarray(sched.start_positions, dtype=np.int64)
        ids = np.zeros(int(num_tokens.sum()), dtype=np.int64)
        behind = _ints(r.unread for r in scheduled)
        emitting, decode, drafts = [], [], []
        for e, (r, off, n, start) in enumerate(zip(scheduled, offsets.tolist(),
                                                   num_tokens.tolist(), starts.tolist(),
                                                   strict=True)):
            if r.num_drafts >= 0:
                # Behind an unread step the reply's start counts only settled tokens.
                expected = r.prompt.size + len(r.output) - 1 + r.unread
                tokens = 1 + r.padded_drafts
                if r.drafts is not None:
                    ids[off + 1:off + 1 + r.drafts.size] = r.drafts
            else:
                chunk = r.admitted[r.scheduled:r.scheduled + n]
                expected, tokens = r.scheduled, chunk.size
                ids[off:off + chunk.size] = chunk
                r.scheduled += chunk.size
            if start != expected or tokens != n:
                raise EngineError(f"scheduled: request {r.req_id!r} got {n} tokens at position "
                                  f"{start}; the worker expected {tokens} at {expected}")
            if r.num_drafts >= 0 or r.decoding:
                emitting.append(e)
                decode.append(r.num_drafts >= 0)
                drafts.append(max(r.num_drafts, 0))
        plan = LaunchPlan(np.asarray(sched.rows, dtype=np.int64), offsets, num_tokens, starts,
                          behind, ids, _ints(emitting), np.array(decode, dtype=bool),
                          _ints(drafts))
        return plan, [scheduled[e] for e in emitting]

    def _read(self, flight: _Flight | None,
              on_progress: Callable[[int], None] | None) -> list[tuple[Request, int]]:
        """Apply a launched step's outcome to its requests; returns the results it settles:
        (request, accepted drafts) of its decodes."""
        if flight is None:
            return []
        tokens, emitted, accepted = flight.launched.outcome()
        self._time(flight.launched)
        stats, generated, results = self.stats, 0, []
        plan = flight.launched.plan
        for r, row, n, a, is_decode, proposed in zip(
                flight.requests, tokens, emitted.tolist(), accepted.tolist(),
                plan.decode.tolist(), plan.drafts.tolist(), strict=True):
            r.unread -= 1
            if n == 0:  # it had ended already: a wasted forward
                continue
            r.output.extend(row[:n].tolist())
            r.done = r.remaining == 0 or r.output[-1] in self.stop_token_ids
            generated += n
            if is_decode:
                # Draft i proposes emitted token i: past a request's last token it proposes
                # nothing the request needed (an overlap worker drafts before it knows the end).
                drafts = min(proposed, n) if r.done else proposed
                stats.proposed_drafts += drafts
                stats.accepted_drafts += min(a, drafts)
                results.append((r, a))
        stats.generated_tokens += generated
        if on_progress is not None:
            on_progress(generated)
        return results

    def _time(self, launched: Launched) -> None:
        if launched.started is None or launched.done is None:
            return
        if self._last_done is not None:
            self.stats.device_idle_s += self._last_done.elapsed_time(launched.started) / 1e3
        busy = launched.started.elapsed_time(launched.done) / 1e3
        self.stats.device_busy_s += busy
        if launched.plan.all_decodes:
            self.stats.decode_busy_s += busy
        self._last_done = launched.done


@dataclass(frozen=True)
class _Flight:
    """A launched step and the request of each of its emitting entries."""

    launched: Launched
    requests: list[Request]


@dataclass
class _Plan:
    call: dict[str, Any] = field(default_factory=dict)  # the client's step() keywords
    finished: list[Request] = field(default_factory=list)
    granted: list[Request] = field(default_factory=list)
    padded: list[Request] = field(default_factory=list)  # granted, padded to draft_len drafts
    prefilling: list[Request] = field(default_factory=list)
    new: list[Request] = field(default_factory=list)


def _handles(requests: list[Request]) -> np.ndarray:
    return np.fromiter((r.handle for r in requests), dtype=np.int64, count=len(requests))


def _ints(values: Iterable[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64)
