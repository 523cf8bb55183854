"""`kvalloc worker` end to end: in process, and against a real `kvalloc serve` over ZeroMQ and
the stream socket, synchronous and one step ahead (``--overlap``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from command_help import help_and_imports
from kvalloc.allocator import LayerGroup, PoolConfig
from kvalloc.server.cli import main
from kvalloc.server.client import Client, in_process_client
from kvalloc.server.contract import wire
from kvalloc.server.contract.sharing import OWNER_SUFFIX, SHM_DIR
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command
from kvalloc.server.serve_arguments import layer_group_flag
from kvalloc.worker import cli as worker_cli
from kvalloc.worker.cli import default_worker_id
from kvalloc.worker.model import kv_layout, kv_shape, sized_groups
from sigint import Interrupted, interrupt_once_progressing
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast
from worker_oracle import (
    MAX_DRAFT_LEN,
    MAX_NEW_TOKENS,
    TOKENS_PER_BLOCK,
    Oracle,
    make_oracle,
    pool_config,
)

pytest_plugins = ["worker_fixtures"]


def write_inputs(oracle: Oracle, tmp_path: Path) -> tuple[Path, Path]:
    config, prompts = tmp_path / "cfg.json", tmp_path / "prompts.jsonl"
    oracle.model.config.to_json_file(config)
    prompts.write_text("".join(json.dumps({"id": p.req_id, "token_ids": list(p.token_ids)}) + "\n"
                               for p in oracle.prompts))
    return config, prompts


def worker_args(config: Path, prompts: Path, *extra: str) -> list[str]:
    return ["worker", "--model-config", str(config), "--prompts", str(prompts), "--seed", "0",
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--tokens-per-block", str(TOKENS_PER_BLOCK),
            "--json", "--no-progress", *extra]


def outputs(stdout: str) -> dict[str, list[int]]:
    result = json.loads(stdout)
    assert result["generated_tokens"] > 0 and 0 <= result["call_share"] < 1
    assert result["tokens_per_s"] > 0
    return {o["id"]: o["token_ids"] for o in result["outputs"]}


def test_in_process_cli_prints_the_generated_tokens(oracle: Oracle, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(oracle, tmp_path)
    assert main(worker_args(config, prompts, "--in-process", "--draft-len", "3",
                            "--drafter", "oracle:0.5", "--max-step-tokens", "64",
                            "--max-batch-size", "8")) == 0
    out = capsys.readouterr().out
    assert outputs(out) == oracle.expected
    assert 0 < json.loads(out)["acceptance_rate"] < 1


def test_in_step_with_its_own_commit_the_worker_commits_and_gives_the_same_tokens(
        oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(oracle, tmp_path)
    assert main(worker_args(config, prompts, "--in-process", "--draft-len", "3", "--drafter",
                            "oracle:0.5", "--own-commit", "--validate")) == 0
    result = json.loads(capsys.readouterr().out)
    assert outputs(json.dumps(result)) == oracle.expected
    assert result["committed_tokens"] > 0 and result["forwards_ahead"] == 0
    assert result["table_violations"] == 0


SERVICE_POOL = ["--device", "cpu", "--dtype", "float32", "--num-layers", "2", "--num-kv-heads",
                "2", "--head-dim", "8", "--num-blocks", "256", "--tokens-per-block",
                str(TOKENS_PER_BLOCK), "--max-seq-len", "96", "--max-draft-len",
                str(MAX_DRAFT_LEN), "--max-batch-size", "8", "--max-step-tokens", "48"]


def test_worker_against_a_running_service_over_ipc(llama_oracle: Oracle, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with ServiceProcess(tmp_path, *SERVICE_POOL, tcp=False) as service:
        assert main(worker_args(config, prompts, "--address", service.ipc, "--draft-len", "2",
                                "--drafter", "ngram")) == 0
    assert outputs(capsys.readouterr().out) == llama_oracle.expected


def test_an_overlap_worker_against_a_running_service_with_prefix_caching(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Over the stream socket, one step ahead, committing its own tokens into the service's
    pool under the service's write protection."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with ServiceProcess(tmp_path, *SERVICE_POOL, "--prefix-caching", tcp=False) as service:
        assert main(worker_args(config, prompts, "--address", service.stream, "--draft-len",
                                "3", "--drafter", "oracle:0.5", "--overlap", "--validate")) == 0
    result = json.loads(capsys.readouterr().out)
    assert {o["id"]: o["token_ids"] for o in result["outputs"]} == llama_oracle.expected
    assert result["forwards_ahead"] > 0 and result["table_violations"] == 0
    assert 0 < result["acceptance_rate"] < 1


def test_an_mla_overlap_worker_against_a_latent_service(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSeek-V3 against a `kvalloc serve --kv-layout latent` pool (one head of latent +
    rope key a layer), one step ahead with prefix caching and the table validator."""
    oracle = make_oracle("deepseek_v3")
    config, prompts = write_inputs(oracle, tmp_path)
    layout = oracle.model.config
    pool = [*SERVICE_POOL, "--num-layers", str(layout.num_hidden_layers), "--num-kv-heads", "1",
            "--head-dim", str(layout.kv_lora_rank + layout.qk_rope_head_dim), "--kv-layout",
            "latent", "--prefix-caching"]
    with ServiceProcess(tmp_path, *pool, tcp=False) as service:
        assert main(worker_args(config, prompts, "--address", service.stream, "--draft-len",
                                "3", "--drafter", "oracle:0.5", "--overlap", "--validate")) == 0
    result = json.loads(capsys.readouterr().out)
    assert {o["id"]: o["token_ids"] for o in result["outputs"]} == oracle.expected
    assert result["forwards_ahead"] > 0 and result["table_violations"] == 0


