"""The worker on a CUDA pool: exact tokens in float32, synchronous and one step ahead (the pool
poisoned with NaN first, so a read outside what was committed shows), and a ~1B model shape in
bfloat16.

In bfloat16 a speculative run batches its tokens differently from a plain run, so near-ties in
the logits may resolve differently; the test reports how far the two runs agree (the share of
each request's tokens before its first difference) rather than demanding bit equality.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from cuda_checks import no_host_sync
from kvalloc.server.client import Client
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.drafters import DeviceOracleDrafter, NgramDrafter, OracleDrafter
from kvalloc.worker.engine import Engine
from kvalloc.worker.model import pool_for_model, random_model, sized_groups
from kvalloc.worker.requests import NamedPrompt
from kvalloc.worker.step import device_step
from kvalloc.worker.step.device_step import LaunchPlan
from transformers import (
    AttentionInterface,
    DeepseekV3Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from worker_oracle import WINDOWED_SDPA, windowed_sdpa

pytestmark = pytest.mark.gpu

SMALL = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": None}
DEEPSEEK = {**SMALL, "num_key_value_heads": 4, "first_k_dense_replace": 1,
            "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_group": 2, "topk_group": 1, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16, "v_head_dim": 24, "q_lora_rank": 24}
FAMILIES = {
    "llama": LlamaConfig(**SMALL),
    "qwen2": Qwen2Config(**SMALL),  # biased q/k/v projections
    # A 32-position window: the longer prompts and their outputs slide out of it.
    "mistral": MistralConfig(**SMALL, sliding_window=32),
    # MLA over a latent pool (latent 32 + rope 16), a dense layer then a mixture of experts.
    "deepseek_v3": DeepseekV3Config(**DEEPSEEK),
}
# The same MLA shape with a window of 32 in every layer (a look-alike of DeepSeek-V4's latent
# cache: transformers' DeepSeek-V3 has none, so its reference is `windowed_sdpa`).
DEEPSEEK_WINDOWED = DeepseekV3Config(**DEEPSEEK, sliding_window=32)

# Layer 0 full, layer 1 sliding over 32 (layers from max_window_layers slide): a grouped pool's
# model.
MIXED = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=1)

ONE_B = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, max_position_embeddings=4096, eos_token_id=None)


def _client(model: torch.nn.Module, *, longest: int, batch: int, dtype: str,
            overlap: bool = False, prefix_caching: bool = False,
            window: int | None = None, grouped: bool = False,
            own_table: bool | None = None, **service: object) -> tuple[ServiceCore, Client]:
    """``grouped``: in the groups `sized_groups` makes of a model that mixes layer kinds;
    ``own_table``: as `Client.register`; ``service``: more `ServiceConfig` fields."""
    pool = pool_for_model(model.config, longest=longest, num_requests=batch, draft_len=3,
                          dtype=dtype, device="cuda", max_batch_size=batch, window=window)
    groups = sized_groups(model.config, pool, num_requests=batch,
                          max_step_tokens=2048) if grouped else []
    # A lease past the first step's kernel compiles (tens of seconds on a cold cache).
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=2048, groups=groups,
                                     prefix_caching=prefix_caching, lease_ttl_s=600.0,
                                     **service))
    client = Client.in_process(core, worker_id="gpu-worker")
    client.register(overlap=overlap, own_table=own_table)
    return core, client


def _run(model: torch.nn.Module, prompts: list[NamedPrompt], new_tokens: int, drafter: object,
         draft_len: int, *, overlap: bool = False, own_commit: bool = False,
         prefix_caching: bool = False, cuda_graphs: bool = False,
         **pool: object) -> tuple[dict[str, list[int]], Engine]:
    """``own_commit``: registered as an overlap worker, which commits its own tokens, however
    the engine runs (``overlap``: ahead)."""
    core, client = _client(model, overlap=overlap or own_commit, prefix_caching=prefix_caching,
                           **pool)
    try:
        client.pool.kv.fill_(float("nan"))
        engine = Engine(model, client, drafter, draft_len=draft_len, overlap=overlap,
                        validate=True, share_prefixes=prefix_caching, cuda_graphs=cuda_graphs)
        return engine.run(prompts, new_tokens), engine
    finally:
        core.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(("overlap", "own_commit", "prefix_caching", "cuda_graphs"), [
    (False, False, False, False), (True, True, False, False), (True, True, True, False),
    (False, False, False, True), (False, True, False, True), (True, True, False, True)],
    ids=["sync", "overlap", "overlap-prefix-caching", "sync-graphs", "sync-own-commit-graphs",
         "overlap-graphs"])
def test_float32_on_cuda_equals_generate(cuda_device: str, family: str, overlap: bool,
                                         own_commit: bool, prefix_caching: bool,
                                         cuda_graphs: bool) -> None:
    """With prefix caching the prompts share a 64-token prefix: later ones skip its prefill
    and read the blocks an earlier one committed, under the service's write protection. With
    CUDA graphs, decode-only steps are padded to D = 3 and replay a captured graph; in step
    with its own commit, the worker commits inside the graph and the service's call does not
    (host drafts)."""
    config = FAMILIES[family]
    model = random_model(config, seed=0, device=cuda_device)
    reference = random_model(config, seed=0, device=cuda_device)
    reference.set_attn_implementation("sdpa")
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 96, 64).tolist() if prefix_caching else []
    prompts = [NamedPrompt(str(i), shared + rng.integers(0, 96, n).tolist())
               for i, n in enumerate((1, 5, 17, 40, 130, 236))]
    expected = _generated(reference, prompts, 16)
    drafter = _drafter(expected, overlap)
    # Two rows with prefix caching: the later prompts are admitted once earlier ones finished,
    # so their shared prefix is cached by then.
    outputs, engine = _run(model, prompts, 16, drafter, 3, longest=316,
                           batch=2 if prefix_caching else 8, dtype="float32", overlap=overlap,
                           own_commit=own_commit, prefix_caching=prefix_caching,
                           cuda_graphs=cuda_graphs)
    assert outputs == expected
    stats = engine.stats
    assert (stats.committed_tokens > 0) == own_commit
    assert (stats.cached_prompt_tokens > 0) == prefix_caching
    assert stats.accepted_drafts > 0 and stats.table_violations == 0
    assert (stats.forwards_ahead > 0) == overlap
    assert stats.device_busy_s > 0
    assert (stats.graph_replays > 0 and stats.graphs_captured > 0) == cuda_graphs
    # Six requests decode as a batch of eight, then fewer: the grown entries are exact too.
    assert (stats.padded_entries > 0) == cuda_graphs


@pytest.mark.parametrize(("own_table", "table_cells"), [
    (True, device_step.TABLE_CELLS), (True, 2), (False, device_step.TABLE_CELLS)],
    ids=["own-table", "own-table-uploaded-apart", "shared-table"])
def test_one_step_ahead_the_worker_reads_its_own_table_or_the_shared_one_alike(
        cuda_device: str, own_table: bool, table_cells: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA pool an overlap worker keeps its own block table by default (each reply's
    changes scattered into it by the next step, ahead of everything reading it there; more
    than a step carries, ``table_cells``, uploaded apart first), and a service of one worker
    needs no step fence on its calls; reading the table the service uploads instead gives the
    same tokens. Six prompts on four rows: finished requests' rows are handed out again."""
    monkeypatch.setattr(device_step, "TABLE_CELLS", table_cells)
    model = random_model(FAMILIES["llama"], seed=0, device=cuda_device)
    reference = random_model(FAMILIES["llama"], seed=0, device=cuda_device)
    reference.set_attn_implementation("sdpa")
    rng = np.random.default_rng(1)
    prompts = [NamedPrompt(str(i), rng.integers(0, 96, n).tolist())
               for i, n in enumerate((3, 40, 17, 130, 64, 9))]
    expected = _generated(reference, prompts, 16)
    core, client = _client(model, longest=200, batch=4, dtype="float32", overlap=True,
                           own_table=own_table, max_workers=1)
    try:
        assert client.registration is not None
        assert client.registration.own_table is own_table
        assert (client.pool is not None and client.pool.fence is None) is own_table
        engine = Engine(model, client, _drafter(expected, True), draft_len=3, overlap=True,
                        validate=True, cuda_graphs=True)
        assert engine.run(prompts, 16) == expected
        assert engine.stats.forwards_ahead > 0 and engine.stats.table_violations == 0
        assert engine.stats.graph_replays > 0
        torch.cuda.synchronize()  # the run's last changes, flushed behind its last step
        np.testing.assert_array_equal(client.pool.block_table.cpu().numpy(),
                                      core.manager.table.host)
    finally:
        core.close()


