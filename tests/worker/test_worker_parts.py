"""The worker's parts on their own: drafters, prompt files, model loading, and the engine's
refusals of input it cannot serve."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvalloc.worker.attention.hook import PoolStep
from kvalloc.worker.attention.pool_attention import PagedLayout
from kvalloc.worker.cli import read_prompts
from kvalloc.worker.drafters import (
    DeviceOracleDrafter,
    NgramDrafter,
    OracleDrafter,
    parse_drafter_spec,
)
from kvalloc.worker.engine import Engine
from kvalloc.worker.errors import (
    DrafterSpecError,
    EngineError,
    KvallocAttentionError,
    LayoutMismatch,
    ModelLoadError,
    PromptFileError,
)
from kvalloc.worker.model import config_from_file, kv_shape, load_model, random_model
from kvalloc.worker.requests import NamedPrompt
from worker_oracle import CONFIGS, Oracle, make_oracle, pool_config

pytest_plugins = ["worker_fixtures"]


def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    context = np.array([5, 1, 2, 7, 8, 9, 1, 2, 3, 4, 0, 1, 2])
    # "1 2" occurred twice before the end; the later one was followed by 3 4 0.
    assert NgramDrafter().propose("r", context, 0, 3).tolist() == [3, 4, 0]
    # The longest n-gram wins over a more recent shorter one: "9 1 2" -> 3 4.
    assert NgramDrafter().propose("r", np.array([9, 1, 2, 3, 4, 2, 5, 9, 1, 2]), 0,
                                  2).tolist() == [3, 4]
    assert NgramDrafter().propose("r", np.array([1, 2, 3]), 0, 3).tolist() == []
    assert NgramDrafter().propose("r", np.array([4]), 0, 3).tolist() == []


def test_oracle_drafts_the_truth_at_its_rate() -> None:
    truth = {"r": list(range(10, 60))}
    exact = OracleDrafter(truth, 1.0, vocab_size=100)
    assert exact.propose("r", np.zeros(3), 4, 3).tolist() == [14, 15, 16]
    assert exact.propose("r", np.zeros(3), 48, 3).tolist() == [58, 59]  # the truth runs out
    wrong = OracleDrafter(truth, 0.0, vocab_size=100).propose("r", np.zeros(3), 0, 50)
    assert ((wrong != truth["r"]) & (wrong >= 0) & (wrong < 100)).all()
    half = OracleDrafter({"r": [3] * 4000}, 0.5, vocab_size=100, seed=1)
    right = (half.propose("r", np.zeros(1), 0, 4000) == 3).mean()
    assert 0.45 < right < 0.55


def test_the_device_oracle_drafts_the_truth_at_its_rate_from_its_row_and_position() -> None:
    """Its draws are a function of (seed, row, position): the same again for the same ones
    (a replayed graph holds no generator state), independent across positions, at the rate."""
    truth = torch.arange(10, 4010).repeat(4, 1)
    rows, generated = torch.tensor([0, 2, 3]), torch.tensor([0, 7, 400, 400])

    def drafter(rate: float, seed: int = 1) -> DeviceOracleDrafter:
        return DeviceOracleDrafter({}, rate, vocab_size=5000, device=torch.device("cpu"),
                                   seed=seed)

    exact = drafter(1.0).draft(truth, rows, generated, 3)
    assert exact.tolist() == [[10, 11, 12], [410, 411, 412], [410, 411, 412]]
    wrong = drafter(0.0).draft(truth, rows, generated, 3)
    assert ((wrong != exact) & (wrong >= 0) & (wrong < 5000)).all()
    half = drafter(0.5)
    many = half.draft(truth, torch.arange(4), torch.zeros(4, dtype=torch.int64), 3000)
    right = (many == truth[:, :3000]).double().mean().item()
    assert 0.47 < right < 0.53
    assert torch.equal(half.draft(truth, rows, generated, 3),
                       half.draft(truth, rows, generated, 3))
    assert not torch.equal(many, drafter(0.5, seed=2).draft(
        truth, torch.arange(4), torch.zeros(4, dtype=torch.int64), 3000))
    # Two rows at one position draw apart.
    assert not torch.equal(many[0], many[1])


@pytest.mark.parametrize(("spec", "want"), [("ngram", ("ngram", None)),
                                            ("oracle:0.6", ("oracle", 0.6)),
                                            ("oracle:1", ("oracle", 1.0))])
def test_drafter_specs(spec: str, want: tuple[str, float | None]) -> None:
    assert parse_drafter_spec(spec) == want


@pytest.mark.parametrize("spec", ["", "eagle", "oracle", "oracle:x", "oracle:1.5", "ngram:2"])
def test_bad_drafter_specs_name_the_problem(spec: str) -> None:
    with pytest.raises(DrafterSpecError, match=r"drafter|oracle"):
        parse_drafter_spec(spec)


def test_prompt_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": 1, "token_ids": [4, 5]}\n\n{"id": "b", "token_ids": [6]}\n')
    assert read_prompts(path) == [NamedPrompt("1", [4, 5]), NamedPrompt("b", [6])]


@pytest.mark.parametrize(("text", "match"), [
    ("", "holds no prompt"),
    ("not json\n", "line 1: not JSON"),
    ('{"token_ids": [1]}\n', "line 1: needs an object"),
    ('{"id": 1}\n{"id": 2, "token_ids": []}\n', "line 1: needs"),
    ('{"id": 2, "token_ids": []}\n', "line 1: token_ids must be"),
    ('{"id": 2, "token_ids": [1, "x"]}\n', "line 1: token_ids must be"),
    ('{"id": 2, "text": "hello"}\n', "needs --model with a tokenizer"),
])
def test_bad_prompt_files_name_the_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(PromptFileError, match=match):
        read_prompts(path)


def test_a_saved_checkpoint_loads_with_the_same_weights(tmp_path: Path) -> None:
    model = random_model(CONFIGS["llama"], seed=3)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(str(tmp_path / "ckpt"))
    assert loaded.config._attn_implementation == "kvalloc"
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(next(random_model(CONFIGS["llama"], seed=4).parameters()),
                           next(model.parameters()))


def test_model_loading_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing does not exist"):
        load_model(str(tmp_path / "missing"))
    bad_family = tmp_path / "gpt2.json"
    bad_family.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        config_from_file(bad_family)
    no_type = tmp_path / "untyped.json"
    no_type.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="model_type"):
        config_from_file(no_type)
    good = tmp_path / "qwen2.json"
    good.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 16,
                                "num_attention_heads": 2}))
    assert config_from_file(good).hidden_size == 16


def test_the_kvalloc_attention_needs_a_step(llama_oracle: Oracle) -> None:
    with pytest.raises(KvallocAttentionError, match="kvalloc_step"):
        llama_oracle.model(torch.tensor([[1, 2, 3]]), use_cache=False)


def test_the_engine_refuses_a_pool_that_does_not_fit_the_model(llama_oracle: Oracle,
                                                               connect: Callable) -> None:
    model = llama_oracle.model
    with pytest.raises(LayoutMismatch, match="num_kv_heads: the pool has 1, the model needs 2"):
        Engine(model, connect(pool_config(model, num_kv_heads=1)), None, draft_len=0)
    with pytest.raises(LayoutMismatch, match="dtype"):
        Engine(model, connect(pool_config(model, dtype="bfloat16")), None, draft_len=0)
    with pytest.raises(LayoutMismatch, match="kv_layout: the pool has latent, the model needs kv"):
        Engine(model, connect(pool_config(model, kv_layout="latent", num_kv_heads=1)), None,
               draft_len=0)
    elsewhere = random_model(CONFIGS["llama"], seed=0, device="meta")
    with pytest.raises(LayoutMismatch, match="device: the pool is on cpu, the model on meta"):
        Engine(elsewhere, connect(pool_config(model)), None, draft_len=0)


def test_a_pool_that_does_not_fit_names_every_field_and_the_serve_flags_that_would(
        llama_oracle: Oracle, connect: Callable) -> None:
    """One attempt tells every mismatched field, and the `kvalloc serve` flags of the pool the
    model needs; an engine built on those flags' values fits."""
    model = llama_oracle.model
    layers, heads, head_dim = kv_shape(model.config)
    with pytest.raises(LayoutMismatch) as refused:
        Engine(model, connect(pool_config(model, num_layers=layers + 1, num_kv_heads=heads * 2,
                                          head_dim=head_dim * 2, dtype="bfloat16")),
               None, draft_len=0)
    message = str(refused.value)
    for wrong in (f"num_layers: the pool has {layers + 1}, the model needs {layers}",
                  f"num_kv_heads: the pool has {heads * 2}, the model needs {heads}",
                  f"head_dim: the pool has {head_dim * 2}, the model needs {head_dim}",
                  "dtype: the pool stages torch.bfloat16, the model runs in torch.float32"):
        assert wrong in message
    flags = message.split("kvalloc serve ")[1].split()
    assert flags == ["--num-layers", str(layers), "--num-kv-heads", str(heads),
                     "--head-dim", str(head_dim), "--dtype", "float32"]
    fitting = dict(zip((f.removeprefix("--").replace("-", "_") for f in flags[::2]), flags[1::2],
                       strict=True))
    Engine(model, connect(pool_config(model, num_layers=int(fitting["num_layers"]),
                                      num_kv_heads=int(fitting["num_kv_heads"]),
                                      head_dim=int(fitting["head_dim"]), dtype=fitting["dtype"])),
           None, draft_len=0)


