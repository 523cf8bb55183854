"""The worker on a grouped pool (float32, CPU): Qwen2 with layer 0 full and layer 1 sliding over
16 positions (``qwen2_mixed``) over a service's pool of two groups (`ServiceConfig.groups`, as
`sized_groups` makes them for ``kvalloc worker --in-process``), ``full`` (layer 0, every block
kept) and ``window16`` (layer 1, the blocks behind its window given back, a pool of fewer
blocks), each with its own KV, staging and block table, gives exactly transformers' tokens,
and the logits of the same model over one full pool: synchronously (the service's commit into
each group), one step ahead (the worker's own) and replaying decode graphs.

Every group's pool and staging start as NaN, and after every call every block the windowed
group's rows do not hold is NaN again: its given-back columns (-2) and whatever they held are
never read. Each group's pool holds exactly what was committed at its own table's slots,
checked after every step: NaN everywhere else.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import msgspec
import pytest
import torch
from kvalloc.allocator import LayerGroup
from kvalloc.server import serve
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.drafters import DeviceOracleDrafter
from kvalloc.worker.engine import Engine, StepRecord
from kvalloc.worker.errors import LayoutMismatch
from kvalloc.worker.model import model_groups, sized_groups
from test_worker_exact import PoolWatch, make_drafter
from test_worker_overlap import CommitReplay
from test_worker_window import WINDOW, GiveBacks
from worker_oracle import MAX_NEW_TOKENS, Oracle, make_oracle, pool_config

pytest_plugins = ["worker_fixtures"]


@pytest.fixture(scope="module")
def mixed(one_thread: None) -> Oracle:
    return make_oracle("qwen2_mixed")


def grouped_config(oracle: Oracle, window: int = WINDOW) -> ServiceConfig:
    """The model's grouped pool (`pool_config`), its windowed group giving back the blocks
    behind ``window``; a lease past a cold compile of the groups' first step (numba's)."""
    config = pool_config(oracle.model, grouped=True)
    full, windowed = config.groups
    return ServiceConfig(**{**dict(config), "lease_ttl_s": 600.0, "groups": [
        full, windowed.model_copy(update={"window": window})]})


def poisoned(client: Client) -> Client:
    for group in client.pool.groups:
        group.kv.fill_(float("nan"))
        group.staging.fill_(float("nan"))
    return client


def grouped(oracle: Oracle, connect: Callable, *, overlap: bool = False, window: int = WINDOW,
            shadow_of: Callable[[torch.Tensor], torch.Tensor] | None = None
            ) -> tuple[Client, GiveBacks]:
    """A client of a grouped service (`grouped_config`), every group's pool and staging
    poisoned, and the poisoning of the windowed group's free blocks after every call, in the
    shadow ``shadow_of(its pool)`` gives (a throwaway one by default)."""
    client = poisoned(connect(grouped_config(oracle, window), overlap=overlap))
    windowed = client.pool.groups[1].kv
    shadow = (shadow_of or (lambda kv: torch.full_like(kv, float("nan"))))(windowed)
    return client, GiveBacks(client, shadow, group=1)


def test_the_service_serves_the_model_a_pool_of_two_groups(mixed: Oracle,
                                                           connect: Callable) -> None:
    """The windowed group's pool holds what its window needs, not every block."""
    client, _ = grouped(mixed, connect)
    pool, layout = client.pool, client.registration.layout
    assert [(g.name, g.layers, g.window) for g in layout.groups] == [
        ("full", [0], None), ("window16", [1], WINDOW)]
    assert [(g.layers, g.window) for g in pool.groups] == [((0,), None), ((1,), WINDOW)]
    full, windowed = (g.num_blocks for g in layout.groups)
    assert windowed < full == 256
    assert [g.kv.shape[:3] for g in pool.groups] == [(1, 2, full), (1, 2, windowed)]
    assert pool.kv.data_ptr() == pool.groups[0].kv.data_ptr()
    assert pool.groups[0].block_table.data_ptr() != pool.groups[1].block_table.data_ptr()