def prefix_hit_tokens(service: ServiceProcess) -> float:
    """The service's ``kvalloc_prefix_hit_tokens_total``, from its /metrics."""
    with urllib.request.urlopen(f"{service.rest_tcp}/metrics", timeout=30) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("kvalloc_prefix_hit_tokens_total "):
                return float(line.split()[1])
    raise AssertionError("no kvalloc_prefix_hit_tokens_total in /metrics")


# Scrapes read a copy the service refreshes at most once a second (and at least once a lease
# reaper's look, every second): a loaded machine may hold it back several times that.
METRICS_REFRESH_S = 60.0


def test_a_second_run_reuses_the_prefixes_the_first_run_cached(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of the same prompts, one after the other, against one --prefix-caching
    service: the worker sends its prompts' token ids under a worker id that is the same each
    run, so the second finds the first's prompt blocks cached (and skips their prefill), and
    the service counts those tokens as prefix hits."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with ServiceProcess(tmp_path, *SERVICE_POOL, "--prefix-caching") as service:
        runs = []
        for _ in range(2):
            # No oracle drafter (nor the overlap that needs one): it runs the prompts first.
            assert main(worker_args(config, prompts, "--address", service.stream,
                                    "--validate", "--draft-len", "2")) == 0
            runs.append(json.loads(capsys.readouterr().out))
        first, second = runs
        assert first["cached_prompt_tokens"] == 0 and second["cached_prompt_tokens"] > 0
        deadline = time.monotonic() + METRICS_REFRESH_S
        while (hits := prefix_hit_tokens(service)) < second["cached_prompt_tokens"]:
            assert time.monotonic() < deadline, hits
            time.sleep(0.2)
        assert hits == second["cached_prompt_tokens"]
    assert outputs(json.dumps(second)) == llama_oracle.expected


def test_a_second_worker_under_the_same_id_is_told_to_name_itself(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default worker id is held by a running worker: one line naming --worker-id, and
    --replace for a worker that is gone."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with (ServiceProcess(tmp_path, *SERVICE_POOL, tcp=False) as service,
          Client(service.stream, worker_id=default_worker_id(None)) as holder):
        holder.register()
        assert main(worker_args(config, prompts, "--address", service.stream)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"kvalloc worker: worker id {default_worker_id(None)!r} is in use by a "
                    f"running worker; give this one another with --worker-id (or, if that "
                    f"worker is gone, take its id with --replace)")


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize(("policy", "violations"), [("reclaim", False), ("none", True)])
def test_the_validator_sees_a_service_without_slack(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    policy: str, violations: bool,
                                                    family: str) -> None:
    """Mistral's in-process pool is windowed (every layer slides 16): the validator checks
    each row from its window's first column, where the released ones end."""
    oracle = make_oracle(family)
    config, prompts = write_inputs(oracle, tmp_path)
    assert main(worker_args(config, prompts, "--in-process", "--overlap", "--validate",
                            "--draft-len", "3", "--drafter", "oracle:1.0", "--max-step-tokens",
                            "64", "--max-batch-size", "8", "--slack-policy", policy)) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["table_violations"] > 0) == violations
    assert result["forwards_ahead"] > 0


