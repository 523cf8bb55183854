"""The worker's tokens, logits and pool against transformers' own answers (float32, CPU).

Every run poisons the pool with NaN first and keeps a shadow of what the pool must hold: each
call commits, of the previous step's entries that it did not finish, the non-draft tokens and
the accepted drafts, whose K/V is what a plain forward computes for those positions. After every
call the whole pool must equal the shadow: committed slots hold the plain forward's K/V, and
every other slot (rejected drafts, blocks no request held) still holds the poison. With NWOR
off (the service writes rejected drafts too, as an engine without NWOR) the tokens must still be
exact and the committed slots right; the rejected drafts' slots then hold whatever they staged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.service.core import ServiceCore
from kvalloc.worker.drafters import Drafter, NgramDrafter, OracleDrafter
from kvalloc.worker.engine import Engine, StepRecord
from kvalloc.worker.requests import Request
from kvalloc.worker.step.device_step import Launched, LaunchPlan
from worker_oracle import MAX_NEW_TOKENS, Oracle, assert_acceptance, pool_config

pytest_plugins = ["worker_fixtures"]


class PoolWatch:
    """The on_step observer: the pool must equal exactly the tokens committed so far.
    ``layers``: the model layers ``kv`` holds, in order (every one by default: a grouped
    pool's group holds some)."""

    def __init__(self, oracle: Oracle, kv: torch.Tensor, block_table: torch.Tensor,
                 nwor: bool = True, layers: Sequence[int] | None = None) -> None:
        self.oracle, self.block_table, self.nwor = oracle, block_table, nwor
        self.layers = slice(None) if layers is None else list(layers)
        layers, planes, blocks, self.tokens_per_block, heads, dim = kv.shape
        self.pool = kv.view(layers, planes, blocks * self.tokens_per_block, heads, dim)
        self.shadow = torch.full_like(self.pool, float("nan"))
        # The previous step's entries: (request, first position, slots, num tokens, drafts).
        self.previous: list[tuple[Request, int, torch.Tensor, int, int]] = []
        self.committed = 0

    def __call__(self, record: StepRecord) -> None:
        self.apply_commit(record.call)
        self.check(record)

    def check(self, record: StepRecord) -> None:
        """The pool against the shadow, then the step's slots for the next call's commit."""
        # Without NWOR a rejected draft's slot holds its staged K/V: compare committed slots.
        checked = slice(None) if self.nwor else ~self.shadow[0, 0, :, 0, 0].isnan()
        torch.testing.assert_close(self.pool[:, :, checked], self.shadow[:, :, checked],
                                   equal_nan=True, atol=1e-4, rtol=1e-4)
        sched = record.reply.scheduled
        self.previous = []
        for r, row, start, n, drafts in zip(record.requests, *(
                np.asarray(a).tolist() for a in (sched.rows, sched.start_positions,
                                                 sched.num_tokens, sched.num_drafts)),
                                            strict=True):
            pos = torch.arange(start, start + n)
            slots = self.block_table[row, pos // self.tokens_per_block].long() * (
                self.tokens_per_block) + pos % self.tokens_per_block
            self.previous.append((r, start, slots, n, drafts))

    def apply_commit(self, call: dict) -> None:
        """What ``call`` committed of the previous step, into the shadow."""
        finished = set(np.asarray(call.get("finished", ())).tolist())
        handles, accepted = call.get("results", ((), ()))
        accepted_by_handle = dict(zip(np.asarray(handles).tolist(),
                                      np.asarray(accepted).tolist(), strict=True))
        for r, start, slots, n, drafts in self.previous:
            if r.handle in finished or r.handle < 0:
                continue
            keep = n - drafts + accepted_by_handle.get(r.handle, 0)
            self.shadow[:, :, slots[:keep]] = self.oracle.kv[r.req_id][
                self.layers, :, start:start + keep]
            self.committed += keep
            if not self.nwor:  # rejected drafts were written too: their slots are unknown now
                self.shadow[:, :, slots[keep:]] = float("nan")


def run_worker(oracle: Oracle, connect: Callable, drafter: Drafter | None, draft_len: int,
               on_step: Callable[[StepRecord], None] | None = None, nwor: bool = True,
               pad_decodes: bool = False, warm_up: bool = False,
               **pool: object) -> tuple[Engine, dict[str, list[int]], PoolWatch]:
    client = connect(pool_config(oracle.model, nwor=nwor, **pool))
    client.pool.kv.fill_(float("nan"))
    watch = PoolWatch(oracle, client.pool.kv, client.pool.block_table, nwor)

    def observe(record: StepRecord) -> None:
        watch(record)
        if on_step is not None:
            on_step(record)

    engine = Engine(oracle.model, client, drafter, draft_len=draft_len,
                    stop_token_ids=oracle.stop_tokens(), pad_decodes=pad_decodes)
    if warm_up:
        engine.warm_up()
    outputs = engine.run(oracle.prompts, MAX_NEW_TOKENS, on_step=observe)
    return engine, outputs, watch


DRAFTS = [  # (draft_len, drafter: None, "ngram" or an oracle acceptance rate)
    (0, None), (1, 0.5), (1, 1.0), (3, 0.0), (3, 0.5), (3, 1.0), (3, "ngram"),
]


def make_drafter(oracle: Oracle, kind: object) -> Drafter | None:
    if kind is None:
        return None
    if kind == "ngram":
        return NgramDrafter()
    return OracleDrafter(oracle.expected, float(kind), vocab_size=oracle.model.config.vocab_size,
                         seed=7)


@pytest.mark.parametrize("nwor", [True, False], ids=["nwor", "no-nwor"])
@pytest.mark.parametrize(("draft_len", "kind"), DRAFTS)
def test_tokens_equal_generate(oracle: Oracle, connect: Callable, draft_len: int,
                               kind: object, nwor: bool) -> None:
    engine, outputs, watch = run_worker(oracle, connect, make_drafter(oracle, kind), draft_len,
                                        nwor=nwor)
    assert outputs == oracle.expected
    stats = engine.stats
    assert stats.generated_tokens == sum(map(len, oracle.expected.values()))
    assert watch.committed > 0
    assert_acceptance(stats, kind)


def test_padded_decodes_are_exact_and_the_service_commits_only_real_drafts(
        oracle: Oracle, connect: Callable) -> None:
    """Synchronous decode-only steps padded to D = 3 (the padding grant) and grown to their
    batch bucket: the service settles the padded step and writes only the accepted drafts (the
    pool watch checks every slot); the grown entries emit and write nothing."""
    padded = []
    engine, outputs, watch = run_worker(
        oracle, connect, make_drafter(oracle, "ngram"), 3, pad_decodes=True,
        on_step=lambda record: padded.append("padding" in record.call))
    assert outputs == oracle.expected and watch.committed > 0 and any(padded)
    assert engine.stats.padded_entries > 0


@pytest.mark.parametrize("pad_decodes", [False, True], ids=["eager", "padded"])
def test_a_warm_up_before_serving_changes_nothing(oracle: Oracle, connect: Callable,
                                                  pad_decodes: bool) -> None:
    """Every decode shape and the widest chunk run on the spare row first: the pool (NaN until
    committed, the watch checks every slot) and the tokens are a cold engine's. Eight rows make
    the buckets 1, 2, 4 and 8: at one width when padded, at each of 1 + 0..3 drafts if not."""
    engine, outputs, watch = run_worker(oracle, connect, make_drafter(oracle, 0.5), 3,
                                        pad_decodes=pad_decodes, warm_up=True)
    assert engine.stats.warm_up_shapes == 1 + 4 * (1 if pad_decodes else 4)
    assert outputs == oracle.expected and watch.committed > 0
    assert engine.stats.generated_tokens == sum(map(len, oracle.expected.values()))


def test_a_warm_up_longer_than_the_lease_keeps_it(oracle: Oracle) -> None:
    """Each shape of the warm-up takes 0.6 of the lease on the service's clock (a cold
    compile): the empty call after each keeps the session, so the run that follows is served."""
    now = [0.0]
    config = pool_config(oracle.model).model_copy(update={"lease_ttl_s": 10.0})
    core = ServiceCore(config, clock=lambda: now[0])
    try:
        client = Client.in_process(core, worker_id="warming")
        client.register()
        engine = Engine(oracle.model, client, None, draft_len=0, pad_decodes=True,
                        stop_token_ids=oracle.stop_tokens())
        launch = engine.step.launch

        def compiling(plan: LaunchPlan) -> Launched:
            now[0] += 6.0
            return launch(plan)

        engine.step.launch = compiling  # type: ignore[method-assign]
        assert engine.warm_up() * 6.0 > 10.0
        assert engine.run(oracle.prompts, MAX_NEW_TOKENS) == oracle.expected
        assert client.get_pool().leases_expired == 0
    finally:
        core.close()


def test_refused_grants_preempt_and_still_give_the_exact_tokens(oracle: Oracle,
                                                                connect: Callable) -> None:
    # 30 blocks of 4 tokens: the longest request alone needs 21, so requests keep getting
    # refused and preempted, and come back through a recompute of prompt + output.
    engine, outputs, _ = run_worker(oracle, connect, make_drafter(oracle, 0.5), 3,
                                    num_blocks=30)
    assert outputs == oracle.expected
    assert engine.stats.preemptions > 0 and engine.stats.refused_new > 0


def test_logits_equal_a_plain_full_sequence_forward(llama_oracle: Oracle,
                                                    connect: Callable) -> None:
    oracle, compared = llama_oracle, []

    def compare(record: StepRecord) -> None:
        if len(compared) >= 40:
            return
        offsets = np.asarray(record.reply.scheduled.token_offsets).tolist()
        step = record.tensors
        for entry, (r, off) in enumerate(zip(record.requests, offsets, strict=True)):
            rows = np.flatnonzero((step.logit_rows >= off) &
                                  (step.logit_rows < off + _step_tokens(record, entry)))
            if not rows.size:
                continue
            sequence = _sequence_through_step(record, entry, r)
            with torch.inference_mode():
                plain = oracle.reference(torch.tensor([sequence])).logits[0]
            positions = step.positions[torch.as_tensor(step.logit_rows[rows])]
            torch.testing.assert_close(step.logits[torch.as_tensor(rows)], plain[positions],
                                       atol=1e-4, rtol=1e-4)
            compared.append(r.req_id)

    _, outputs, _ = run_worker(oracle, connect, make_drafter(oracle, 0.5), 3, on_step=compare)
    assert outputs == oracle.expected
    assert len(compared) >= 40


def _step_tokens(record: StepRecord, entry: int) -> int:
    return int(record.reply.scheduled.num_tokens[entry])


def _sequence_through_step(record: StepRecord, entry: int, r: Request) -> list[int]:
    """``r``'s tokens from position 0 through the last token of the observed step (a
    synchronous worker has read every earlier step)."""
    sched = record.reply.scheduled
    off, n, start = (int(a[entry]) for a in (sched.token_offsets, sched.num_tokens,
                                              sched.start_positions))
    return [*r.tokens[:start].tolist(), *record.tensors.input_ids[off:off + n].tolist()]
