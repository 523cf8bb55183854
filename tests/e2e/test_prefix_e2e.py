"""Prefix caching and KV events end to end: a real ``kvalloc serve --kv-events`` process, a worker
over IPC or REST sharing a system prompt between requests, and a subscriber written from vLLM's
message shape that rebuilds the service's cached blocks from the events it publishes."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from kv_event_subscriber import Subscriber

from allocator.capacity.kv_events import external_hash
from allocator.capacity.prefix_cache import block_hashes
from server.client import Client
from server.devtools.launch import ServiceProcess, free_port, kvalloc_command

POOL = ("--device", "cpu", "--num-blocks", "128", "--tokens-per-block", "4",
        "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8",
        "--max-batch-size", "16", "--max-seq-len", "64", "--max-step-tokens", "128")
SYSTEM = np.arange(300, 320)  # five blocks


@pytest.mark.parametrize("transport", ["ipc", "rest"])
def test_a_router_sees_what_the_service_caches_and_workers_skip_the_cached_prefill(
        tmp_path: Path, transport: str) -> None:
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with ServiceProcess(tmp_path, *POOL, "--kv-events", events,
                        "--kv-events-replay", replay) as service:
        sub = Subscriber(events, replay)
        time.sleep(0.3)  # the subscription reaches the publisher
        address = service.ipc if transport == "ipc" else service.rest_tcp
        with Client(address, worker_id="w") as kv:
            kv.register()
            prompt = np.concatenate([SYSTEM, [1, 2, 3]])
            first = kv.step(new=(["a"], [23]), prompt_token_ids=prompt)
            kv.step()  # commits "a"'s prefill: its five full blocks are cached
            second = kv.step(new=(["b"], [22]), prompt_token_ids=np.concatenate([SYSTEM, [9, 9]]))
            assert first.cached_tokens.tolist() == [0]
            assert second.cached_tokens.tolist() == [20]
            assert second.scheduled.start_positions.tolist() == [20]
            assert second.scheduled.num_tokens.tolist() == [2]
            kv.step()
        while sub.receive(1000):
            pass
    assert sub.cached == {external_hash(h) for h in block_hashes(prompt, 4)}


def test_loadgen_reports_the_hit_rate_of_a_shared_system_prompt(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, *POOL, "--prefix-caching") as service:
        r = subprocess.run([*kvalloc_command(), "loadgen", "--no-progress", "--json",
                            "--address", service.ipc, "--steps", "150", "--step-interval", "0",
                            "--shared-prefix", "24", "--prompt-len", "1:12",
                            "--output-len", "4:16", "--draft-len", "2", "--arrival-rate", "1"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["errors"] == {} and summary["admitted"] > 0
    assert summary["cached_tokens"] > summary["prompt_tokens"] // 3