WINDOWED_LATENT = "deepseek_v3_window"


def windowed_pool(oracle: Oracle) -> list[str]:
    """`SERVICE_POOL` shaped for ``oracle``'s model, with its window: a latent pool for an MLA
    model."""
    config = oracle.model.config
    layers, heads, head_dim = kv_shape(config)
    return [*SERVICE_POOL, "--num-layers", str(layers), "--num-kv-heads", str(heads),
            "--head-dim", str(head_dim), "--kv-layout", kv_layout(config),
            "--window", str(config.sliding_window)]


@pytest.mark.parametrize("family", ["mistral", WINDOWED_LATENT])
def test_a_worker_process_against_a_windowed_service(tmp_path: Path, family: str) -> None:
    """`kvalloc worker` and `kvalloc serve --window 16` each a process of its own, one step
    ahead with the table validator: generate's tokens (for the DeepSeek-V3-shaped model with a
    window, transformers' sdpa with the window in its mask), no violation, and the service
    holds nothing after."""
    oracle = make_oracle(family)
    config, prompts = write_inputs(oracle, tmp_path)
    with ServiceProcess(tmp_path, *windowed_pool(oracle), tcp=False) as service:
        r = subprocess.run([*kvalloc_command(), *worker_args(
            config, prompts, "--address", service.stream, "--draft-len", "3", "--drafter",
            "oracle:0.5", "--overlap", "--validate")], capture_output=True, text=True,
            timeout=300)
        with Client(service.stream, worker_id="observer") as client:
            state = client.get_pool(verify=True)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert outputs(r.stdout) == oracle.expected
    assert result["forwards_ahead"] > 0 and result["table_violations"] == 0
    assert state.layout.window == 16 and state.num_requests == 0 and state.used_blocks == 0
    layout = "latent" if family == WINDOWED_LATENT else "kv"
    assert f"({layout} layout, window 16, at most 8 blocks a request)" in service.log()


@pytest.mark.parametrize("family", ["mistral", WINDOWED_LATENT])
def test_a_second_run_hits_the_prefixes_a_windowed_service_parked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str) -> None:
    """`kvalloc serve --window 16 --prefix-caching`: the first run's prompt blocks stay cached
    (parked) after its requests end, and the second run's longer prompts hit them, needing
    only the blocks of their windows; both runs give generate's tokens."""
    oracle = make_oracle(family)
    config, prompts = write_inputs(oracle, tmp_path)
    with ServiceProcess(tmp_path, *windowed_pool(oracle), "--prefix-caching") as service:
        runs = []
        for _ in range(2):
            # No oracle drafter (nor the overlap that needs one): it runs the prompts first.
            assert main(worker_args(config, prompts, "--address", service.stream,
                                    "--validate", "--draft-len", "2")) == 0
            runs.append(json.loads(capsys.readouterr().out))
        with Client(service.stream, worker_id="observer") as client:
            state = client.get_pool(verify=True)
    first, second = runs
    assert first["cached_prompt_tokens"] == 0 and second["cached_prompt_tokens"] > 16
    assert second["table_violations"] == 0
    assert outputs(json.dumps(first)) == outputs(json.dumps(second)) == oracle.expected
    assert state.num_requests == 0 and state.invariants == "ok"


@pytest.mark.parametrize(("policy", "violations"), [("reclaim", False), ("none", True)])
def test_the_validator_sees_a_windowed_latent_service_without_slack(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str,
        violations: bool) -> None:
    """A `kvalloc serve --kv-layout latent --window 16` pool for the DeepSeek-V3-shaped model
    with a window: under --slack-policy none the device's writes outrun the rows' blocks."""
    oracle = make_oracle(WINDOWED_LATENT)
    config, prompts = write_inputs(oracle, tmp_path)
    with ServiceProcess(tmp_path, *windowed_pool(oracle), "--slack-policy", policy,
                        tcp=False) as service:
        assert main(worker_args(config, prompts, "--address", service.stream, "--overlap",
                                "--validate", "--draft-len", "3", "--drafter",
                                "oracle:1.0")) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["table_violations"] > 0) == violations
    assert result["forwards_ahead"] > 0


