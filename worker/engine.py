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
  then new prompts, as a chunked-prefill scheduler that never starves running requests does
  (`worker.step_plans`).
- The reply schedules tokens in packed order, checked against the plan into the device step's
  `LaunchPlan` (`worker.launch_plans`); `DeviceStep` runs them as one sequence (batch 1)
  and the kvalloc attention stages each layer's K/V at ``staging[layer, :, token_offset + i]``,
  reading history through the attached block table (a grouped pool's: the layer's group's
  staging and table, `worker.step.pool_groups`). Verification is greedy and on the device:
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

A worker registered with ``overlap=True`` commits its own accepted tokens whether it runs ahead
or not: run in step (``overlap=False``), it reports every step's results in the next call (early,
as the protocol allows) and the service's call does no commit of its own, the lighter call a
synchronous worker with CUDA graphs wants.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvalloc.allocator import PackedCommit, TableValidator, WriterFence
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepResult
from kvalloc.worker.attention.mla import switch_mla_modules
from kvalloc.worker.drafters import DeviceOracleDrafter, Drafter
from kvalloc.worker.errors import EngineError, LayoutMismatch, PoolTooSmall
from kvalloc.worker.fusion import fuse_model
from kvalloc.worker.launch_plans import launch_plan
from kvalloc.worker.model import kv_layout, kv_shape, layer_windows, model_groups, pool_window
from kvalloc.worker.requests import NamedPrompt, Request, int64s, new_request
from kvalloc.worker.run_stats import DeviceClock, RunStats
from kvalloc.worker.step.decode_graphs import DecodeGraphs, make_capturable
from kvalloc.worker.step.device_step import DeviceStep, Launched, LaunchPlan, StepTensors
from kvalloc.worker.step.pool_groups import PoolGroup, groups_mismatch, pool_groups, reads_further
from kvalloc.worker.step.rows import DeviceRows
from kvalloc.worker.step_plans import StepPlan, StepPlanner
from transformers import PreTrainedModel


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
        `DeviceOracleDrafter`); a client so registered has the worker commit its own tokens,
        ahead or in step. ``validate``: count block-table entries each step addresses
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
        self.groups = pool_groups(self.pool, layout)
        self.device = next(model.parameters()).device
        for group in self.groups:
            if group.kv.device != self.device:
                raise LayoutMismatch(f"device: the pool is on {group.kv.device}, the model on "
                                     f"{self.device}; run the model where the pool is")
        if overlap and not client.overlap:
            raise EngineError("overlap: the engine runs one step ahead but the client "
                              "registered with overlap=False")
        if draft_len and drafter is None:
            raise EngineError("drafter: draft_len > 0 needs a drafter")
        if overlap and drafter is not None and not isinstance(drafter, DeviceOracleDrafter):
            raise EngineError("drafter: an overlap worker drafts on the device; the n-gram "
                              "drafter reads the host's tokens (use oracle:RATE, or no overlap)")
        if not 0 <= draft_len <= layout.max_draft_len:
            raise EngineError(f"draft_len: {draft_len} is outside the pool's 0.."
                              f"{layout.max_draft_len} (max_draft_len)")
        self.draft_len, self.overlap = draft_len, overlap
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        # A decode near the end of a row still needs room for 1 + D tokens and D of slack, and
        # an overlap worker's wasted step past a request's end another 1 + D.
        self.max_seq_len = (layout.max_blocks_per_seq * layout.tokens_per_block
                            - 1 - 2 * layout.max_draft_len)
        self.device_drafter = drafter if isinstance(drafter, DeviceOracleDrafter) else None
        self.rows = DeviceRows(layout.max_batch_size, self.device,
                               truth_width=self.device_drafter.width
                               if self.device_drafter is not None else 0)
        # Each group's table checked for what its layers read.
        self.validators = tuple(TableValidator(self.device, pool_window(model.config, g.layers))
                                for g in self.groups) if validate else ()
        if cuda_graphs and self.device.type != "cuda":
            raise EngineError(f"cuda_graphs: the pool is on {self.device}; graphs need CUDA")
        self.pad_decodes = cuda_graphs if pad_decodes is None else pad_decodes
        switch_mla_modules(model)  # a latent pool's attention, on every device
        if cuda_graphs:
            make_capturable(model)
        if self.device.type == "cuda":  # a launch where transformers runs a dozen
            fuse_model(model)
        self.step = DeviceStep(model, self.groups, self.rows,
                               max_draft_len=layout.max_draft_len,
                               stop_token_ids=self.stop_token_ids,
                               drafter=self.device_drafter,
                               commits=tuple(_own_commit(g, self.pool.writer_fence)
                                             for g in self.groups) if client.overlap else (),
                               validators=self.validators,
                               graphs=DecodeGraphs() if cuda_graphs else None,
                               pad_batches=self.pad_decodes, own_table=client.own_table)
        if self.step.graphs is not None:  # none evicted by another while serving
            self.step.graphs.make_room(len(self._decode_shapes()))
        self.planner = StepPlanner(layout, draft_len,
                                   drafter if self.device_drafter is None else None,
                                   self.pad_decodes, share_prefixes)
        self.stats = RunStats()
        self.clock = DeviceClock(self.stats)

    @staticmethod
    def _check_layout(model: PreTrainedModel, layout: wire.PoolLayout,
                      staging_dtype: torch.dtype) -> None:
        """Every field in which the pool does not fit the model at once, with the `kvalloc
        serve` flags of a pool that would (a worker learns nothing more from a second try)."""
        tp = layout.tensor_parallel
        layers, heads, head_dim = kv_shape(model.config)
        dtype = str(model.dtype).removeprefix("torch.")
        # A tensor-parallel pool's shard, like the model's, holds its share of the KV heads.
        fields = [("num_layers", layout.num_layers, layers),
                  ("num_kv_heads", layout.num_kv_heads // tp, heads),
                  ("head_dim", layout.head_dim, head_dim)]
        fields.append(("kv_layout", layout.kv_layout, kv_layout(model.config)))
        latent = kv_layout(model.config) == "latent"
        wrong = [f"{name}: the pool has {have}, the model needs {want}"
                 for name, have, want in fields if have != want]
        if layout.dtype == "fp8_e4m3":
            wrong.append(f"dtype: the pool is fp8, which the worker does not support; the "
                         f"model runs in {dtype}")
        elif model.dtype != staging_dtype:
            wrong.append(f"dtype: the pool stages {staging_dtype}, the model runs in "
                         f"{model.dtype}")
        if layout.groups:
            wrong += groups_mismatch(layout.groups, layer_windows(model.config))
        else:
            wrong += _window_mismatch(model.config, layout.window)
        if wrong:
            # Imported here: the serve command's flags, spelled as it parses them, matter only
            # to a worker being refused.
            from kvalloc.server.serve_arguments import layer_group_flag

            window = pool_window(model.config)
            groups = " ".join(layer_group_flag(g) for g in model_groups(
                model.config, num_blocks=layout.num_blocks))
            raise LayoutMismatch(
                f"{'; '.join(wrong)}. A pool for this model: kvalloc serve --num-layers "
                f"{layers} --num-kv-heads {heads * tp} --head-dim {head_dim} --dtype {dtype}"
                f"{' --kv-layout latent' if latent else ''}"
                f"{f' --window {window}' if window is not None else ''}"
                f"{f' --tensor-parallel {tp}' if tp > 1 else ''}"
                f"{f' {groups} (or without them: one pool of every layer)' if groups else ''}")

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
        requests = [new_request(p, max_new_tokens, vocab_size=self.model.config.vocab_size,
                                max_seq_len=self.max_seq_len) for p in prompts]
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
            plan = self.planner.plan(waiting, live, results)
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
                # Refused with nothing else running, for want of blocks (requests preempted in
                # this call wait to come back: they were not refused).
                refused = reply.refused
                if not live and refused.of_kind("new").size and not refused.onboarding():
                    raise PoolTooSmall(f"prompt {waiting[0].req_id!r} ({waiting[0].tokens.size} "
                                       f"tokens) was refused with nothing else running: the "
                                       f"pool is too small for it")
            self.stats.count_step(time.perf_counter() - step_started, call_s,
                                  decode_only=not (plan.prefilling or plan.new))
        for flight in flights:  # forwards past every request's end: nothing to emit
            self._read(flight, on_progress)
        self.step.flush_table()  # the last calls' changes, which no launch carried
        if self.validators:
            self.stats.table_violations = sum(v.count() for v in self.validators)
        if self.step.commits:  # every group commits the same tokens
            self.stats.committed_tokens = int(self.step.commits[0].committed)
            self.stats.refused_tokens = sum(c.refused for c in self.step.commits)
        if self.step.graphs is not None:
            self.stats.graph_replays = self.step.graphs.replayed
            self.stats.graphs_captured = self.step.graphs.captured
        return {r.req_id: r.output for r in requests}

    def _admit(self, reply: StepResult, plan: StepPlan, waiting: deque[Request],
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
        rows = int64s(row_of[r.handle] for r in admitted)
        truth = (self.device_drafter.truth_rows([r.req_id for r in admitted])
                 if self.device_drafter is not None else None)
        self.rows.admit(rows, int64s(len(r.output) for r in admitted),
                        int64s(r.max_new_tokens for r in admitted), truth)

    def _launch(self, call: dict[str, Any], reply: StepResult, scheduled: list[Request],
                ahead: bool, on_step: Callable[[StepRecord], None] | None) -> _Flight:
        """Check the reply against what the worker planned and launch the step's forward;
        ``ahead``: an earlier step's outcome is still unread."""
        plan, emitting = launch_plan(reply, scheduled)
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

    def _read(self, flight: _Flight | None,
              on_progress: Callable[[int], None] | None) -> list[tuple[Request, int]]:
        """Apply a launched step's outcome to its requests; returns the results it settles:
        (request, accepted drafts) of its decodes."""
        if flight is None:
            return []
        tokens, emitted, accepted = flight.launched.outcome()
        self.clock.add(flight.launched)
        stop, done = self.stop_token_ids, []
        # One conversion of the step's tokens: slicing Python lists row by row is cheap.
        for r, row, n in zip(flight.requests, tokens.tolist(), emitted.tolist(), strict=True):
            r.unread -= 1
            if n:  # else it had ended already: a wasted forward
                output = r.output
                output.extend(row[:n])
                r.done = r.remaining == 0 or output[-1] in stop
            done.append(r.done)
        plan, stats = flight.launched.plan, self.stats
        settled = plan.decode & (emitted > 0)
        # Draft i proposes emitted token i: past a request's last token it proposes nothing
        # the request needed (an overlap worker drafts before it knows the end).
        proposed = np.where(done, np.minimum(plan.drafts, emitted), plan.drafts)[settled]
        stats.proposed_drafts += int(proposed.sum())
        stats.accepted_drafts += int(np.minimum(accepted[settled], proposed).sum())
        results = [(r, a) for r, a, s in zip(flight.requests, accepted.tolist(),
                                              settled.tolist(), strict=True) if s]
        generated = int(emitted.sum())
        stats.generated_tokens += generated
        if on_progress is not None:
            on_progress(generated)
        return results


def _window_mismatch(config: Any, window: int | None) -> list[str]:
    """Why a pool that gives back the blocks behind ``window`` cannot serve the model: a layer
    that reads further back (a full-attention one, or a wider window) would read blocks
    released to other requests. Nothing for a full-attention pool."""
    wider = [(i, w) for i, w in enumerate(layer_windows(config)) if reads_further(w, window)]
    if not wider:
        return []
    i, w = wider[0]
    reads = "its whole history" if w is None else f"a window of {w}"
    return [f"window: the pool gives back blocks behind a window of {window}, but layer {i} "
            f"of the model reads {reads}" + (f" ({len(wider)} layers read further)"
                                              if len(wider) > 1 else "")]


@dataclass(frozen=True)
class _Flight:
    """A launched step and the request of each of its emitting entries."""

    launched: Launched
    requests: list[Request]


def _own_commit(group: PoolGroup, fence: WriterFence | None) -> PackedCommit:
    """An overlap worker's own commit into one group of its pool: the library's, fenced by its
    session (one fence for every group)."""
    layers, planes, blocks, tokens_per_block, heads, dim = group.kv.shape
    return PackedCommit(group.kv.view(layers, planes, blocks * tokens_per_block, heads * dim),
                        group.staging.view(layers, planes, group.staging.shape[2], heads * dim),
                        tokens_per_block, protected=group.protected, fence=fence)
