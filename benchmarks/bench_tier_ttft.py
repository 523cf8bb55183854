"""Time to first token of a long prompt whose blocks the pool evicted: served from the host tier
against recomputed, side by side in one run, and the decode steps of other requests in the step
that onboards it.

    python benchmarks/bench_tier_ttft.py --out ttft.json     # on a GPU
    python benchmarks/bench_tier_ttft.py --quick             # CPU, seconds

Full run: the ~1B Llama shape of `bench_worker.py` (16 layers, 8 KV heads x 64, bf16, random
weights), a 32k-token prompt, an in-process service with prefix caching and a host tier. Each
time to first token is a worker's run of the prompt alone for one new token (a new session each
time, as a restarted engine's), from the call that admits it to the token on the host:

- ``recompute``: a prompt nothing holds (fresh tokens each time): the whole prefill;
- ``pool``: the prompt's blocks still in the pool: a prefix hit, no copy;
- ``tier``: the prompt's blocks evicted from the pool (the cache cleared) but in the tier: they
  are copied back into fresh blocks before the forward of its last block reads them, at most
  the service's per-step bound a step (the prompt refused as onboarding until all are back);
  ``tier_unbounded``: the same in one step.

Beside them, a plain pinned host-to-device copy of the same bytes (the link's time for them),
measured in the same run. Then ``decoders`` requests decode, and once they do another worker of
the namespace admits the prompt from the tier (its first token's block computed, the rest
onboarded): the wall time of the decoders' steps around it (their next forward waits for the
onboard) beside their median decode step, with the per-step bound and without.

``--quick``: a 2-layer float32 model on the CPU and a 512-token prompt.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvalloc.server.client import Client
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.worker.engine import Engine, StepRecord
from kvalloc.worker.model import pool_for_model, random_model
from kvalloc.worker.requests import NamedPrompt

FULL = {
    "model": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, max_position_embeddings=40960, eos_token_id=None),
    "dtype": "bfloat16", "device": "cuda", "prompt_len": 32768, "decoders": 32,
    "decoder_len": 512, "new_tokens": 64, "max_step_tokens": 8192, "repeats": 3,
}
QUICK = {
    "model": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=None),
    "dtype": "float32", "device": "cpu", "prompt_len": 512, "decoders": 4, "decoder_len": 32,
    "new_tokens": 16, "max_step_tokens": 256, "repeats": 2,
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def session(core: ServiceCore) -> Client:
    """A new session of the one worker id (the previous one ended, as a restart ends it)."""
    core.drop_worker("bench")
    client = Client.in_process(core, worker_id="bench")
    client.register()
    return client


def first_token_s(model: Any, core: ServiceCore, prompt: NamedPrompt, device: str,
                  new_tokens: int = 1) -> float:
    engine = Engine(model, session(core), None, draft_len=0, share_prefixes=True)
    sync(device)
    start = time.perf_counter()
    engine.run([prompt], new_tokens)
    sync(device)
    return time.perf_counter() - start


def evict_pool(core: ServiceCore) -> None:
    """Every parked block leaves the pool (the tier keeps its copies)."""
    with core.lock:
        core.manager.clear_prefix_cache()
        core.pipeline.sync_cache()


def plain_copy_s(nbytes: int, device: str, repeats: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_steps_around_an_onboard(model: Any, core: ServiceCore, prompt: NamedPrompt,
                                   decoders: list[NamedPrompt], setup: dict[str, Any]
                                   ) -> dict[str, Any]:
    """The decoders run; once they all decode, another worker of the namespace admits the
    prompt, its blocks in the tier alone. The decoders' next forward waits for the onboard:
    the wall time of their steps around that one, beside their median decode step."""
    evict_pool(core)
    arrival = Client.in_process(core, worker_id="arrival")
    arrival.register()
    stamps: list[float] = []
    onboarded: list[int] = []
    settle = 8  # steps: every decoder's prefill is behind

    def on_step(record: StepRecord) -> None:
        sync(setup["device"])
        stamps.append(time.perf_counter())
        if len(stamps) == settle:
            reply = arrival.step(new=([prompt.req_id], [len(prompt.token_ids)], [1]),
                                 prompt_token_ids=prompt.token_ids)
            onboarded.append(int(reply.cached_tokens[0]))

    Engine(model, session(core), None, draft_len=0, share_prefixes=True).run(
        decoders, setup["new_tokens"], on_step=on_step)
    core.drop_worker("arrival")  # its request ends: what it brought back stays cached
    gaps = [1e3 * (b - a) for a, b in itertools.pairwise(stamps)]
    return {"arrival_cached_tokens": onboarded[0],
            "decode_steps_ms_around_onboard": [round(g, 3) for g in gaps[settle - 3 : settle + 2]],
            "decode_step_ms": round(statistics.median(gaps[settle - 6 :]), 3)}


def unbounded(core: ServiceCore, measure: Any) -> Any:
    """``measure()`` with no bound on what a step copies back from the tier."""
    bound, core.manager.onboard_blocks_per_step = core.manager.onboard_blocks_per_step, None
    try:
        return measure()
    finally:
        core.manager.onboard_blocks_per_step = bound


def run(setup: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    device, vocab = setup["device"], setup["model"].vocab_size
    model = random_model(setup["model"], seed=seed, dtype=getattr(torch, setup["dtype"]),
                         device=device)
    longest = setup["prompt_len"] + setup["new_tokens"]
    # Room for the prompt twice (its cached blocks and a fresh copy) and every decoder.
    pool = pool_for_model(model.config, longest=longest, num_requests=2 + setup["decoders"],
                          draft_len=0, dtype=setup["dtype"], device=device,
                          max_batch_size=setup["decoders"] + 2)
    tier = 4 * pool.bytes_per_block * (longest // pool.tokens_per_block + 1)
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=setup["max_step_tokens"],
                                     prefix_caching=True, host_tier_bytes=tier,
                                     lease_ttl_s=600.0,
                                     cache_groups={"bench": ["bench", "arrival"]}))

    def fresh(name: str, n: int) -> NamedPrompt:
        return NamedPrompt(name, rng.integers(0, vocab, n).tolist())

    try:
        prompt = fresh("long", setup["prompt_len"])
        first_token_s(model, core, fresh("warm", setup["prompt_len"]), device)  # compiles
        times: dict[str, list[float]] = {"recompute": [], "pool": [], "tier": [],
                                         "tier_unbounded": []}
        for i in range(setup["repeats"]):
            times["recompute"].append(first_token_s(
                model, core, fresh(f"cold{i}", setup["prompt_len"]), device))

        def from_tier() -> float:
            evict_pool(core)
            return first_token_s(model, core, prompt, device)

        # Cached, in the pool and in the tier: a second token, so that the step after the last
        # prefill chunk commits it (a request that ends there commits nothing of its step).
        first_token_s(model, core, prompt, device, new_tokens=2)
        for _ in range(setup["repeats"]):  # each tier run leaves the prompt cached in the pool
            times["pool"].append(first_token_s(model, core, prompt, device))
            times["tier"].append(from_tier())
            times["pool"].append(first_token_s(model, core, prompt, device))
            times["tier_unbounded"].append(unbounded(core, from_tier))
        hit = (setup["prompt_len"] - 1) // pool.tokens_per_block
        nbytes = hit * pool.bytes_per_block
        ttft = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
        decoders = [fresh(f"d{i}", setup["decoder_len"]) for i in range(setup["decoders"])]
        return {
            "ttft_ms": ttft,
            "recompute_over_tier": round(ttft["recompute"] / ttft["tier"], 2),
            "onboarded_bytes": nbytes,
            "plain_copy_ms": round(1e3 * plain_copy_s(nbytes, device, setup["repeats"]), 3),
            "tier_copy_seconds_total": round(core.pool.tier_stores[0].copy_seconds, 4),
            "onboard_bytes_per_step": core.config.host_tier_onboard_bytes,
            "bounded": decode_steps_around_an_onboard(model, core, prompt, decoders, setup),
            "unbounded": unbounded(core, lambda: decode_steps_around_an_onboard(
                model, core, prompt, decoders, setup)),
        }
    finally:
        core.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    if setup["device"] == "cuda" and not torch.cuda.is_available():
        parser.error("the full benchmark needs CUDA; --quick runs on the CPU")
    result = run(setup, args.seed)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        meta = {k: v for k, v in setup.items() if k != "model"}
        meta["model"] = setup["model"].to_diff_dict()
        args.out.write_text(json.dumps({"setup": meta, **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
