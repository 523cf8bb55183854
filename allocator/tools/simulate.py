"""`kvalloc simulate`: a step-level model of an overlap scheduler running one-model MTP.

The host side is the real `KVCacheManager`: every iteration is one batched ``step`` that
settles the results it has heard of, frees finished requests and grants this step. The device
side plays the timeline (`StepPlan.lag`): each granted forward runs right after the call that
granted it, from the device's own position, and accepts a sampled number of its drafts; the host
hears that count ``lag`` calls later. At lag 1 that is the next call, before the next grant, so
the device is never ahead of the host's history. At lag 2 a grant finds the previous step
unsettled, and the device is ahead by the 1 + accepted of every forward the host has not heard
of. docs/design.md's write reach is then::

    reach = device position + 1 + D

A forward writes positions ``position .. position + D``; one at or past blocks *
tokens_per_block lands on a -1 block-table entry: the illegal memory access. Every forward still
in flight is checked after every call, so a later call that takes its blocks away counts too. A
grant that needs more than ``max_blocks_per_seq`` blocks is the row overflow.

The slack policy reproduces the two production crashes on purpose: at lag 2 ``none`` -> IMA at
a block boundary, ``unreclaimed`` -> row overflow, while ``reclaim`` runs clean. At lag 1 results
come before the next grant, so no slack is needed: ``none`` runs clean too.

``--window W`` models the seed's crash in its own model class: every layer attends over a
sliding window of W tokens (DeepSeek-V4's MLA latent cache with a window; Mistral), so the pool
is one windowed group (`capacity.windows`) whose rows give back the blocks behind every window.
A forward then touches the columns from its window's first key, ``start - W + 1``, to its reach,
and one of them that is not a block (-1 past the row's blocks, or `RELEASED` behind the window)
is the IMA. With the default prompt, 8 tokens short of a block boundary, and W a multiple of the
block size, the window's first key crosses a block boundary within a step of the writes
(``first_window_crossing``: the call that launched the first forward whose window starts a block
later); under ``none`` the IMA comes there, as in production; ``unreclaimed`` overflows the row
as under full attention; ``reclaim`` runs clean while each request holds its window's blocks and
no more (``max_decode_blocks``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from kvalloc.allocator.capacity.manager import KVCacheManager, StepPlan
from kvalloc.allocator.capacity.step.plan import LAGS
from kvalloc.allocator.commands.arguments import bounded, output_file
from kvalloc.allocator.commands.config_errors import reasons
from kvalloc.allocator.commands.interrupt import INTERRUPTED, StopRequest, sigint_stops
from kvalloc.allocator.commands.simulated_acceptance import Acceptance
from kvalloc.allocator.config import PoolConfig, SlackPolicy
from kvalloc.allocator.errors import BlockTableOverflow, InvariantViolation, OutOfBlocks
from kvalloc.allocator.tools.simulate_plot import plot
from kvalloc.allocator.tools.simulate_prefix import SharingSpec, simulate_sharing
from kvalloc.allocator.tools.simulate_prefix import summary as sharing_summary
from kvalloc.allocator.tools.simulate_result import Failure, SimulationResult
from pydantic import ValidationError

# The production case: a 128k prompt that ends 8 tokens before a 256-token block boundary, so
# the first MTP3 steps' writes straddle it.
DEFAULT_ISL = 128 * 1024 - 8


@dataclass
class SimulationSpec:
    isl: int = DEFAULT_ISL
    osl: int = 1024
    draft_len: int = 3
    acceptance: Acceptance = field(default_factory=lambda: Acceptance("geometric", 0.7))
    tokens_per_block: int = 256
    num_requests: int = 1
    num_blocks: int | None = None
    seed: int = 0
    policy: SlackPolicy = SlackPolicy.RECLAIM
    overlap: bool = True
    lag: int = 2
    progress: bool = False
    window: int | None = None

    def __post_init__(self) -> None:
        if self.lag not in LAGS:
            raise ValueError(f"lag {self.lag} is not one of {LAGS}")
        if not self.overlap and self.lag != 1:
            # Without overlap the host waits for a step's results before the next one.
            raise ValueError("a scheduler without overlap runs at lag 1")

    def pool_config(self) -> PoolConfig:
        slack = self.draft_len if self.overlap else 0
        per_seq = -(-(self.isl + self.osl + self.draft_len + 1 + slack) // self.tokens_per_block)
        return PoolConfig(
            num_blocks=self.num_blocks or per_seq * self.num_requests,
            tokens_per_block=self.tokens_per_block, num_layers=1, num_kv_heads=1, head_dim=1,
            device="cpu", max_batch_size=self.num_requests, max_seq_len=self.isl + self.osl,
            max_draft_len=self.draft_len, overlap_scheduler=self.overlap,
            slack_policy=self.policy, window=self.window,
        )


def simulate(spec: SimulationSpec, stop: Callable[[], bool] = lambda: False) -> SimulationResult:
    """Run every request from prefill to ``osl`` output tokens or the first row overflow, or
    until ``stop()`` says so between two steps (the result is then the steps run so far)."""
    timeline = Timeline(spec)
    # Every step commits at least one token, and the last one's results come `lag` calls on.
    max_steps = spec.osl + spec.lag
    progress = _progress(max_steps, spec.progress)
    for step in range(1, max_steps + 1):
        if stop() or not timeline.call(step):
            break
        progress.update(1)
    progress.close()
    return timeline.finish()


@dataclass
class Forward:
    """One granted forward as the simulated device ran it."""

    draft: int
    start: int  # the device's position when it began: it writes start .. start + draft
    accepted: int  # drafts the device kept; the host hears of them `lag` calls later
    due: int  # the call whose plan reports them

    @property
    def reach(self) -> int:
        return self.start + 1 + self.draft


class Timeline:
    """The host's calls to the real manager and a device that runs each granted forward at once.

    The device's position is its own: it advances by 1 + accepted when a forward runs, and the
    host only learns the accepted count ``lag`` calls later (``StepPlan.result_rows``), so at
    lag 2 the device is ahead of the host's history by every forward still unsettled.
    """

    def __init__(self, spec: SimulationSpec) -> None:
        self.spec = spec
        self.manager = KVCacheManager(spec.pool_config())
        self.rng = np.random.default_rng(spec.seed)
        n = spec.num_requests
        admitted = self.manager.step(StepPlan(prompt_lens=np.full(n, spec.isl, dtype=np.int64)))
        self.rows = admitted.admitted_rows  # request i lives in rows[i] (-1: not admitted)
        self.request_of = {int(row): i for i, row in enumerate(self.rows.tolist()) if row >= 0}
        self.live = [i for i in range(n) if self.rows[i] >= 0]
        # The device's own count of kept tokens, ahead of the host's history at lag 2.
        self.position = {r: spec.isl for r in self.live}
        self.forwards: dict[int, list[Forward]] = {r: [] for r in self.live}  # oldest first
        self.output = dict.fromkeys(self.live, 0)  # tokens the host has settled per request
        self._window_block: dict[int, int] = {}  # the block its last forward's window starts in
        self.result = SimulationResult(
            policy=spec.policy.value, lag=spec.lag, steps=0, requests_finished=0,
            requests_total=n, output_tokens=0, grants_refused=0, grants_behind=0,
            max_capacity_minus_history=0,
            max_blocks_per_seq=self.manager.max_blocks_per_seq,
            tokens_per_block=spec.tokens_per_block, window=spec.window,
            trace={k: [] for k in ("capacity", "history", "reach", "allocated")},
        )

    def call(self, step: int) -> bool:
        """One batched step; False when nothing is left to run (or a row overflowed)."""
        results = [r for r in self.live if self.forwards[r] and self.forwards[r][0].due == step]
        for r in results:
            self.output[r] += 1 + self.forwards[r][0].accepted
        done = {r for r in self.live if self.output[r] >= self.spec.osl}
        # A done request waits for its last forward's results: freeing its blocks while that
        # forward still writes would be a write into another request's blocks.
        finished = [r for r in done if len(self.forwards[r]) - (r in results) == 0]
        grants = [r for r in self.live if r not in done]
        accepted = [self.forwards[r][0].accepted for r in results]
        plan = StepPlan(result_rows=self.rows[results], num_accepted=accepted,
                        finished_rows=self.rows[finished], grant_rows=self.rows[grants],
                        draft_lens=np.full(len(grants), self.spec.draft_len, dtype=np.int64),
                        lag=self.spec.lag)
        try:
            outcome = self.manager.step(plan)
        except BlockTableOverflow as exc:
            who = self.request_of[exc.row]
            self.result.first_row_overflow = self._failure(step, who, self._reach(who))
            return False
        self.result.steps = step
        self.result.requests_finished += len(finished)
        for r in results:
            self.forwards[r].pop(0)
        self.live = [r for r in self.live if r not in finished]
        self._launch(step, grants, outcome.granted.tolist(), outcome.grant_starts.tolist())
        self._check_writes(step)
        self._watch_window(step)
        self.result.max_capacity_minus_history = max(
            self.result.max_capacity_minus_history,
            self.manager.totals()["max_uncommitted_tokens"])
        return bool(self.live)

    def _launch(self, step: int, grants: list[int], granted: list[bool],
                starts: list[int]) -> None:
        """Each granted forward runs now, from the device's position, whatever the host knows."""
        for r, ok, start in zip(grants, granted, starts, strict=True):
            if not ok:
                self.result.grants_refused += 1
                continue
            # The host places the forward short of the device by exactly the drafts it has not
            # heard of; anything else is a manager whose timeline disagrees with the device's.
            unheard = sum(f.accepted for f in self.forwards[r])
            if start + unheard != self.position[r]:
                raise InvariantViolation(f"request {r}: grant_starts {start} + {unheard} unheard "
                                         f"drafts is not the device's position {self.position[r]}")
            self.result.grants_behind += bool(self.forwards[r])
            accepted = int(self.spec.acceptance.sample(self.rng, self.spec.draft_len, 1)[0])
            self.forwards[r].append(Forward(self.spec.draft_len, self.position[r],
                                            accepted, step + self.spec.lag))
            self.position[r] += 1 + accepted
            if r == 0:
                f = self._failure(step, r, self.forwards[r][-1].reach)
                for key, value in (("capacity", f.capacity), ("history", f.history),
                                   ("reach", f.reach), ("allocated", f.allocated_tokens)):
                    self.result.trace[key].append(value)

    def _check_writes(self, step: int) -> None:
        """Every forward still in flight, this call's and older ones, against the blocks and
        capacity its row holds now: a later call must not take away what it writes (nor, under
        a window, what it reads)."""
        for r in self.live:
            for forward in self.forwards[r]:
                f = self._failure(step, r, forward.reach)
                if self.result.first_ima is None and (f.reach > f.allocated_tokens
                                                      or not self._reads_blocks(r, forward)):
                    self.result.first_ima = f
                if f.reach > f.capacity and self.result.first_reach_past_capacity is None:
                    self.result.first_reach_past_capacity = f

    def _reads_blocks(self, req: int, forward: Forward) -> bool:
        """Whether every column from the window's first key to the forward's first position
        holds a block (always, under full attention: nothing is given back)."""
        if self.spec.window is None:
            return True
        tpb = self.spec.tokens_per_block
        first = max(0, forward.start - self.spec.window + 1) // tpb
        row = self.manager.table.host[int(self.rows[req])]
        return bool((row[first : forward.start // tpb + 1] >= 0).all())

    def _watch_window(self, step: int) -> None:
        """The first call that launched a forward whose window starts a block later than the
        request's previous forward's (its window crossed a block boundary), and the most blocks
        a request holds once its window gave blocks back."""
        if self.spec.window is None:
            return
        tpb, rows = self.spec.tokens_per_block, self.manager.rows
        for r in self.live:
            if self.forwards[r]:
                first = max(0, self.forwards[r][-1].start - self.spec.window + 1) // tpb
                if (self.result.first_window_crossing is None
                        and first > self._window_block.get(r, first)):
                    self.result.first_window_crossing = step
                self._window_block[r] = first
            row = int(self.rows[r])
            if rows.released[row]:
                held = int(rows.num_blocks[row] - rows.released[row])
                self.result.max_decode_blocks = max(self.result.max_decode_blocks, held)

    def _reach(self, req: int) -> int:
        """The reach of the forward the request would run next."""
        return self.position[req] + 1 + self.spec.draft_len

    def _failure(self, step: int, req: int, reach: int) -> Failure:
        view = self.manager.view(int(self.rows[req]))
        return Failure(step=step, request=req, reach=reach, capacity=view.capacity,
                       allocated_tokens=view.num_blocks * self.manager.tokens_per_block,
                       history=view.history)

    def finish(self) -> SimulationResult:
        self.result.output_tokens = sum(self.output.values())
        self.manager.check_invariants()
        return self.result


class _NoProgress:
    def update(self, _n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc="steps", unit="step", file=sys.stderr, leave=False)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SimulationSpec()
    p.add_argument("--isl", type=bounded(int, 1), default=d.isl, help="prompt length (tokens)")
    p.add_argument("--osl", type=bounded(int, 1), default=d.osl, help="output tokens per request")
    p.add_argument("--draft-len", type=bounded(int, 0), default=d.draft_len,
                   help="MTP draft length D")
    p.add_argument("--acceptance", type=Acceptance.parse, default=d.acceptance,
                   help="geometric:P | fixed:K | uniform (default geometric:0.7)")
    p.add_argument("--tokens-per-block", type=bounded(int, 1), default=d.tokens_per_block,
                   help="token slots per KV block")
    p.add_argument("--num-requests", type=bounded(int, 1), default=d.num_requests,
                   help="requests decoded side by side")
    p.add_argument("--num-blocks", type=bounded(int, 1), default=None,
                   help="pool size (default: max_blocks_per_seq per request)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed of the acceptance")
    p.add_argument("--policy", choices=[x.value for x in SlackPolicy], default=d.policy.value,
                   help="overlap slack: reclaim (correct), none (reproduces the IMA), "
                        "unreclaimed (reproduces the row overflow)")
    p.add_argument("--lag", type=int, choices=LAGS, default=None,
                   help="calls between a step's grant and its results: 2, the overlap "
                        "scheduler's timeline (default; 1 with --no-overlap), or 1")
    p.add_argument("--no-overlap", action="store_true",
                   help="model a non-overlap scheduler (lag 1, no slack)")
    p.add_argument("--window", type=bounded(int, 1), default=None, metavar="TOKENS",
                   help="every layer attends over a sliding window of this many tokens (the "
                        "seed's model class: an MLA latent cache with a window): blocks behind "
                        "it go back to the pool, and a forward's reads count for the IMA too; "
                        "with --shared-prefix, a hit needs only the cached blocks its window "
                        "reads")
    p.add_argument("--json", type=output_file, help="write the JSON summary here (also printed)")
    p.add_argument("--plot", type=output_file,
                   help="write a PNG of capacity/history/reach per step")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    share = p.add_argument_group("shared-prefix workload (prefix caching; --isl is unused)")
    share.add_argument("--shared-prefix", type=bounded(int, 1), metavar="TOKENS",
                       help="run conversations that share a system prompt of this many tokens "
                            "and report the prefix-cache hit rate")
    share.add_argument("--conversations", type=bounded(int, 1), default=32,
                       help="conversations (default 32)")
    share.add_argument("--turns", type=bounded(int, 1), default=3,
                       help="turns per conversation, each continuing the last (default 3)")


def run(args: argparse.Namespace) -> int:
    if args.shared_prefix is not None:
        return _run_sharing(args)
    if args.no_overlap and args.lag == 2:
        print("kvalloc simulate: error: --no-overlap --lag 2: a scheduler without overlap "
              "waits for each step's results (lag 1)", file=sys.stderr)
        return 2
    spec = SimulationSpec(
        isl=args.isl, osl=args.osl, draft_len=args.draft_len, acceptance=args.acceptance,
        tokens_per_block=args.tokens_per_block, num_requests=args.num_requests,
        num_blocks=args.num_blocks, seed=args.seed, policy=SlackPolicy(args.policy),
        overlap=not args.no_overlap, lag=args.lag or (1 if args.no_overlap else 2),
        window=args.window,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    try:
        spec.pool_config()
    except ValidationError as exc:  # flags that make no pool, e.g. too few --num-blocks
        print(f"kvalloc simulate: error: {reasons(exc)}", file=sys.stderr)
        return 2
    with sigint_stops() as stop:
        result = simulate(spec, stop)
    _report({**result.summary(), **_interrupted(stop)}, args)
    if args.plot:
        plot(result, args.plot)
    if stop.requested:
        return INTERRUPTED
    return 1 if result.failed else 0


def _interrupted(stop: StopRequest) -> dict[str, bool]:
    """The summary's mark of a run Ctrl-C cut short: its figures cover the steps it ran."""
    return {"interrupted": True} if stop.requested else {}


def _report(summary: dict, args: argparse.Namespace) -> None:
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


def _run_sharing(args: argparse.Namespace) -> int:
    spec = SharingSpec(conversations=args.conversations, turns=args.turns,
                       system_len=args.shared_prefix, osl=args.osl,
                       tokens_per_block=args.tokens_per_block,
                       num_blocks=args.num_blocks or SharingSpec.num_blocks, seed=args.seed,
                       window=args.window)
    try:
        with sigint_stops() as stop:
            result = simulate_sharing(spec, stop)
    except (ValidationError, OutOfBlocks) as exc:
        message = reasons(exc) if isinstance(exc, ValidationError) else str(exc)
        print(f"kvalloc simulate: error: {message}", file=sys.stderr)
        return 2
    _report({**sharing_summary(result), **_interrupted(stop)}, args)
    return INTERRUPTED if stop.requested else 0
