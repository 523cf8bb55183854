"""The host tier end to end, with real processes: a `kvalloc serve --host-tier` and `kvalloc
worker` processes of a tiny random float32 Llama.

1. The service's pool is too small to keep a long prompt's blocks once other work runs; its host
   tier holds every block the workers below can register.
2. Worker A (worker id "a") runs the long prompt first: its full blocks register in the pool and
   are copied to the tier as they register.
3. A then runs other prompts, one at a time, which evict the long prompt's blocks from the pool:
   /metrics shows blocks evicted and offloaded.
4. A is killed with SIGKILL in the middle of that work: it never deregisters, and its session
   lives on (its lease is long).
5. A new worker process under the same id takes it over (``--replace``: A's session ends, its
   requests are freed) and runs the long prompt again: its tokens are
   `model.generate`'s, its whole prefix of full blocks is reported cached, and /metrics shows the
   blocks onboarded from the tier and the prefix hit.
6. Worker "b", of a namespace of its own, runs the same long prompt: nothing of it is cached for
   b, neither in the pool nor in the tier, and its tokens are `model.generate`'s too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command
from kvalloc.worker.model import random_model
from prometheus_scrape import samples_of
from transformers import LlamaConfig

TPB = 4  # tokens per block
POOL_BLOCKS = 32
MAX_NEW_TOKENS = 10
LONG_PROMPT_LEN = 70  # 17 full blocks and 2 tokens
LONG_FULL_BLOCKS = LONG_PROMPT_LEN // TPB
FILLER_LEN = 64  # 16 full blocks each; with its output and drafts a filler holds 20 blocks
# More fillers than A can run before it is killed, by far: a filler takes about a second here,
# and a fast machine that ran one in a tenth of that would still be busy for minutes.
FILLERS = 4000
MODEL = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
BLOCK_BYTES = 2 * 2 * TPB * 2 * 8 * 4  # layers, K and V, tokens, KV heads, head size, float32
# Room for every block A could ever register, so that nothing leaves the tier.
TIER_BLOCKS = LONG_FULL_BLOCKS + FILLERS * (FILLER_LEN // TPB)
# One request at a time: the long prompt runs alone, first, and its blocks are the oldest parked
# ones when the fillers need room; 32 blocks hold a filler (20) but not it and the long prompt's
# 17 cached blocks besides.
POOL = ("--device", "cpu", "--dtype", "float32", "--num-layers", "2", "--num-kv-heads", "2",
        "--head-dim", "8", "--num-blocks", str(POOL_BLOCKS), "--tokens-per-block", str(TPB),
        "--max-seq-len", "96", "--max-draft-len", "3", "--max-batch-size", "1",
        "--max-step-tokens", "48")

# Measured on a quiet two-core machine, and each bound many times that:
# - the service starts in 2 s, 20 s when numba compiles its step from nothing;
READY_TIMEOUT_S = 300.0
# - the longest silence between a worker's calls was 0.26 s (its first forward); a killed
#   worker's session must outlive the test, for its successor to take it over:
LEASE_TTL_S = 3600.0
# - /metrics serves a copy refreshed at most once a second, which a loaded machine may hold
#   back several times that;
METRICS_REFRESH_S = 60.0
# - a worker process imports torch and transformers and runs the long prompt in 7-8 s; A showed
#   more than a pool of blocks evicted 10-13 s after it started.
WORKER_TIMEOUT_S = 300.0
EVICTED_TIMEOUT_S = WORKER_TIMEOUT_S + METRICS_REFRESH_S
TEST_TIMEOUT_S = (READY_TIMEOUT_S + EVICTED_TIMEOUT_S
                  + 2 * (WORKER_TIMEOUT_S + METRICS_REFRESH_S) + READY_TIMEOUT_S)


def expected_tokens(prompt: list[int]) -> list[int]:
    """What transformers' `generate` answers for ``prompt``: the same random weights (seed 0)
    as the worker's, under transformers' own attention."""
    reference = random_model(MODEL, seed=0)
    reference.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS)
    return out[0, ids.shape[1]:].tolist()


def write_prompts(path: Path, prompts: dict[str, list[int]]) -> Path:
    path.write_text("".join(json.dumps({"id": name, "token_ids": ids}) + "\n"
                            for name, ids in prompts.items()))
    return path


def worker_command(config: Path, prompts: Path, address: str, worker_id: str,
                   *flags: str) -> list[str]:
    return [*kvalloc_command(), "worker", "--model-config", str(config), "--prompts",
            str(prompts), "--seed", "0", "--max-new-tokens", str(MAX_NEW_TOKENS),
            "--tokens-per-block", str(TPB), "--address", address, "--worker-id", worker_id,
            "--json", "--no-progress", *flags]


def run_worker(command: list[str]) -> dict:
    r = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def metrics(service: ServiceProcess) -> dict[str, float]:
    """The service's unlabelled samples on /metrics."""
    with urllib.request.urlopen(f"{service.rest_tcp}/metrics", timeout=30) as reply:
        samples = samples_of(reply.read().decode())
    return {name: v for (name, labels), v in samples.items() if not labels}


