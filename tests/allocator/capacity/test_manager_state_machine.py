"""A hypothesis state machine over random interleavings of every `KVCacheManager` method.

Rules drive the manager with random draft lengths D in 0..max_draft_len, random acceptance,
CUDA-graph padding, skipped forwards (reverts), chunked prefill, frees, small pools that run out of
blocks and rows, and batched ``step(StepPlan(...))`` calls (requests named by row) mixing every
kind of entry. Requests admitted by a batched step have no id: the per-request rules act on the
requests added by id, the batched step on all of them. Next to the
manager runs `Spec`, a plain-Python model of the design's accounting table (one request at a time,
no numpy): after every rule the manager must agree with it exactly (capacity, history, pending
slack and draft, blocks, free blocks, which calls are refused or raise), and independently:

- blocks are conserved (free + owned == total) and no block is owned twice;
- each live row holds valid ids in [0, num_blocks) and -1 beyond, free rows are all -1, and the
  device copy equals the host mirror;
- history <= capacity;
- write reach <= capacity for every pending forward: reach = history + u + 1 + D, where u is the
  request's accepted count of its previous step under overlap (the device runs that far ahead of
  the host's history) and 0 without overlap; the slots of those positions are real (not -1);
- under ``reclaim``: capacity - history <= 1 + 2 * max_draft_len;
- freeing everything returns the whole pool (teardown).

docs/design.md says the device runs "up to D" accepted-but-uncommitted tokens ahead: the slack of D
covers the previous step's u only when u <= D, so under overlap a grant's D is drawn from
[u, max_draft_len] (a scheduler with a fixed draft length always satisfies this).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvalloc.allocator import (
    BlockTableOverflow,
    KVCacheManager,
    OutOfBlocks,
    PoolConfig,
    StepPlan,
)


@dataclass
class Req:
    """Expected per-request state (tokens)."""

    prompt: int
    cap: int
    hist: int
    pending: bool = False
    draft: int = 0
    slack: int = 0
    granted: int = 0
    lead: int = 0  # accepted drafts of the last settled step (device lead under overlap)

    @property
    def prefilling(self) -> bool:
        return self.hist < self.prompt


class Spec:
    """docs/design.md's capacity accounting, written out per request."""

    def __init__(self, cfg: PoolConfig) -> None:
        self.tpb = cfg.tokens_per_block
        self.overlap = cfg.overlap_scheduler
        self.policy = cfg.slack_policy.value
        self.max_d = cfg.max_draft_len
        self.total = cfg.num_blocks
        self.max_batch = cfg.max_batch_size
        slack = self.max_d if self.overlap else 0
        self.row_blocks = -(-(cfg.max_seq_len + self.max_d + 1 + slack) // self.tpb)

    def blocks(self, cap: int) -> int:
        return -(-cap // self.tpb)

    def slack(self, d: int, lead: int) -> int:
        """D, or the device's lead (last accepted drafts) when D was shortened below it."""
        return max(d, lead) if self.overlap and self.policy != "none" else 0

    def grant(self, d: int, lead: int) -> int:
        return 1 + d + self.slack(d, lead)

    def overflows(self, cap: int) -> bool:
        return self.blocks(cap) > self.row_blocks

    def free_blocks(self, reqs: dict[str, Req]) -> int:
        return self.total - sum(self.blocks(r.cap) for r in reqs.values())

    # -- transitions (mutate ``r``)

    def do_grant(self, r: Req, d: int) -> None:
        r.cap += self.grant(d, r.lead)
        r.pending, r.draft, r.slack = True, d, self.slack(d, r.lead)
        r.granted = self.grant(d, r.lead)

    def padded_cap(self, r: Req, p: int) -> int:
        return r.cap + (p - r.draft) + (self.slack(p, r.lead) - r.slack)

    def do_pad(self, r: Req, p: int) -> None:
        new = self.padded_cap(r, p)
        r.granted += new - r.cap
        r.cap, r.draft, r.slack = new, p, self.slack(p, r.lead)

    def do_revert(self, r: Req) -> None:
        r.cap -= r.granted
        r.pending, r.draft, r.slack, r.granted = False, 0, 0, 0

    def do_update(self, r: Req, accepted: int) -> None:
        hist = r.hist + 1 + accepted
        reclaimed = r.slack if self.policy == "reclaim" else 0
        r.cap = max(r.cap - (r.draft - accepted) - reclaimed, hist)
        r.hist = hist
        r.pending, r.draft, r.slack, r.granted = False, 0, 0, 0
        r.lead = accepted


def apply_changes(host: np.ndarray, out) -> np.ndarray:
    """The block table a reader holding ``host`` rebuilds from a step's ``changed_*`` arrays."""
    table = host.copy()
    offset = 0
    for row, start, count in zip(out.changed_rows.tolist(), out.changed_from.tolist(),
                                 out.changed_num_blocks.tolist(), strict=True):
        table[row, start:count] = out.changed_block_ids[offset : offset + count - start]
        table[row, count:] = -1
        offset += count - start
    assert offset == out.changed_block_ids.size
    return table


@dataclass
class Plan:
    """A step's plan by request id, in `StepPlan`'s order."""

    reverts: list[str] = field(default_factory=list)
    result_ids: list[str] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    grant_ids: list[str] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    padding_ids: list[str] = field(default_factory=list)
    padded_draft_lens: list[int] = field(default_factory=list)
    prefill_ids: list[str] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    new_ids: list[str] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    first_chunks: list[int | None] = field(default_factory=list)
    strict_grants: bool = False

    def rows(self, row_of: dict[str, int]) -> StepPlan:
        def rows(ids: list[str]) -> np.ndarray:
            return np.array([row_of[i] for i in ids], dtype=np.int64)

        return StepPlan(
            revert_rows=rows(self.reverts), result_rows=rows(self.result_ids),
            num_accepted=self.num_accepted, finished_rows=rows(self.finished),
            grant_rows=rows(self.grant_ids), draft_lens=self.draft_lens,
            padding_rows=rows(self.padding_ids), padded_draft_lens=self.padded_draft_lens,
            prefill_rows=rows(self.prefill_ids), prefill_tokens=self.prefill_tokens,
            prompt_lens=self.prompt_lens, first_chunks=[c or 0 for c in self.first_chunks],
            strict_grants=self.strict_grants)


class ManagerMachine(RuleBasedStateMachine):
    CONFIG: ClassVar[dict] = {}
    COMPILED: ClassVar[bool | None] = None  # the manager's default: compiled when numba imports

    def __init__(self) -> None:
        super().__init__()
        self.cfg = PoolConfig(**{"num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                                 "device": "cpu", **self.CONFIG})
        self.m = KVCacheManager(self.cfg, compiled=self.COMPILED)
        self.spec = Spec(self.cfg)
        self.model: dict[str, Req] = {}
        self.rows: dict[str, int] = {}  # every live request's row
        self.named: set[str] = set()  # the requests added by id (add_request)
        self.serial = 0

    # ------------------------------------------------------------------ helpers

    def req_of_rows(self) -> list[str | None]:
        """The live request of each row (None: a free row)."""
        out: list[str | None] = [None] * self.spec.max_batch
        for req, row in self.rows.items():
            out[row] = req
        return out

    def new_id(self) -> str:
        self.serial += 1
        return f"r{self.serial}"

    def ids(self, kind: str, named: bool = True) -> list[str]:
        """Requests in state ``kind``; only those added by id unless ``named`` is False."""
        reqs = [k for k in self.model if not named or k in self.named]
        if kind == "prefilling":
            return [k for k in reqs if self.model[k].prefilling]
        if kind == "ready":
            return [k for k in reqs if not self.model[k].prefilling and not self.model[k].pending]
        if kind == "pending":
            return [k for k in reqs if self.model[k].pending]
        return reqs

    def draft_len(self, data, r: Req) -> int:
        """Any D, shorter than the previous step's too (dynamic speculation)."""
        return data.draw(st.integers(0, self.spec.max_d), label="draft_len")

    def free(self) -> int:
        return self.spec.free_blocks(self.model)

    # ------------------------------------------------------------------ per-request rules

    def prompt_len(self, data) -> int:
        """Any length, with extra weight near max_seq_len so rows fill up and overflow."""
        top = self.cfg.max_seq_len
        return data.draw(st.integers(1, top) | st.integers(max(1, top - 3), top),
                         label="prompt_len")

    @precondition(lambda self: len(self.model) < self.spec.max_batch)
    @rule(data=st.data())
    def add_request(self, data) -> None:
        prompt = self.prompt_len(data)
        first = data.draw(st.none() | st.integers(1, prompt), label="first_chunk")
        req = self.new_id()
        need = self.spec.blocks(first or prompt)
        if need > self.free():
            event("add_request: OutOfBlocks")
            with pytest.raises(OutOfBlocks):
                self.m.add_request(req, prompt, first_chunk=first)
        else:
            if first is None:
                row = self.m.add_request(req, prompt)
            else:
                row = self.m.add_request(req, prompt, first_chunk=first)
            self.model[req] = Req(prompt=prompt, cap=first or prompt, hist=first or prompt)
            self.rows[req] = row
            self.named.add(req)

    @precondition(lambda self: self.ids("prefilling"))
    @rule(data=st.data())
    def extend_prefill(self, data) -> None:
        req = data.draw(st.sampled_from(self.ids("prefilling")), label="req")
        r = self.model[req]
        n = data.draw(st.integers(1, r.prompt - r.hist), label="prefill_tokens")
        if self.spec.blocks(r.cap + n) - self.spec.blocks(r.cap) > self.free():
            event("extend_prefill: OutOfBlocks")
            with pytest.raises(OutOfBlocks):
                self.m.extend_prefill(req, n)
            return
        self.m.extend_prefill(req, n)
        r.cap += n
        r.hist += n

    @precondition(lambda self: self.ids("ready"))
    @rule(data=st.data(), site=st.sampled_from(["try_allocate_generation",
                                                "prepare_draft_resources"]))
    def grant(self, data, site: str) -> None:
        req = data.draw(st.sampled_from(self.ids("ready")), label="req")
        r = self.model[req]
        d = self.draft_len(data, r)
        new_cap = r.cap + self.spec.grant(d, r.lead)
        call = getattr(self.m, site)
        if self.spec.overflows(new_cap):
            event("grant: BlockTableOverflow")
            with pytest.raises(BlockTableOverflow):
                call(req, d)
            return
        fits = self.spec.blocks(new_cap) - self.spec.blocks(r.cap) <= self.free()
        event(f"{site}: {'granted' if fits else 'out of blocks'}")
        if site == "try_allocate_generation":
            assert call(req, d) is fits
        elif not fits:
            with pytest.raises(OutOfBlocks):
                call(req, d)
        else:
            call(req, d)
        if fits:
            self.spec.do_grant(r, d)

    @precondition(lambda self: self.ids("pending"))
    @rule(data=st.data())
    def extend_capacity_for_tokens(self, data) -> None:
        req = data.draw(st.sampled_from(self.ids("pending")), label="req")
        r = self.model[req]
        p = data.draw(st.integers(r.draft, self.spec.max_d), label="padded_draft_len")
        new_cap = self.spec.padded_cap(r, p)
        if self.spec.overflows(new_cap):
            event("padding: BlockTableOverflow")
            with pytest.raises(BlockTableOverflow):
                self.m.extend_capacity_for_tokens(req, p)
        elif self.spec.blocks(new_cap) - self.spec.blocks(r.cap) > self.free():
            event("padding: OutOfBlocks")
            with pytest.raises(OutOfBlocks):
                self.m.extend_capacity_for_tokens(req, p)
        else:
            self.m.extend_capacity_for_tokens(req, p)
            self.spec.do_pad(r, p)

    @precondition(lambda self: self.ids("pending"))
    @rule(data=st.data())
    def revert_allocate_generation(self, data) -> None:
        req = data.draw(st.sampled_from(self.ids("pending")), label="req")
        self.m.revert_allocate_generation(req)
        self.spec.do_revert(self.model[req])

    @precondition(lambda self: self.ids("pending"))
    @rule(data=st.data())
    def update_resources(self, data) -> None:
        req = data.draw(st.sampled_from(self.ids("pending")), label="req")
        r = self.model[req]
        a = data.draw(st.integers(0, r.draft), label="num_accepted")
        self.m.update_resources(req, a)
        self.spec.do_update(r, a)
        if self.spec.policy == "reclaim":
            assert self.m.capacity(req) - self.m.history(req) <= 1 + 2 * self.spec.max_d

    @precondition(lambda self: self.named)
    @rule(data=st.data())
    def free_request(self, data) -> None:
        req = data.draw(st.sampled_from(self.ids("all")), label="req")
        self.m.free(req)
        self.forget(req)

    def forget(self, req: str) -> None:
        del self.model[req]
        del self.rows[req]
        self.named.discard(req)

    # ------------------------------------------------------------------ the batched step

    @rule(data=st.data())
    def step(self, data) -> None:
        """A random mixed StepPlan; the model applies the design's rules in StepPlan's documented
        order: reverts, results, finished, then padding of earlier grants (never refused),
        this step's grants (plan order), prefill chunks, new requests; a grant that does not
        fit is refused, the rest are still served."""
        order = data.draw(st.permutations(self.ids("all", named=False)), label="order")
        plan = Plan()
        after = copy.deepcopy(self.model)  # state after reverts / results / finished
        spec = self.spec
        new_pad: dict[str, int] = {}
        for req in order:
            r = after[req]
            if r.prefilling:
                act = data.draw(st.sampled_from(["none", "prefill", "finish"]), label="act")
            elif r.pending:
                act = data.draw(st.sampled_from(
                    ["none", "revert", "result", "result+grant", "revert+grant", "pad",
                     "finish", "result+finish", "revert+finish", "result+grant+pad"]), label="act")
            else:
                act = data.draw(st.sampled_from(["none", "grant", "grant+pad", "finish"]),
                                label="act")
            if "revert" in act:
                plan.reverts.append(req)
                spec.do_revert(r)
            if "result" in act:
                a = data.draw(st.integers(0, r.draft), label="num_accepted")
                plan.result_ids.append(req)
                plan.num_accepted.append(a)
                spec.do_update(r, a)
            if "finish" in act:
                plan.finished.append(req)
            if "grant" in act:
                d = self.draft_len(data, r)
                plan.grant_ids.append(req)
                plan.draft_lens.append(d)
                if "pad" in act:
                    new_pad[req] = data.draw(st.integers(d, spec.max_d), label="padded")
            if act == "pad":
                plan.padding_ids.append(req)
                plan.padded_draft_lens.append(
                    data.draw(st.integers(r.draft, spec.max_d), label="padded"))
            if act == "prefill":
                plan.prefill_ids.append(req)
                plan.prefill_tokens.append(
                    data.draw(st.integers(1, r.prompt - r.hist), label="prefill_tokens"))
        for req, p in new_pad.items():  # padding of this step's own grants, in any order
            plan.padding_ids.append(req)
            plan.padded_draft_lens.append(p)
        for _ in range(data.draw(st.integers(0, 2), label="num_new")):
            prompt = self.prompt_len(data)
            plan.new_ids.append(self.new_id())
            plan.prompt_lens.append(prompt)
            plan.first_chunks.append(data.draw(st.none() | st.integers(1, prompt),
                                               label="first_chunk"))
        plan.strict_grants = data.draw(st.integers(0, 4), label="strict") == 0
        for req in plan.finished:
            del after[req]
        step_plan = plan.rows(self.rows)

        # Demands, in serving order: (kind, index, req, new capacity, blocks now).
        items = []
        for i, (req, p) in enumerate(zip(plan.padding_ids, plan.padded_draft_lens, strict=True)):
            if req not in new_pad:
                items.append(("pad", i, req, spec.padded_cap(after[req], p), after[req].cap))
        for i, (req, d) in enumerate(zip(plan.grant_ids, plan.draft_lens, strict=True)):
            r = after[req]
            items.append(("grant", i, req, r.cap + spec.grant(new_pad.get(req, d), r.lead),
                          r.cap))
        for i, (req, n) in enumerate(zip(plan.prefill_ids, plan.prefill_tokens, strict=True)):
            items.append(("prefill", i, req, after[req].cap + n, after[req].cap))
        for i, (prompt, first) in enumerate(zip(plan.prompt_lens, plan.first_chunks,
                                                strict=True)):
            items.append(("new", i, plan.new_ids[i], first or prompt, 0))

        if any(spec.overflows(new) for _, _, _, new, _ in items):
            event("step: BlockTableOverflow")
            with pytest.raises(BlockTableOverflow):
                self.m.step(step_plan)
            return
        left = spec.free_blocks(after)
        rows_left = spec.max_batch - len(after)
        served = {"grant": [False] * len(plan.grant_ids), "pad": [True] * len(plan.padding_ids),
                  "prefill": [False] * len(plan.prefill_ids), "new": [False] * len(plan.new_ids)}
        for kind, i, _, new, cur in items:
            need = spec.blocks(new) - spec.blocks(cur)
            if kind == "new" and rows_left == 0:  # a new request also needs a row
                continue
            served[kind][i] = need <= left
            if need <= left:
                left -= need
                rows_left -= kind == "new"
        if not all(served["pad"]) or (plan.strict_grants and not all(served["grant"])):
            event("step: OutOfBlocks")
            with pytest.raises(OutOfBlocks):
                self.m.step(step_plan)
            return

        host_before = self.m.table.host.copy()
        out = self.m.step(step_plan)
        assert np.array_equal(apply_changes(host_before, out), self.m.table.host)
        event(f"step: {len(items)} demands, {len(plan.reverts)} reverts, "
              f"{len(plan.result_ids)} results, {len(plan.finished)} finished")
        for kind, flags in served.items():
            if not all(flags):
                event(f"step: a {kind} refused")
        assert out.granted.tolist() == served["grant"]
        assert out.prefill_granted.tolist() == served["prefill"]
        assert (out.admitted_rows >= 0).tolist() == served["new"]
        assert ((out.new_refusals == 0) == (out.admitted_rows >= 0)).all()
        assert out.grant_starts.tolist() == [after[req].hist for req in plan.grant_ids]
        assert out.prefill_starts.tolist() == [after[req].hist for req in plan.prefill_ids]
        for i, (req, d) in enumerate(zip(plan.grant_ids, plan.draft_lens, strict=True)):
            if served["grant"][i]:
                spec.do_grant(after[req], d)
                if req in new_pad:
                    spec.do_pad(after[req], new_pad[req])
        for req, p in zip(plan.padding_ids, plan.padded_draft_lens, strict=True):
            if req not in new_pad:
                spec.do_pad(after[req], p)
        for i, (req, n) in enumerate(zip(plan.prefill_ids, plan.prefill_tokens, strict=True)):
            if served["prefill"][i]:
                after[req].cap += n
                after[req].hist += n
        for req in plan.finished:
            self.forget(req)
        for i, req in enumerate(plan.new_ids):
            if served["new"][i]:
                first = plan.first_chunks[i] or plan.prompt_lens[i]
                after[req] = Req(prompt=plan.prompt_lens[i], cap=first, hist=first)
                self.rows[req] = int(out.admitted_rows[i])
        self.model = after
        assert out.num_blocks.tolist() == [
            spec.blocks(self.model[req].cap) if req else 0 for req in self.req_of_rows()]

    # ------------------------------------------------------------------ checks after every rule

    @invariant()
    def manager_matches_the_model_and_every_invariant_holds(self) -> None:
        m, spec = self.m, self.spec
        m.check_invariants()
        assert sorted(m.request_ids) == sorted(self.named)
        assert m.num_requests == len(self.model)
        assert m.free_blocks == spec.free_blocks(self.model)

        host = m.table.host
        owned: list[np.ndarray] = []
        rows = []
        for req, r in self.model.items():
            row = self.rows[req]
            view = m.view(row)
            assert view.capacity == r.cap, req
            assert view.history == r.hist, req
            assert view.pending_overlap_slack == r.slack, req
            assert view.pending_draft_len == (r.draft if r.pending else None), req
            if req in self.named:  # the id edge reads the same state
                assert m.row(req) == row
                assert (m.capacity(req), m.history(req), m.pending_overlap_slack(req),
                        m.pending_draft_len(req), m.num_blocks(req)) == (
                    view.capacity, view.history, view.pending_overlap_slack,
                    view.pending_draft_len, view.num_blocks)
                assert m.block_ids(req).tolist() == view.block_ids.tolist()
            assert r.hist <= r.cap
            nb = view.num_blocks
            assert nb == spec.blocks(r.cap) <= spec.row_blocks
            rows.append(row)
            ids = host[row, :nb]
            assert ((ids >= 0) & (ids < spec.total)).all()
            assert (host[row, nb:] == -1).all()
            assert view.block_ids.tolist() == ids.tolist()
            owned.append(ids)
            if spec.policy == "reclaim":
                assert r.cap - r.hist <= 1 + 2 * spec.max_d
        assert len(set(rows)) == len(rows)
        assert all(0 <= row < spec.max_batch for row in rows)
        free_rows = np.setdiff1d(np.arange(spec.max_batch), rows)
        assert (host[free_rows] == -1).all()
        all_owned = np.concatenate(owned) if owned else np.zeros(0, dtype=np.int32)
        assert np.unique(all_owned).size == all_owned.size  # no block owned twice
        assert m.free_blocks + all_owned.size == spec.total  # conservation
        assert np.array_equal(m.table.device_table.cpu().numpy(), host)

        # Write reach of every pending forward, and the slots it would write.
        rows_t, pos_t = [], []
        for req, r in self.model.items():
            if not r.pending:
                continue
            u = r.lead if spec.overlap else 0
            reach = r.hist + u + 1 + r.draft
            assert reach <= r.cap, (req, reach, r.cap)
            positions = range(r.hist + u, reach)
            rows_t.extend([self.rows[req]] * len(positions))
            pos_t.extend(positions)
        if pos_t:
            slots = m.table.slot_mapping(torch.tensor(rows_t), torch.tensor(pos_t),
                                         spec.tpb).numpy()
            assert (slots >= 0).all()
            want = host[rows_t, np.array(pos_t) // spec.tpb].astype(np.int64) * spec.tpb + (
                np.array(pos_t) % spec.tpb)
            assert np.array_equal(slots, want)

    def teardown(self) -> None:
        """Freeing every request, one by one, returns the whole pool and clears every row."""
        for req in list(self.model):
            if req in self.named:
                self.m.free(req)
            else:
                self.m.step(StepPlan(finished_rows=[self.rows[req]]))
        self.m.check_invariants()
        assert self.m.num_requests == 0
        assert self.m.free_blocks == self.spec.total
        assert (self.m.table.host == -1).all()
        assert (self.m.table.device_table.cpu().numpy() == -1).all()


SETTINGS = settings(max_examples=200, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# Small pools: two or three long requests exhaust the blocks, max_batch_size rows run out, and
# histories reach the end of a row within a few dozen steps (BlockTableOverflow).


class OverlapReclaim(ManagerMachine):
    CONFIG: ClassVar[dict] = {
        "num_blocks": 18, "tokens_per_block": 4, "max_seq_len": 24, "max_draft_len": 3,
        "max_batch_size": 4, "overlap_scheduler": True, "slack_policy": "reclaim",
    }


class NoOverlapReclaim(ManagerMachine):
    CONFIG: ClassVar[dict] = {
        "num_blocks": 14, "tokens_per_block": 3, "max_seq_len": 20, "max_draft_len": 2,
        "max_batch_size": 3, "overlap_scheduler": False, "slack_policy": "reclaim",
    }


class OverlapReclaimOneTokenBlocks(ManagerMachine):
    CONFIG: ClassVar[dict] = {
        "num_blocks": 40, "tokens_per_block": 1, "max_seq_len": 16, "max_draft_len": 3,
        "max_batch_size": 3, "overlap_scheduler": True, "slack_policy": "reclaim",
    }


class OverlapUnreclaimed(ManagerMachine):
    """The leaking policy: capacity grows D per step, so rows overflow (a typed error) fast."""

    CONFIG: ClassVar[dict] = {
        "num_blocks": 20, "tokens_per_block": 4, "max_seq_len": 24, "max_draft_len": 3,
        "max_batch_size": 4, "overlap_scheduler": True, "slack_policy": "unreclaimed",
    }


class OverlapReclaimNumpyStep(OverlapReclaim):
    """The numpy step, the compiled one's specification, against the same model."""

    COMPILED: ClassVar[bool | None] = False


TestOverlapReclaim = OverlapReclaim.TestCase
TestOverlapReclaim.settings = SETTINGS
TestNoOverlapReclaim = NoOverlapReclaim.TestCase
TestNoOverlapReclaim.settings = SETTINGS
TestOverlapReclaimOneTokenBlocks = OverlapReclaimOneTokenBlocks.TestCase
TestOverlapReclaimOneTokenBlocks.settings = settings(SETTINGS, max_examples=100)
TestOverlapUnreclaimed = OverlapUnreclaimed.TestCase
TestOverlapUnreclaimed.settings = settings(SETTINGS, max_examples=100)
TestOverlapReclaimNumpyStep = OverlapReclaimNumpyStep.TestCase
TestOverlapReclaimNumpyStep.settings = settings(SETTINGS, max_examples=100)