@pytest.mark.parametrize("family", ["mistral", "deepseek_v3_window"])
@pytest.mark.parametrize(("overlap", "cuda_graphs", "prefix_caching"), [
    (False, False, False), (True, False, False), (True, True, False), (False, False, True),
    (True, False, True)],
    ids=["sync", "overlap", "overlap-graphs", "sync-prefix-caching", "overlap-prefix-caching"])
def test_float32_on_a_windowed_cuda_pool_equals_generate(cuda_device: str, family: str,
                                                         overlap: bool, cuda_graphs: bool,
                                                         prefix_caching: bool) -> None:
    """A pool that gives back the blocks behind the window of 32 (poisoned with NaN first):
    Mistral, and the DeepSeek-V3 shape with a window (transformers' sdpa given the window in
    its mask is its reference), through the GQA and the latent kernels. With prefix caching
    the prompts share a 64-token prefix, twice the window: later ones hit it with their first
    columns released, reading only the cached blocks of their window."""
    config = FAMILIES["mistral"] if family == "mistral" else DEEPSEEK_WINDOWED
    model = random_model(config, seed=0, device=cuda_device)
    reference = random_model(config, seed=0, device=cuda_device)
    AttentionInterface.register(WINDOWED_SDPA, windowed_sdpa)
    reference.set_attn_implementation("sdpa" if family == "mistral" else WINDOWED_SDPA)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 96, 64).tolist() if prefix_caching else []
    prompts = [NamedPrompt(str(i), shared + rng.integers(0, 96, n).tolist())
               for i, n in enumerate((1, 5, 17, 40, 130, 236))]
    expected = _generated(reference, prompts, 16)
    # Two rows with prefix caching: later prompts are admitted once earlier ones finished.
    outputs, engine = _run(model, prompts, 16, _drafter(expected, overlap), 3, longest=316,
                           batch=2 if prefix_caching else 8, dtype="float32", overlap=overlap,
                           prefix_caching=prefix_caching, cuda_graphs=cuda_graphs, window=32)
    assert outputs == expected
    stats = engine.stats
    assert stats.table_violations == 0 and stats.accepted_drafts > 0
    assert (stats.cached_prompt_tokens > 0) == prefix_caching