@pytest.mark.parametrize(("draft_len", "kind"), [(0, None), (3, 0.5), (3, "ngram")])
def test_a_grouped_pool_gives_the_tokens_and_logits_of_one_full_pool(
        mixed: Oracle, connect: Callable, draft_len: int, kind: object) -> None:
    """Step for step the same logits as the same run over one pool of every layer (its
    scheduling is the same: neither pool runs short), and each group's pool holds exactly the
    tokens the service committed, at its own table's slots."""
    logits: dict[str, list[torch.Tensor]] = {"one": [], "grouped": []}

    def keep(name: str) -> Callable[[StepRecord], None]:
        return lambda record: logits[name].append(record.tensors.logits.clone())

    one = connect(pool_config(mixed.model))
    engine = Engine(mixed.model, one, make_drafter(mixed, kind), draft_len=draft_len,
                    stop_token_ids=mixed.stop_tokens())
    assert engine.run(mixed.prompts, MAX_NEW_TOKENS, on_step=keep("one")) == mixed.expected
    client = poisoned(connect(grouped_config(mixed)))
    watches = [PoolWatch(mixed, g.kv, g.block_table, layers=g.layers) for g in client.pool.groups]
    gives = GiveBacks(client, watches[1].shadow, watches[1].apply_commit, group=1)

    def observe(record: StepRecord) -> None:
        keep("grouped")(record)
        watches[0](record)
        watches[1].check(record)

    engine = Engine(mixed.model, client, make_drafter(mixed, kind), draft_len=draft_len,
                    stop_token_ids=mixed.stop_tokens(), validate=True)
    assert engine.run(mixed.prompts, MAX_NEW_TOKENS, on_step=observe) == mixed.expected
    assert engine.stats.table_violations == 0
    assert gives.released > 0 and gives.poisoned > 0
    assert watches[0].committed == watches[1].committed > 0
    assert len(logits["one"]) == len(logits["grouped"])
    for want, got in zip(logits["one"], logits["grouped"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def run_overlap(oracle: Oracle, connect: Callable, rate: float | None, draft_len: int, *,
                graphs: Callable[[Engine], object] | None = None
                ) -> tuple[Engine, list[CommitReplay], GiveBacks]:
    replays: list[CommitReplay] = []

    def replayed(kv: torch.Tensor) -> torch.Tensor:  # the windowed replay's shadow poisoned
        replays.append(CommitReplay(oracle, kv, group=1, layers=[1]))
        return replays[-1].shadow

    client, gives = grouped(oracle, connect, overlap=True, shadow_of=replayed)
    replays.insert(0, CommitReplay(oracle, client.pool.groups[0].kv, group=0, layers=[0]))
    drafter = None if rate is None else DeviceOracleDrafter(
        oracle.expected, rate, vocab_size=oracle.model.config.vocab_size, device="cpu", seed=3)
    engine = Engine(oracle.model, client, drafter, draft_len=draft_len,
                    stop_token_ids=oracle.stop_tokens(), overlap=True, validate=True,
                    pad_decodes=graphs is not None)
    if graphs is not None:
        graphs(engine)

    def observe(record: StepRecord) -> None:
        for replay in replays:
            replay(record)

    assert engine.run(oracle.prompts, MAX_NEW_TOKENS, on_step=observe) == oracle.expected
    for replay in replays:
        replay.check()  # each group's pool: its committed tokens at its slots, NaN elsewhere
    stats = engine.stats
    assert stats.forwards_ahead > stats.steps // 2 and stats.table_violations == 0
    assert stats.committed_tokens == replays[0].kept == replays[1].kept > 0
    return engine, replays, gives


@pytest.mark.parametrize(("draft_len", "rate"), [(0, None), (3, 0.5), (3, 1.0)])
def test_one_step_ahead_each_group_commits_its_own_layers(
        mixed: Oracle, connect: Callable, draft_len: int, rate: float | None) -> None:
    _, _, gives = run_overlap(mixed, connect, rate, draft_len)
    assert gives.released > 0 and gives.poisoned > 0


def test_decode_graphs_replay_a_grouped_step(mixed: Oracle, connect: Callable,
                                             rerun_graphs: Callable) -> None:
    """Captured with each group's static layout over its own table (the kernels' path, in
    Triton's interpreter), replayed while the windowed group gives blocks back."""
    engine, _, gives = run_overlap(mixed, connect, 0.5, 3, graphs=rerun_graphs)
    assert engine.stats.graph_replays > 0 and gives.released > 0


def _refusal(oracle: Oracle, connect: Callable, groups: list[wire.GroupLayout]) -> str:
    client = connect(pool_config(oracle.model))
    layout = msgspec.structs.replace(client.registration.layout, groups=groups)
    client.registration = msgspec.structs.replace(client.registration, layout=layout)
    with pytest.raises(LayoutMismatch) as refused:
        Engine(oracle.model, client, None, draft_len=0)
    return str(refused.value)


def _group(name: str, layers: list[int], window: int | None) -> wire.GroupLayout:
    return wire.GroupLayout(name=name, layers=layers, window=window, num_blocks=256)


@pytest.mark.parametrize(("groups", "why"), [
    ([_group("full", [1], None), _group("w", [0], 16)],
     "groups: group w gives back blocks behind a window of 16, but layer 0 of the model "
     "reads its whole history"),
    ([_group("full", [0], None), _group("w", [1], 8)],
     "groups: group w gives back blocks behind a window of 8, but layer 1 of the model reads "
     "a window of 16"),
    ([_group("full", [0], None)], "groups: layers [1] of the model are in no group"),
    ([_group("full", [0, 1], None), _group("w", [1], 16)],
     "groups: layer 1 is in groups full and w"),
    ([_group("full", [0, 1, 2], None)],
     "groups: group full holds layer 2, but the model has 2 layers")])
def test_groups_that_do_not_fit_the_model_are_refused(
        mixed: Oracle, connect: Callable, groups: list[wire.GroupLayout], why: str) -> None:
    """A layer that reads further back than its group keeps would read blocks given back to
    other requests: refused at once, naming groups and the groups that would serve it."""
    message = _refusal(mixed, connect, groups)
    assert message.startswith(why + ". A pool for this model: kvalloc serve")
    assert message.endswith("--layer-group full:0:256 --layer-group window16:1:256:16 (or "
                            "without them: one pool of every layer)")


def test_the_flags_a_refusal_proposes_make_a_service_the_worker_runs_on(
        mixed: Oracle, connect: Callable) -> None:
    """A one-pool service giving back blocks behind 16 for a model whose layer 0 reads its
    whole history: refused, proposing `kvalloc serve`'s own flags; those flags (with the
    pool's sizes, which the refusal leaves to the service) make a grouped service the worker
    attaches to and runs on."""
    client = connect(pool_config(mixed.model, window=WINDOW))
    with pytest.raises(LayoutMismatch) as refused:
        Engine(mixed.model, client, None, draft_len=0)
    message = str(refused.value)
    assert message.startswith("window: the pool gives back blocks behind a window of 16")
    proposed = re.search(r"kvalloc serve (.*) \(or without them", message)
    assert proposed is not None
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args([*proposed[1].split(), "--device", "cpu", "--tokens-per-block",
                              "4", "--max-seq-len", "96", "--max-draft-len", "3",
                              "--max-step-tokens", "48", "--max-batch-size", "8"])
    config = serve._config(args)
    assert [(g.name, g.layers, g.window) for g in config.groups] == [
        ("full", (0,), None), ("window16", (1,), WINDOW)]
    client = poisoned(connect(config))
    engine = Engine(mixed.model, client, None, draft_len=0, validate=True)
    prompts = mixed.prompts[:4]
    assert engine.run(prompts, MAX_NEW_TOKENS) == {p.req_id: mixed.expected[p.req_id]
                                                   for p in prompts}


def test_a_wider_group_serves_a_narrower_window(mixed: Oracle, connect: Callable) -> None:
    """Layer 1 slides over 16: a group keeping 32 gives back less than it could, and serves
    it exactly."""
    client, gives = grouped(mixed, connect, window=2 * WINDOW)
    assert client.registration.layout.groups[1].window == 2 * WINDOW
    engine = Engine(mixed.model, client, make_drafter(mixed, 0.5), draft_len=3,
                    stop_token_ids=mixed.stop_tokens(), validate=True)
    assert engine.run(mixed.prompts, MAX_NEW_TOKENS) == mixed.expected
    assert engine.stats.table_violations == 0 and gives.released > 0


def test_groups_the_pool_did_not_attach_are_refused(mixed: Oracle, connect: Callable) -> None:
    client = connect(pool_config(mixed.model))
    layout = msgspec.structs.replace(client.registration.layout, groups=[
        _group("full", [0], None), _group("w", [1], 32)])
    client.registration = msgspec.structs.replace(client.registration, layout=layout)
    with pytest.raises(LayoutMismatch, match=re.escape(
            "groups: the pool attached groups of (layers, window) [], its layout describes "
            "[([0], None), ([1], 32)]")):
        Engine(mixed.model, client, None, draft_len=0)


def test_a_mixed_model_is_proposed_one_group_per_kind() -> None:
    config = make_oracle("qwen2_mixed").model.config
    assert model_groups(config, num_blocks=64) == [
        LayerGroup(name="full", layers=(0,), window=None, num_blocks=64),
        LayerGroup(name="window16", layers=(1,), window=16, num_blocks=64)]
    for family in ("llama", "mistral"):  # every layer of one kind: one pool of every layer
        assert model_groups(make_oracle(family).model.config, num_blocks=64) == []


def test_a_windowed_group_is_sized_by_its_window(mixed: Oracle) -> None:
    """Eight requests of the tests' pool: a decoding row holds at most 8 blocks of 4 under a
    window of 16 (3 drafts, two steps in flight), 64 blocks, and two steps' prefill chunks of
    48 tokens 24 blocks, and 2 per request where they start: 104 of the full group's 256. A
    pool with fewer blocks than that keeps its own."""
    pool = pool_config(mixed.model).pool
    assert pool.model_copy(update={"window": WINDOW}).max_live_blocks_per_seq == 8
    full, windowed = sized_groups(mixed.model.config, pool, num_requests=8, max_step_tokens=48)
    assert (full.num_blocks, windowed.num_blocks, windowed.window) == (256, 104, WINDOW)
    small = pool.model_copy(update={"num_blocks": 64})
    assert [g.num_blocks for g in sized_groups(mixed.model.config, small, num_requests=8,
                                               max_step_tokens=48)] == [64, 64]
    llama = make_oracle("llama").model
    assert sized_groups(llama.config, pool_config(llama).pool, num_requests=8,
                        max_step_tokens=48) == []