MIXED = "qwen2_mixed"  # layer 0 full, layer 1 sliding over 16


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_an_in_process_worker_serves_a_mixed_model_in_groups(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        overlap: bool) -> None:
    """``--in-process`` for a model mixing full and sliding layers: its service holds a group
    per layer kind (`sized_groups`: the windowed one of the blocks its window needs), and the
    worker gives generate's tokens with the table validator seeing no violation."""
    oracle = make_oracle(MIXED)
    config, prompts = write_inputs(oracle, tmp_path)
    served: list[list[LayerGroup]] = []

    def recording(pool: PoolConfig, **kwargs: Any) -> Any:
        served.append(list(kwargs["groups"]))
        return in_process_client(pool, **kwargs)

    monkeypatch.setattr(worker_cli, "in_process_client", recording)
    assert main(worker_args(config, prompts, "--in-process", "--validate", "--draft-len", "3",
                            "--drafter", "oracle:0.5", "--max-step-tokens", "48",
                            "--max-batch-size", "8", *(["--overlap"] if overlap else []))) == 0
    result = json.loads(capsys.readouterr().out)
    assert outputs(json.dumps(result)) == oracle.expected
    assert result["table_violations"] == 0 and (result["forwards_ahead"] > 0) == overlap
    (groups,) = served
    assert [(g.name, g.layers, g.window) for g in groups] == [("full", (0,), None),
                                                              ("window16", (1,), 16)]
    assert groups[1].num_blocks < groups[0].num_blocks


def test_a_worker_process_against_a_grouped_service(tmp_path: Path) -> None:
    """`kvalloc serve --layer-group ...` (the groups ``--in-process`` would make) and `kvalloc
    worker` each a process of their own, the worker mapping every group from the
    registration's handles: generate's tokens synchronously and one step ahead, the validator
    checking each group's table, and the service holds nothing after."""
    oracle = make_oracle(MIXED)
    config, prompts = write_inputs(oracle, tmp_path)
    groups = sized_groups(oracle.model.config, pool_config(oracle.model).pool,
                          num_requests=len(oracle.prompts), max_step_tokens=48)
    flags = [part for g in groups for part in layer_group_flag(g).split()]
    with ServiceProcess(tmp_path, *SERVICE_POOL, *flags, tcp=False) as service:
        runs = [subprocess.run([*kvalloc_command(), *worker_args(
            config, prompts, "--address", service.stream, "--draft-len", "3", "--drafter",
            "oracle:0.5", "--validate", *mode)], capture_output=True, text=True, timeout=300)
            for mode in ((), ("--overlap",))]
        with Client(service.stream, worker_id="observer") as client:
            state = client.get_pool(verify=True)
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert outputs(r.stdout) == oracle.expected
        assert json.loads(r.stdout)["table_violations"] == 0
    assert json.loads(runs[1].stdout)["forwards_ahead"] > 0
    assert [(g.name, g.window) for g in state.layout.groups] == [("full", None),
                                                                ("window16", 16)]
    assert state.num_requests == 0 and state.invariants == "ok"
    assert (f"groups full (layers 0, 256 blocks), window16 (layers 1, {groups[1].num_blocks} "
            f"blocks, window 16)") in service.log()


