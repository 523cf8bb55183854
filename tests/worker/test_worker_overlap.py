"""The overlap worker (float32, CPU): one step ahead of the host, drafts and commits on the
device, and still exactly transformers' tokens and K/V.

Every run poisons the pool with NaN and replays, from each step's record, what the worker's own
commit kept (the first ``kept[e]`` tokens of each entry, at the slots the device computed);
after the run the pool must hold the plain forward's K/V at every such slot and the poison
everywhere else: no rejected draft, no token of a forward wasted past a request's end, and no
slot outside the request's blocks was written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from kvalloc.worker.drafters import DeviceOracleDrafter, NgramDrafter
from kvalloc.worker.engine import Engine, StepRecord
from kvalloc.worker.errors import EngineError
from kvalloc.worker.requests import NamedPrompt
from triton_interpreter import needs_triton_interpreter
from worker_oracle import MAX_NEW_TOKENS, Oracle, assert_acceptance, pool_config

pytest_plugins = ["worker_fixtures"]


class CommitReplay:
    """The on_step observer: the shadow of what the worker's commits wrote. ``group``: the
    group of a grouped pool whose slots ``kv`` is read through; ``layers``: the model layers
    ``kv`` holds, in order (every one by default)."""

    def __init__(self, oracle: Oracle, kv: torch.Tensor, *, group: int = 0,
                 layers: Sequence[int] | None = None) -> None:
        self.oracle, self.group = oracle, group
        layer_count, planes, blocks, tokens_per_block, heads, dim = kv.shape
        self.layers = range(layer_count) if layers is None else layers
        self.pool = kv.view(layer_count, planes, blocks * tokens_per_block, heads, dim)
        self.shadow = torch.full_like(self.pool, float("nan"))
        self.kept = 0

    def __call__(self, record: StepRecord) -> None:
        tensors = record.tensors
        assert tensors.kept is not None, "an overlap worker commits its own tokens"
        sched = record.reply.scheduled
        for r, off, kept in zip(record.requests, np.asarray(sched.token_offsets).tolist(),
                                tensors.kept.tolist(), strict=True):
            slots = tensors.slots[self.group, off:off + kept]
            positions = tensors.positions[off:off + kept]
            assert bool((slots >= 0).all()), "a kept token without a slot"
            for at, layer in enumerate(self.layers):
                self.shadow[at, :, slots] = self.oracle.kv[r.req_id][layer, :, positions]
            self.kept += kept

    def check(self) -> None:
        torch.testing.assert_close(self.pool, self.shadow, equal_nan=True, atol=1e-4, rtol=1e-4)


def run_overlap(oracle: Oracle, connect: Callable, rate: float | None, draft_len: int, *,
                prompts: list[NamedPrompt] | None = None, share_prefixes: bool = False,
                replay: bool = True, pad_decodes: bool = False, warm_up: bool = False,
                graphs: Callable[[Engine], object] | None = None,
                model: torch.nn.Module | None = None,
                calls: list[dict] | None = None, ahead: bool = True, **service: object
                ) -> tuple[Engine, dict[str, list[int]], CommitReplay | None]:
    """``prompts``: the oracle's by default; the replay knows only their K/V (none for
    others). ``ahead``: the engine runs one step ahead (else in step, on the same overlap
    registration: it still commits its own tokens)."""
    replay = replay and all(p.req_id in oracle.kv for p in prompts or ())
    config = pool_config(oracle.model)
    pool = config.pool.model_copy(update=service)
    config = config.model_copy(update={"pool": pool, "prefix_caching": share_prefixes})
    client = connect(config, overlap=True)
    client.pool.kv.fill_(float("nan"))
    watch = CommitReplay(oracle, client.pool.kv) if replay else None
    drafter = None if rate is None else DeviceOracleDrafter(
        oracle.expected, rate, vocab_size=oracle.model.config.vocab_size,
        device=client.pool.kv.device, seed=3)
    engine = Engine(model or oracle.model, client, drafter, draft_len=draft_len,
                    stop_token_ids=oracle.stop_tokens(), overlap=ahead, validate=True,
                    share_prefixes=share_prefixes, pad_decodes=pad_decodes)
    if graphs is not None:
        graphs(engine)
    if warm_up:
        free = client.get_pool().free_blocks
        assert engine.warm_up() == 1 + 4 * (1 if pad_decodes else 1 + draft_len)
        assert client.get_pool().free_blocks == free
        engine.rows.check_invariants()
    def observe(record: StepRecord) -> None:
        if watch is not None:
            watch(record)
        if calls is not None:
            calls.append(record.call)

    outputs = engine.run(prompts or oracle.prompts, MAX_NEW_TOKENS, on_step=observe)
    return engine, outputs, watch


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "in-step"])
@pytest.mark.parametrize(("draft_len", "rate"), [(0, None), (1, 0.5), (3, 0.0), (3, 0.5),
                                                 (3, 1.0)])
def test_tokens_and_pool_equal_generate_with_the_workers_own_commit(
        oracle: Oracle, connect: Callable, draft_len: int, rate: float | None,
        ahead: bool) -> None:
    """In step on the same overlap registration (``ahead`` False) the worker still commits
    its own tokens, reporting each step's results in the next call, and the service commits
    nothing for it: the same tokens and the same pool."""
    engine, outputs, replay = run_overlap(oracle, connect, rate, draft_len, ahead=ahead)
    assert outputs == oracle.expected
    assert replay is not None
    replay.check()
    stats = engine.stats
    assert replay.kept > 0 and stats.committed_tokens == replay.kept
    assert stats.refused_tokens == 0
    if ahead:  # the device really ran ahead of the host
        assert stats.forwards_ahead > stats.steps // 2
    else:
        assert stats.forwards_ahead == 0
    assert stats.table_violations == 0
    assert stats.generated_tokens == sum(map(len, oracle.expected.values()))
    assert_acceptance(stats, rate)


def test_padded_decodes_give_the_exact_tokens_and_commit_only_real_drafts(
        oracle: Oracle, connect: Callable) -> None:
    """Decode-only steps padded to D = 3 through the padding grant and grown to their batch
    bucket (the shapes CUDA graphs replay): requests near their end run padded tokens, which
    are never accepted or written, and the grown entries emit and write nothing."""
    calls: list[dict] = []
    engine, outputs, replay = run_overlap(oracle, connect, 0.5, 3, pad_decodes=True, calls=calls)
    assert outputs == oracle.expected
    assert replay is not None
    replay.check()
    assert engine.stats.table_violations == 0
    padded = [c["padding"] for c in calls if "padding" in c]
    assert padded and all((np.asarray(lens) == 3).all() for _, lens in padded)


def test_a_warm_up_before_serving_writes_nothing_and_changes_no_token(
        oracle: Oracle, connect: Callable) -> None:
    """Every decode shape and the widest chunk run on the spare row first, committing on the
    device as an overlap worker does: the pool stays what the replay of the real steps says
    (NaN wherever nothing was committed), the tokens are a cold engine's, no block moved."""
    engine, outputs, replay = run_overlap(oracle, connect, 0.5, 3, pad_decodes=True,
                                          warm_up=True)
    assert outputs == oracle.expected
    assert replay is not None
    replay.check()
    assert engine.stats.table_violations == 0