@pytest.mark.parametrize(("overlap", "cuda_graphs"), [(False, False), (True, True)],
                         ids=["sync", "overlap-graphs"])
def test_float32_on_a_grouped_cuda_pool_equals_generate(cuda_device: str, overlap: bool,
                                                        cuda_graphs: bool) -> None:
    """Qwen2 with layer 0 full and layer 1 sliding over 32 on a service's pool of two groups
    (`sized_groups`, as ``kvalloc worker --in-process`` makes them), each its own KV, staging
    and block table, every pool and staging poisoned with NaN: every layer through its group's
    table, the kernels launched per group, decode steps replayed as graphs captured over both
    tables."""
    model = random_model(MIXED, seed=0, device=cuda_device)
    reference = random_model(MIXED, seed=0, device=cuda_device)
    reference.set_attn_implementation("sdpa")
    rng = np.random.default_rng(3)
    prompts = [NamedPrompt(str(i), rng.integers(0, 96, n).tolist())
               for i, n in enumerate((1, 17, 40, 130))]
    expected = _generated(reference, prompts, 16)
    core, client = _client(model, longest=150, batch=4, dtype="float32", overlap=overlap,
                           grouped=True)
    try:
        assert [g.window for g in client.pool.groups] == [None, 32]
        for group in client.pool.groups:
            group.kv.fill_(float("nan"))
            group.staging.fill_(float("nan"))
        engine = Engine(model, client, _drafter(expected, overlap), draft_len=3,
                        overlap=overlap, validate=True, cuda_graphs=cuda_graphs)
        assert engine.run(prompts, 16) == expected
    finally:
        core.close()
    stats = engine.stats
    assert stats.table_violations == 0 and stats.accepted_drafts > 0
    assert (stats.graph_replays > 0) == cuda_graphs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_float32_on_cuda_with_a_host_tier_equals_generate_across_a_restart(
        cuda_device: str, overlap: bool) -> None:
    """A pool of two requests' blocks under prompts that share a prefix: their cached blocks are
    evicted while later ones run and come back from the host tier (pinned memory, copied on
    streams of their own, ordered before the forward by the step fence alone), in the first run
    and in a second run by a new session of the same worker. Pool and tier start as NaN."""
    config = FAMILIES["llama"]
    model = random_model(config, seed=0, device=cuda_device)
    reference = random_model(config, seed=0, device=cuda_device)
    reference.set_attn_implementation("sdpa")
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 96, 64).tolist()
    prompts = [NamedPrompt(str(i), shared[: 16 * (i % 4 + 1)] + rng.integers(0, 96, n).tolist())
               for i, n in enumerate((40, 130, 17, 90, 60, 120, 33, 100))]
    expected = _generated(reference, prompts, 16)
    pool = pool_for_model(model.config, longest=256, num_requests=2, draft_len=3,
                          dtype="float32", device="cuda", max_batch_size=2)
    # A long lease: the first forwards compile their kernels, longer than the default lease.
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=2048, prefix_caching=True,
                                     host_tier_bytes=256 * pool.bytes_per_block,
                                     lease_ttl_s=600))
    try:
        core.pool.storage.kv.fill_(float("nan"))
        core.pool.tier_stores[0].memory.view(torch.float32).fill_(float("nan"))
        for _ in range(2):
            core.drop_worker("gpu-worker")  # the second run's worker: a new session
            client = Client.in_process(core, worker_id="gpu-worker")
            client.register(overlap=overlap)
            engine = Engine(model, client, _drafter(expected, overlap), draft_len=3,
                            overlap=overlap, validate=True, share_prefixes=True)
            assert engine.run(prompts, 16) == expected
            assert engine.stats.table_violations == 0
        counters = core.manager.tier.counters
        assert counters.offloaded_blocks > 0 and counters.onboarded_blocks > 0
        assert core.manager.counters.evicted_blocks > 0
        core.check_invariants()
    finally:
        core.close()