def test_a_model_reading_past_the_services_window_is_a_one_line_error(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with ServiceProcess(tmp_path, *SERVICE_POOL, "--window", "16", tcp=False) as service:
        assert main(worker_args(config, prompts, "--address", service.stream)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvalloc worker: window: the pool gives back blocks behind a window "
                           "of 16, but layer 0 of the model reads its whole history")


def test_ctrl_c_prints_a_partial_summary_deregisters_and_exits_130(llama_oracle: Oracle,
                                                                   tmp_path: Path) -> None:
    """SIGINT to a real worker mid-generation: the step in flight ends, it deregisters (nothing
    of it left at the service, well before its lease), prints the figures so far, exits 130."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with ServiceProcess(tmp_path, *LONG_POOL, tcp=False) as service:
        r = _interrupted_worker(config, prompts, service.ipc, timeout_s=120)
        with Client(service.ipc, worker_id="observer") as client:
            state = client.get_pool()
    _assert_stopped_and_gone(r, state)


def test_ctrl_c_stops_every_rank_of_a_tensor_parallel_worker_at_one_step(
        llama_oracle: Oracle, tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches every process of a ``--tensor-parallel 2`` worker: the ranks
    leave it to their parent, which tells rank 0, and rank 0 stops both ranks at the same step
    boundary. So the worker still deregisters, prints its figures and exits 130."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with ServiceProcess(tmp_path, *LONG_POOL, "--devices", "cpu,cpu", "--tensor-parallel", "2",
                        tcp=False) as service:
        # Two ranks of a fresh interpreter each import torch and transformers before a step.
        r = _interrupted_worker(config, prompts, service.stream, "--tensor-parallel", "2",
                                timeout_s=240, whole_job=True)
        with Client(service.stream, worker_id="observer") as client:
            state = client.get_pool()
    _assert_stopped_and_gone(r, state)


LONG_POOL = ["--device", "cpu", "--dtype", "float32", "--num-layers", "2", "--num-kv-heads", "2",
             "--head-dim", "8", "--num-blocks", "4096", "--tokens-per-block",
             str(TOKENS_PER_BLOCK), "--max-seq-len", "4096", "--max-draft-len",
             str(MAX_DRAFT_LEN), "--max-batch-size", "8", "--max-step-tokens", "256",
             "--lease-ttl", "600"]


def _interrupted_worker(config: Path, prompts: Path, address: str, *extra: str,
                        timeout_s: float, whole_job: bool = False) -> Interrupted:
    """A worker of 3000 new tokens a prompt, Ctrl-C'd once its progress bar shows steps."""
    args = worker_args(config, prompts, "--address", address, "--draft-len", "2",
                       "--worker-id", "interrupted", *extra)
    args[args.index("--max-new-tokens") + 1] = "3000"
    args.remove("--no-progress")
    return interrupt_once_progressing([*kvalloc_command(), *args], r"[1-9]\d*/\d+",
                                      timeout_s=timeout_s, whole_job=whole_job)


def _assert_stopped_and_gone(r: Interrupted, state: wire.PoolState) -> None:
    """Exit 130 with the figures so far, and nothing of the worker left at the service, well
    before its lease."""
    assert r.returncode == 130, r.stderr
    assert "Traceback" not in r.stderr
    summary = json.loads(r.stdout)
    assert summary["interrupted"] is True and 0 < summary["generated_tokens"] < 3000
    assert state.workers == [] and state.used_blocks == 0 and state.num_requests == 0


def test_sigterm_stops_an_in_process_worker_like_ctrl_c_and_leaves_no_shared_memory(
        llama_oracle: Oracle, tmp_path: Path) -> None:
    """SIGTERM (docker stop) to a real ``--in-process`` worker mid-generation: the step in
    flight ends, it prints the figures so far, exits 128 + SIGTERM, and its pool's segments and
    owner file are gone from /dev/shm with it."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    args = worker_args(config, prompts, "--in-process", "--draft-len", "2")
    args[args.index("--max-new-tokens") + 1] = "3000"
    args.remove("--no-progress")
    r = interrupt_once_progressing([*kvalloc_command(), *args], r"[1-9]\d*/\d+",
                                   timeout_s=120, signum=signal.SIGTERM)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert "Traceback" not in r.stderr
    summary = json.loads(r.stdout)
    assert summary["interrupted"] is True and 0 < summary["generated_tokens"] < 3000
    left = [owner for owner in SHM_DIR.glob(f"kvalloc-*{OWNER_SUFFIX}")
            if _read(owner).startswith(f"pid {r.pid} ")]
    assert left == []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # removed meanwhile
        return ""


def test_cuda_graphs_on_a_cpu_pool_is_a_clear_error(llama_oracle: Oracle, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    assert main(worker_args(config, prompts, "--in-process", "--device", "cpu",
                            "--cuda-graphs")) == 2
    assert "cuda_graphs: the pool is on cpu; graphs need CUDA" in capsys.readouterr().err


def test_device_cuda_without_a_gpu_is_a_one_line_error(llama_oracle: Oracle,
                                                        tmp_path: Path) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    r = subprocess.run([*kvalloc_command(), *worker_args(config, prompts, "--in-process",
                                                         "--device", "cuda")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["kvalloc worker: --device cuda: torch sees 0 CUDA device(s) "
                                     "here; use --device cpu"]


def test_no_service_at_the_address_is_a_clear_error(llama_oracle: Oracle, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    address = f"ipc://{tmp_path / 'nobody.ipc'}"
    assert main(worker_args(config, prompts, "--address", address, "--timeout", "0.2")) == 2
    assert f"cannot reach {address}" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    (["--drafter", "eagle"], "'eagle' is not ngram or oracle:RATE"),
    (["--max-new-tokens", "0"], "max_new_tokens: 0 must be >= 1"),
])
def test_cli_errors_exit_2_with_the_reason(llama_oracle: Oracle, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], extra: list[str],
                                           message: str) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    assert main(worker_args(config, prompts, "--in-process", *extra)) == 2
    assert message in capsys.readouterr().err


def test_a_saved_checkpoint_with_a_tokenizer_serves_text_prompts(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "checkpoint"
    llama_oracle.model.save_pretrained(checkpoint)
    vocab = {f"w{i}": i for i in range(llama_oracle.model.config.vocab_size - 1)}
    vocab["[UNK]"] = len(vocab)
    words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(checkpoint)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"id": p.req_id, "text": " ".join(f"w{t}" for t in p.token_ids)}) + "\n"
        for p in llama_oracle.prompts if max(p.token_ids) < len(vocab) - 1))
    assert main(["worker", "--model", str(checkpoint), "--prompts", str(prompts),
                 "--max-new-tokens", str(MAX_NEW_TOKENS), "--draft-len", "3", "--in-process",
                 "--json", "--no-progress"]) == 0
    got = outputs(capsys.readouterr().out)
    assert got and got == {k: llama_oracle.expected[k] for k in got}


def on_two_cpus(tmp_path: Path, tensor_parallel: int) -> ServiceProcess:
    """The test pool on devices cpu,cpu: two shards, or two data-parallel ranks of one."""
    return ServiceProcess(tmp_path, *SERVICE_POOL, "--devices", "cpu,cpu", "--tensor-parallel",
                          str(tensor_parallel), tcp=False)


def test_a_tensor_parallel_worker_of_two_ranks_against_a_sharded_service(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with on_two_cpus(tmp_path, 2) as service:
        assert main(worker_args(config, prompts, "--address", service.stream,
                                "--tensor-parallel", "2", "--overlap", "--draft-len", "2",
                                "--drafter", "oracle:0.5")) == 0
        with Client(service.stream, worker_id="observer") as client:
            assert client.get_pool(verify=True).num_requests == 0
    out = capsys.readouterr().out
    assert outputs(out) == llama_oracle.expected
    assert 0 < json.loads(out)["acceptance_rate"] < 1


def test_tensor_parallel_in_process_is_a_one_line_error(llama_oracle: Oracle, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    assert main(worker_args(config, prompts, "--in-process", "--tensor-parallel", "2")) == 2
    assert capsys.readouterr().err == (
        "kvalloc worker: --tensor-parallel 2: needs 1 or more ranks and a running kvalloc serve "
        "of as many shards (not --in-process)\n")


def test_a_worker_of_each_data_parallel_rank_against_a_service_of_two(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with on_two_cpus(tmp_path, 1) as service:
        assert main(worker_args(config, prompts, "--address", service.stream,
                                "--draft-len", "0")) == 2
        assert "422 unknown_rank: data_parallel_rank: None is not a rank of this service" in (
            capsys.readouterr().err)
        for rank in (0, 1):
            assert main(worker_args(config, prompts, "--address", service.stream,
                                    "--data-parallel-rank", str(rank), "--draft-len", "0",
                                    "--worker-id", f"rank{rank}")) == 0
            assert outputs(capsys.readouterr().out) == llama_oracle.expected


@pytest.mark.parametrize("token", [2**63, -1, "vocab"])
def test_a_prompt_token_outside_the_vocabulary_is_a_one_line_error(
        llama_oracle: Oracle, tmp_path: Path, token: int | str) -> None:
    """2^63 does not fit the int64 a token travels as, -1 and vocab_size index no embedding:
    each is named with its line and position, nothing runs, exit 2."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    vocab = llama_oracle.model.config.vocab_size
    bad = vocab if token == "vocab" else token
    prompts.write_text(json.dumps({"id": "x", "token_ids": [1, 2, bad]}) + "\n")
    r = subprocess.run([*kvalloc_command(), *worker_args(config, prompts, "--in-process")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"kvalloc worker: prompts: {prompts} line 1: token_ids[2]: {bad} is not a token of "
        f"the model (0 to {vocab - 1})"]


def test_a_tensor_parallel_degree_that_does_not_split_the_heads_is_a_one_line_error(
        llama_oracle: Oracle, tmp_path: Path) -> None:
    """--tensor-parallel 3 against a service of one pool, for a model of 4 query and 2 KV heads:
    the rank that finds it names the field and the numbers, without its traceback."""
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with ServiceProcess(tmp_path, *SERVICE_POOL, tcp=False) as service:
        r = subprocess.run([*kvalloc_command(), *worker_args(
            config, prompts, "--address", service.stream, "--tensor-parallel", "3")],
            capture_output=True, text=True, timeout=300)
        with Client(service.stream, worker_id="observer") as client:
            assert client.get_pool().workers == []
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith("kvalloc worker: rank ") and line.endswith(
        "raised ShardingError: num_attention_heads: 4 is not divisible by the world size 3")


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_a_reply_timeout_must_be_positive(llama_oracle: Oracle, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          timeout: str) -> None:
    config, prompts = write_inputs(llama_oracle, tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(worker_args(config, prompts, "--timeout", timeout))
    assert exit_info.value.code == 2
    assert f"argument --timeout: {timeout} is not in (0, inf]" in capsys.readouterr().err


# `kvalloc worker` in a Python where transformers does not import, as after `pip install .`.
WITHOUT_TRANSFORMERS = ("import sys; sys.modules['transformers'] = None\n"
                        "from kvalloc.server.cli import main\n"
                        "sys.exit(main(sys.argv[1:]))")


def test_without_the_worker_extra_one_line_names_it() -> None:
    r = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS, "worker", "--model-config",
                        "cfg.json", "--prompts", "p"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["kvalloc worker: needs 'transformers', which is not "
                                     "installed: pip install 'kvalloc[worker]'"]


# What `--help` must not load: each takes seconds to import, tens on a loaded machine.
HEAVY = ("torch", "transformers", "triton", "numba", "fastapi")


def test_worker_help_imports_nothing_heavy() -> None:
    """``kvalloc worker --help`` parses its flags alone: no model library, no torch; it works
    without the worker extra too."""
    for prelude in ("", "import sys; sys.modules['transformers'] = None\n"):
        text, imported = help_and_imports(["worker", "--help"], HEAVY, prelude)
        assert "--worker-id" in text and imported == [], imported


def test_the_flags_slack_policies_are_the_allocators() -> None:
    from kvalloc.allocator import SlackPolicy
    from kvalloc.worker.arguments import SLACK_POLICIES

    assert sorted(SLACK_POLICIES) == sorted(p.value for p in SlackPolicy)


@pytest.mark.parametrize("given", ["./missing", "{tmp}/missing", "{tmp}/prompts.jsonl"])
def test_a_model_directory_that_is_not_there_is_a_one_line_error(
        llama_oracle: Oracle, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    _, prompts = write_inputs(llama_oracle, tmp_path)
    monkeypatch.chdir(tmp_path)
    model = given.format(tmp=tmp_path)
    assert main(["worker", "--model", model, "--prompts", str(prompts), "--in-process",
                 "--no-progress"]) == 2
    expected = ("is not a directory (a checkpoint is one)" if model.endswith(".jsonl")
                else "does not exist")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvalloc worker: model: ") and model in line and expected in line