@needs_triton_interpreter
def test_decode_steps_replayed_from_the_warm_ups_captures_are_exact(
        llama_oracle: Oracle, connect: Callable, rerun_graphs: Callable) -> None:
    """The warm-up captures every decode shape on the spare row; each decode step of the run
    replays one, its own inputs loaded into the capture's static copies, with the capture's
    plan: the tokens are generate's, the pool exactly what was committed, nothing captured
    anew, and every draft judged as the same run without graphs judges it."""
    engine, outputs, replay = run_overlap(llama_oracle, connect, 0.5, 3, pad_decodes=True,
                                          warm_up=True, graphs=rerun_graphs)
    assert outputs == llama_oracle.expected
    assert replay is not None
    replay.check()
    graphs = engine.step.graphs
    assert graphs is not None and graphs.captured == 4 and graphs.replayed > 0
    assert engine.stats.padded_entries > 0 and engine.stats.table_violations == 0
    eager, _, _ = run_overlap(llama_oracle, connect, 0.5, 3, pad_decodes=True, warm_up=True,
                              replay=False)
    assert (engine.stats.proposed_drafts, engine.stats.accepted_drafts) == (
        eager.stats.proposed_drafts, eager.stats.accepted_drafts)


@needs_triton_interpreter
# A wasted forward (a request that ended in the step before, one step ahead) reads its unkept
# positions, NaN in the poisoned pool: the interpreter's reductions warn of it.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_the_fused_forward_replayed_from_graphs_gives_the_exact_tokens(
        oracle: Oracle, connect: Callable, rerun_graphs: Callable,
        fused_on_cpu: Callable) -> None:
    """The forward a CUDA worker runs, every fused kernel in the interpreter, its decode steps
    replayed from the warm-up's captures: generate's tokens and an exact pool, in all three
    families (Qwen2's biased q/k/v through the merged projection, Mistral's window)."""
    engine, outputs, replay = run_overlap(oracle, connect, 0.5, 3, pad_decodes=True,
                                          warm_up=True, graphs=rerun_graphs,
                                          model=fused_on_cpu(oracle.model))
    assert outputs == oracle.expected
    assert replay is not None
    replay.check()
    assert engine.step.graphs is not None and engine.step.graphs.replayed > 0


