"""`kvalloc simulate`: a step-level model of an overlap scheduler running one-model MTP.

The host side is the real `KVCacheManager`: every iteration is one batched ``step`` that settles
the previous step (``update_resources`` with its accepted count), frees finished requests and
grants this step (``try_allocate_generation``). The device side is a model of where the forward
writes, following docs/design.md's write-reach formula::

    reach = history + uncommitted + 1 + D

Under the overlap scheduler the device runs one step ahead of the host's bookkeeping, so the
accepted drafts of the previous step are already part of the device's KV position (``uncommitted``,
at most D) when this step writes. A write at a position >= blocks * tokens_per_block lands on a
-1 block-table entry: the illegal memory access. A grant that needs more than
``max_blocks_per_seq`` blocks is the row overflow.

The slack policy reproduces the two production crashes on purpose: ``none`` -> IMA at a block
boundary, ``unreclaimed`` -> row overflow; ``reclaim`` runs clean.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import numpy as np
from pydantic import ValidationError

from allocator.capacity.manager import KVCacheManager, StepPlan
from allocator.config import PoolConfig, SlackPolicy
from allocator.errors import BlockTableOverflow, OutOfBlocks
from allocator.tools.arguments import bounded, output_file
from allocator.tools.simulate_plot import plot
from allocator.tools.simulate_prefix import SharingSpec, simulate_sharing
from allocator.tools.simulate_prefix import summary as sharing_summary

# The production case: a 128k prompt that ends 8 tokens before a 256-token block boundary, so
# the first MTP3 steps' writes straddle it.
DEFAULT_ISL = 128 * 1024 - 8


@dataclass
class Acceptance:
    """Per-step accepted-draft sampler: ``geometric:P`` (each position accepted with probability
    P until the first rejection), ``fixed:K``, or ``uniform`` (0..D equally likely)."""

    kind: str
    value: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Acceptance:
        kind, _, arg = spec.partition(":")
        if kind == "uniform" and not arg:
            return cls("uniform")
        try:
            value = float(arg)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--acceptance: {spec!r} is not geometric:P, fixed:K or uniform") from None
        if kind == "geometric" and 0.0 <= value <= 1.0:
            return cls(kind, value)
        if kind == "fixed" and value >= 0 and value == int(value):
            return cls(kind, value)
        raise argparse.ArgumentTypeError(
            f"--acceptance: {spec!r} is not geometric:P (0<=P<=1), fixed:K (K>=0) or uniform")

    def sample(self, rng: np.random.Generator, draft_len: int, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, min(int(self.value), draft_len), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(0, draft_len + 1, size=n)
        hits = rng.random((n, draft_len)) < self.value
        return np.cumprod(hits, axis=1).sum(axis=1).astype(np.int64)


@dataclass
class Failure:
    step: int
    request: int
    reach: int
    capacity: int
    allocated_tokens: int
    history: int


@dataclass
class SimulationResult:
    policy: str
    steps: int
    requests_finished: int
    requests_total: int
    output_tokens: int
    grants_refused: int
    max_capacity_minus_history: int
    first_ima: Failure | None = None
    first_reach_past_capacity: Failure | None = None
    first_row_overflow: Failure | None = None
    max_blocks_per_seq: int = 0
    tokens_per_block: int = 0
    trace: dict[str, list[int]] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.first_ima is not None or self.first_row_overflow is not None

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("trace")
        out["failed"] = self.failed
        return out


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
    progress: bool = False

    def pool_config(self) -> PoolConfig:
        slack = self.draft_len if self.overlap else 0
        per_seq = -(-(self.isl + self.osl + self.draft_len + 1 + slack) // self.tokens_per_block)
        return PoolConfig(
            num_blocks=self.num_blocks or per_seq * self.num_requests,
            tokens_per_block=self.tokens_per_block, num_layers=1, num_kv_heads=1, head_dim=1,
            device="cpu", max_batch_size=self.num_requests, max_seq_len=self.isl + self.osl,
            max_draft_len=self.draft_len, overlap_scheduler=self.overlap,
            slack_policy=self.policy,
        )


def simulate(spec: SimulationSpec) -> SimulationResult:
    """Run every request from prefill to ``osl`` output tokens or the first row overflow."""
    manager = KVCacheManager(spec.pool_config())
    rng = np.random.default_rng(spec.seed)
    n, d, tpb = spec.num_requests, spec.draft_len, spec.tokens_per_block
    admitted = manager.step(StepPlan(prompt_lens=np.full(n, spec.isl, dtype=np.int64)))
    rows = admitted.admitted_rows  # request i lives in rows[i] (-1: not admitted)
    request_of = {int(row): i for i, row in enumerate(rows.tolist()) if row >= 0}
    result = SimulationResult(
        policy=spec.policy.value, steps=0, requests_finished=0, requests_total=n,
        output_tokens=0, grants_refused=0, max_capacity_minus_history=0,
        max_blocks_per_seq=manager.max_blocks_per_seq, tokens_per_block=tpb,
        trace={k: [] for k in ("capacity", "history", "reach", "allocated")},
    )
    live = [i for i in range(n) if rows[i] >= 0]
    in_flight: dict[int, int] = {}  # request -> accepted drafts of its last forward
    finished_tokens = 0
    max_steps = spec.osl + 1  # every step commits at least one token
    progress = _progress(max_steps, spec.progress)
    for step in range(1, max_steps + 1):
        results = list(in_flight)
        accepted = [in_flight[r] for r in results]
        produced = {r: manager.view(int(rows[r])).history + 1 + a - spec.isl
                    for r, a in zip(results, accepted, strict=True)}
        done = [r for r, out in produced.items() if out >= spec.osl]
        grants = [r for r in live if r not in done]
        plan = StepPlan(result_rows=rows[results], num_accepted=accepted,
                        finished_rows=rows[done], grant_rows=rows[grants],
                        draft_lens=np.full(len(grants), d, dtype=np.int64))
        try:
            outcome = manager.step(plan)
        except BlockTableOverflow as exc:
            who = request_of[exc.row]
            result.first_row_overflow = _failure(manager, step, who, int(rows[who]),
                                                 in_flight.get(who, 0), d)
            break
        result.steps = step
        result.requests_finished += len(done)
        finished_tokens += sum(produced[r] for r in done)
        live = grants
        if not live:
            break
        lead = in_flight if spec.overlap else {}
        in_flight = {}
        for r, ok in zip(grants, outcome.granted.tolist(), strict=True):
            if not ok:
                result.grants_refused += 1
                continue
            f = _failure(manager, step, r, int(rows[r]), lead.get(r, 0), d)
            if f.reach > f.allocated_tokens and result.first_ima is None:
                result.first_ima = f
            if f.reach > f.capacity and result.first_reach_past_capacity is None:
                result.first_reach_past_capacity = f
            if r == 0:
                for key, value in (("capacity", f.capacity), ("history", f.history),
                                   ("reach", f.reach), ("allocated", f.allocated_tokens)):
                    result.trace[key].append(value)
            in_flight[r] = int(spec.acceptance.sample(rng, d, 1)[0])
        result.max_capacity_minus_history = max(
            result.max_capacity_minus_history, manager.totals()["max_uncommitted_tokens"])
        progress.update(1)
    progress.close()
    result.output_tokens = finished_tokens + sum(
        manager.view(row).history - spec.isl for row in manager.live_rows.tolist())
    manager.check_invariants()
    return result


def _failure(manager: KVCacheManager, step: int, req: int, row: int, uncommitted: int,
             draft_len: int) -> Failure:
    view = manager.view(row)
    return Failure(
        step=step, request=req, reach=view.history + uncommitted + 1 + draft_len,
        capacity=view.capacity,
        allocated_tokens=view.num_blocks * manager.tokens_per_block, history=view.history,
    )


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
    p.add_argument("--no-overlap", action="store_true", help="model a non-overlap scheduler")
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
    spec = SimulationSpec(
        isl=args.isl, osl=args.osl, draft_len=args.draft_len, acceptance=args.acceptance,
        tokens_per_block=args.tokens_per_block, num_requests=args.num_requests,
        num_blocks=args.num_blocks, seed=args.seed, policy=SlackPolicy(args.policy),
        overlap=not args.no_overlap, progress=not args.no_progress and sys.stderr.isatty(),
    )
    try:
        spec.pool_config()
    except ValidationError as exc:  # flags that make no pool, e.g. too few --num-blocks
        print(f"kvalloc simulate: error: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    result = simulate(spec)
    text = json.dumps(result.summary(), indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if args.plot:
        plot(result, args.plot)
    return 1 if result.failed else 0


def _run_sharing(args: argparse.Namespace) -> int:
    spec = SharingSpec(conversations=args.conversations, turns=args.turns,
                       system_len=args.shared_prefix, osl=args.osl,
                       tokens_per_block=args.tokens_per_block,
                       num_blocks=args.num_blocks or SharingSpec.num_blocks, seed=args.seed)
    try:
        result = simulate_sharing(spec)
    except (ValidationError, OutOfBlocks) as exc:
        message = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        print(f"kvalloc simulate: error: {message}", file=sys.stderr)
        return 2
    text = json.dumps(sharing_summary(result), indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0