def test_the_engine_refuses_bad_requests_before_any_call(llama_oracle: Oracle,
                                                         connect: Callable) -> None:
    client = connect(pool_config(llama_oracle.model))
    engine = Engine(llama_oracle.model, client, NgramDrafter(), draft_len=3)
    step_id = client.next_step_id
    for prompts, match in [
        ([NamedPrompt("a", [1, 96])], "outside the vocabulary"),
        ([NamedPrompt("a", [])], "at least one token"),
        ([NamedPrompt("a", [1]), NamedPrompt("a", [2])], "unique"),
        ([NamedPrompt("a", [1] * 90)], "max_seq_len"),
    ]:
        with pytest.raises(EngineError, match=match):
            engine.run(prompts, 10)
    with pytest.raises(EngineError, match="max_new_tokens"):
        engine.run([NamedPrompt("a", [1])], 0)
    with pytest.raises(EngineError, match="draft_len: 4"):
        Engine(llama_oracle.model, client, NgramDrafter(), draft_len=4)
    assert client.next_step_id == step_id  # nothing reached the service


def test_an_mla_model_needs_a_latent_pool_and_is_told_the_flag(connect: Callable) -> None:
    """DeepSeek-V3 against a K/V pool of the latent's shape (two planes): refused, naming the
    layout and the `kvalloc serve` flags of the latent pool it needs, on which it runs."""
    model = make_oracle("deepseek_v3").model
    with pytest.raises(LayoutMismatch) as refused:
        Engine(model, connect(pool_config(model, kv_layout="kv")), None, draft_len=0)
    message = str(refused.value)
    assert "kv_layout: the pool has kv, the model needs latent" in message
    layers, _, width = kv_shape(model.config)
    assert message.endswith(f"--num-layers {layers} --num-kv-heads 1 --head-dim {width} "
                            f"--dtype float32 --kv-layout latent")
    Engine(model, connect(pool_config(model)), None, draft_len=0)


def test_an_mla_model_not_switched_to_the_latent_forward_is_told_so(connect: Callable) -> None:
    """A DeepSeek-V3 model's own attention forward over a latent pool's step reaches the hook,
    which has no per-head K/V to stage there: a typed error naming the switch."""
    oracle = make_oracle("deepseek_v3")
    plain = random_model(oracle.model.config, seed=0)
    client = connect(pool_config(plain))
    layout = PagedLayout.build(client.pool.block_table, 4, rows=np.array([0]),
                               query_starts=np.array([0]), query_lens=np.array([3]),
                               starts=np.array([0]), group_width=3)
    step = PoolStep.of(client.pool.kv, client.pool.staging, layout)
    with pytest.raises(KvallocAttentionError, match=r"^kv_layout: .*switch_mla_modules"):
        plain(torch.tensor([[1, 2, 3]]), use_cache=False, kvalloc_step=step)