def wait_for_metrics(service: ServiceProcess, what: str,
                     done: Callable[[dict[str, float]], bool],
                     timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while not done(seen := metrics(service)):
        assert time.monotonic() < deadline, f"{what} after {timeout_s}s: {seen}"
        time.sleep(0.2)
    return seen


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_a_restarted_worker_gets_its_evicted_prefix_back_from_the_tier_and_no_one_else_does(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    long_prompt = rng.integers(0, MODEL.vocab_size, LONG_PROMPT_LEN).tolist()
    fillers = {f"filler-{i}": rng.integers(0, MODEL.vocab_size, FILLER_LEN).tolist()
               for i in range(FILLERS)}
    config = tmp_path / "model.json"
    MODEL.to_json_file(config)
    long_only = write_prompts(tmp_path / "long.jsonl", {"long": long_prompt})
    long_then_fillers = write_prompts(tmp_path / "a.jsonl", {"long": long_prompt, **fillers})
    expected = expected_tokens(long_prompt)

    with ServiceProcess(tmp_path, *POOL, "--host-tier", str(TIER_BLOCKS * BLOCK_BYTES),
                        "--lease-ttl-s", str(LEASE_TTL_S),
                        ready_timeout_s=READY_TIMEOUT_S) as service:
        with (tmp_path / "a.out").open("w") as out, (tmp_path / "a.err").open("w") as err:
            a = subprocess.Popen(worker_command(config, long_then_fillers, service.stream, "a"),
                                 stdout=out, stderr=err)
        try:
            # Every block A registered is in the tier; the pool evicted more blocks than it
            # holds, the long prompt's (parked before any filler's) first among them.
            seen = wait_for_metrics(
                service, "A evicted no pool of blocks",
                lambda m: (m["kvalloc_evicted_blocks_total"] >= POOL_BLOCKS
                           or a.poll() is not None), EVICTED_TIMEOUT_S)
            assert a.poll() is None, (tmp_path / "a.err").read_text()
            assert seen["kvalloc_host_tier_offloaded_blocks_total"] > POOL_BLOCKS
            assert (seen["kvalloc_host_tier_held_blocks"]
                    == seen["kvalloc_host_tier_offloaded_blocks_total"])
            assert seen["kvalloc_host_tier_onboarded_blocks_total"] == 0
            os.kill(a.pid, signal.SIGKILL)  # mid-run: A never deregisters
            assert a.wait(WORKER_TIMEOUT_S) == -signal.SIGKILL
        finally:
            if a.poll() is None:
                a.kill()
                a.wait()

        with Client(service.stream, worker_id="observer") as observer:
            assert "a" in [w.worker_id for w in observer.get_pool().workers]  # A's session

        again = run_worker(worker_command(config, long_only, service.stream, "a", "--replace"))
        assert {o["id"]: o["token_ids"] for o in again["outputs"]} == {"long": expected}
        assert again["cached_prompt_tokens"] == LONG_FULL_BLOCKS * TPB
        seen = wait_for_metrics(
            service, "no prefix hit",
            lambda m: m["kvalloc_prefix_hit_tokens_total"] >= again["cached_prompt_tokens"],
            METRICS_REFRESH_S)
        assert seen["kvalloc_prefix_hit_tokens_total"] == again["cached_prompt_tokens"]
        assert seen["kvalloc_host_tier_onboarded_blocks_total"] > 0

        other = run_worker(worker_command(config, long_only, service.stream, "b"))
        assert {o["id"]: o["token_ids"] for o in other["outputs"]} == {"long": expected}
        assert other["cached_prompt_tokens"] == 0
        # b's prompt blocks reach the tier too, under b's namespace: once they show, the
        # counters below cover b's run.
        final = wait_for_metrics(
            service, "b's blocks were not offloaded",
            lambda m: (m["kvalloc_host_tier_offloaded_blocks_total"]
                       >= seen["kvalloc_host_tier_offloaded_blocks_total"] + LONG_FULL_BLOCKS),
            METRICS_REFRESH_S)
        assert final["kvalloc_prefix_hit_tokens_total"] == again["cached_prompt_tokens"]
        assert (final["kvalloc_host_tier_onboarded_blocks_total"]
                == seen["kvalloc_host_tier_onboarded_blocks_total"])
        assert final["kvalloc_host_tier_evicted_blocks_total"] == 0
        assert final["kvalloc_invariant_violations_total"] == 0