def _generated(reference: torch.nn.Module, prompts: list[NamedPrompt],
               new_tokens: int) -> dict[str, list[int]]:
    expected = {}
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p.token_ids], device=reference.device)
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=new_tokens)
            expected[p.req_id] = out[0, ids.shape[1]:].tolist()
    return expected


def _drafter(expected: dict[str, list[int]], overlap: bool) -> object:
    return (DeviceOracleDrafter(expected, 0.5, vocab_size=96, device=torch.device("cuda"))
            if overlap else OracleDrafter(expected, 0.5, vocab_size=96))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_after_a_warm_up_every_decode_step_replays_a_captured_graph(cuda_device: str,
                                                                    overlap: bool) -> None:
    """The warm-up captures every batch bucket's graph on the spare row; the run after it
    captures none, and its tokens are generate's (the pool poisoned with NaN first)."""
    config = FAMILIES["llama"]
    model = random_model(config, seed=0, device=cuda_device)
    reference = random_model(config, seed=0, device=cuda_device)
    reference.set_attn_implementation("sdpa")
    rng = np.random.default_rng(2)
    prompts = [NamedPrompt(str(i), rng.integers(0, 96, n).tolist())
               for i, n in enumerate((3, 9, 30, 70, 120))]
    expected = _generated(reference, prompts, 16)
    core, client = _client(model, longest=140, batch=8, dtype="float32", overlap=overlap)
    try:
        client.pool.kv.fill_(float("nan"))
        engine = Engine(model, client, _drafter(expected, overlap), draft_len=3,
                        overlap=overlap, validate=True, cuda_graphs=True)
        engine.warm_up()
        graphs = engine.step.graphs
        assert graphs is not None
        captured = graphs.captured
        assert captured == 4  # batches of 1, 2, 4 and 8
        assert engine.run(prompts, 16) == expected
    finally:
        core.close()
    assert graphs.captured == captured and graphs.replayed > 0
    assert engine.stats.padded_entries > 0 and engine.stats.table_violations == 0


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_an_overlap_step_never_makes_the_host_wait(cuda_device: str, cuda_graphs: bool) -> None:
    """Every launch of an overlap worker's step (inputs, forward, verification, commit) runs
    under torch's sync debug mode set to error: a read back anywhere in it would raise. With
    CUDA graphs, every launch that replays one (a capture itself synchronises)."""
    model = random_model(FAMILIES["llama"], seed=0, device=cuda_device)
    rng = np.random.default_rng(1)
    prompts = [NamedPrompt(str(i), rng.integers(0, 96, n).tolist()) for i, n in
               enumerate((3, 9, 30, 70))]
    truth = {p.req_id: rng.integers(0, 96, 24).tolist() for p in prompts}
    core, client = _client(model, longest=100, batch=4, dtype="float32", overlap=True)
    try:
        engine = Engine(model, client, DeviceOracleDrafter(truth, 0.5, vocab_size=96,
                                                           device=torch.device(cuda_device)),
                        draft_len=3, overlap=True, cuda_graphs=cuda_graphs)
        launch, checked_launches = engine.step.launch, []

        def checked(plan: LaunchPlan) -> object:
            if engine.step.graphs is None or engine.step.replays(plan):
                checked_launches.append(plan)
                with no_host_sync():
                    return launch(plan)
            return launch(plan)

        engine.step.launch = checked  # type: ignore[method-assign]
        outputs = engine.run(prompts, 24)
    finally:
        core.close()
    assert checked_launches
    assert all(len(v) == 24 for v in outputs.values())
    assert engine.stats.forwards_ahead > 0
    assert (engine.stats.graph_replays > 0) == cuda_graphs