def test_a_batch_grown_to_its_bucket_gives_the_exact_tokens(oracle: Oracle,
                                                            connect: Callable) -> None:
    """Three requests decode as a batch of four, the bucket a captured graph serves: the grown
    entry, on the spare row, emits nothing and writes nothing."""
    prompts = oracle.prompts[:3]
    engine, outputs, replay = run_overlap(oracle, connect, 0.5, 3, prompts=prompts,
                                          pad_decodes=True)
    assert outputs == {p.req_id: oracle.expected[p.req_id] for p in prompts}
    assert replay is not None
    replay.check()
    assert engine.stats.table_violations == 0 and engine.stats.padded_entries > 0


def test_preemption_on_a_small_pool_still_gives_the_exact_tokens(llama_oracle: Oracle,
                                                                 connect: Callable) -> None:
    engine, outputs, replay = run_overlap(llama_oracle, connect, 0.5, 3, num_blocks=30)
    assert outputs == llama_oracle.expected
    assert replay is not None
    replay.check()
    assert engine.stats.preemptions > 0 and engine.stats.forwards_ahead > 0


def test_shared_prefixes_one_step_ahead(llama_oracle: Oracle, connect: Callable) -> None:
    """With prefix caching the worker's commit maps the service's protection mask; prompts that
    share a prefix skip its prefill and still give a synchronous run's tokens."""
    base = llama_oracle.prompts[-1].token_ids  # 70 tokens
    # Blocks become shareable once their step's results arrive, a call later than for a
    # synchronous worker: six prompts, so that the later ones find the first ones' blocks.
    prompts = [NamedPrompt(f"p{i}", base[:32] + base[40 + 2 * i:48 + 2 * i]) for i in range(6)]
    sync_client = connect(pool_config(llama_oracle.model))
    want = Engine(llama_oracle.model, sync_client, None, draft_len=0,
                  stop_token_ids=llama_oracle.stop_tokens()).run(prompts, MAX_NEW_TOKENS)
    engine, outputs, _ = run_overlap(llama_oracle, connect, None, 0, prompts=prompts,
                                     share_prefixes=True)
    assert outputs == want
    assert engine.stats.cached_prompt_tokens > 0 and engine.stats.forwards_ahead > 0
    assert engine.client.pool.protected is not None and bool(engine.client.pool.protected.any())


def test_without_slack_the_device_outruns_its_blocks(llama_oracle: Oracle,
                                                     connect: Callable) -> None:
    """The reproduction: a service that grants no overlap slack leaves a decode one step ahead
    writing past its row's blocks at a block boundary, which the validator counts (an engine's
    kernel would read and write out of bounds there)."""
    engine, _, _ = run_overlap(llama_oracle, connect, 1.0, 3, replay=False, slack_policy="none")
    assert engine.stats.table_violations > 0


def test_an_overlap_worker_drafts_on_the_device(llama_oracle: Oracle, connect: Callable) -> None:
    client = connect(pool_config(llama_oracle.model), overlap=True)
    with pytest.raises(EngineError, match="drafts on the device"):
        Engine(llama_oracle.model, client, NgramDrafter(), draft_len=3, overlap=True)


def test_one_step_ahead_needs_an_overlap_registration(llama_oracle: Oracle,
                                                     connect: Callable) -> None:
    client = connect(pool_config(llama_oracle.model), overlap=False)
    with pytest.raises(EngineError, match="registered with overlap=False"):
        Engine(llama_oracle.model, client, None, draft_len=0, overlap=True)