def test_one_billion_shape_in_bfloat16_agrees_with_its_plain_run(
        cuda_device: str, record_property: Callable[[str, object], None]) -> None:
    model = random_model(ONE_B, seed=0, dtype=torch.bfloat16, device=cuda_device)
    rng = np.random.default_rng(0)
    prompts = [NamedPrompt(str(i), rng.integers(0, ONE_B.vocab_size, int(n)).tolist())
               for i, n in enumerate(rng.integers(64, 512, 16))]
    pool = {"longest": 512 + 32, "batch": 16, "dtype": "bfloat16"}
    plain, _ = _run(model, prompts, 32, None, 0, **pool)
    agreement, runs = {}, {}
    device = torch.device(cuda_device)
    for name, drafter, overlap, graphs in [
            ("oracle:0.6", OracleDrafter(plain, 0.6, vocab_size=32000), False, False),
            ("ngram", NgramDrafter(), False, False),
            ("overlap oracle:0.6", DeviceOracleDrafter(plain, 0.6, vocab_size=32000,
                                                       device=device), True, False),
            ("overlap oracle:0.6 graphs", DeviceOracleDrafter(plain, 0.6, vocab_size=32000,
                                                              device=device), True, True)]:
        outputs, engine = _run(model, prompts, 32, drafter, 3, overlap=overlap,
                               cuda_graphs=graphs, **pool)
        assert engine.stats.table_violations == 0
        assert all(len(outputs[p.req_id]) == 32 for p in prompts)
        runs[name] = outputs
        agreement[name] = float(np.mean([_agreed_prefix(plain[k], outputs[k]) / 32
                                         for k in plain]))
        # In the junit XML of the GPU run, beside the log.
        record_property(f"agreement[{name}]", round(agreement[name], 4))
        record_property(f"acceptance[{name}]", round(engine.stats.acceptance_rate, 4))
        print(f"bf16 1B shape, {name}: agreement with the plain run {agreement[name]:.1%}, "
              f"acceptance {engine.stats.acceptance_rate:.1%}")
    # The graphs' run against the same worker's run without them (padded drafts and batches
    # batch its tokens differently, so bf16 may drift there too).
    eager, graphed = runs["overlap oracle:0.6"], runs["overlap oracle:0.6 graphs"]
    agreement["graphs vs eager"] = float(np.mean([_agreed_prefix(eager[k], graphed[k]) / 32
                                                  for k in eager]))
    record_property("agreement[graphs vs eager]", round(agreement["graphs vs eager"], 4))
    print(f"bf16 1B shape, graphs against the eager overlap run: agreement "
          f"{agreement['graphs vs eager']:.1%}")
    # Each request's first token comes from its prompt alone; drift after that is bf16 noise.
    assert all(rate > 0 for rate in agreement.values())


def _agreed_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
