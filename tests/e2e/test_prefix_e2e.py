"""Prefix caching and KV events end to end: a real ``kvalloc serve --kv-events`` process, a worker
over IPC or REST sharing a system prompt between requests, and a subscriber written from vLLM's
message shape that rebuilds the service's cached blocks from the events it publishes. Without
the token a local peer completes no handshake with the event sockets and cannot compute a
guessed prompt's block hashes; workers share cached blocks only when the operator groups them;
events beyond loopback without ``KVALLOC_TOKEN`` are refused at start."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from kv_event_subscriber import HANDSHAKE_FAILURES, Subscriber, handshake, watch
from kvalloc.allocator.capacity.kv_events import external_hash
from kvalloc.allocator.capacity.prefix_cache import block_hashes
from kvalloc.server.client import Client
from kvalloc.server.contract.routing import hash_seed, worker_salt
from kvalloc.server.devtools.launch import ServiceProcess, free_port, kvalloc_command
from kvalloc.server.transport.token_files import discover_token, token_file

POOL = ("--device", "cpu", "--num-blocks", "128", "--tokens-per-block", "4",
        "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8",
        "--max-batch-size", "16", "--max-seq-len", "64", "--max-step-tokens", "128")
SYSTEM = np.arange(300, 320)  # five blocks


@pytest.mark.parametrize("transport", ["ipc", "rest"])
def test_a_router_sees_what_the_service_caches_and_workers_skip_the_cached_prefill(
        tmp_path: Path, transport: str, zmq_context: zmq.Context) -> None:
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with ServiceProcess(tmp_path, *POOL, "--kv-events", events,
                        "--kv-events-replay", replay) as service:
        token = discover_token(events)  # generated, written 0600 for this user's routers
        assert token is not None
        sub = Subscriber(zmq_context, events, replay, token)
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
    router = block_hashes(prompt, 4, salt=worker_salt("w", {}), seed=hash_seed(token))
    assert sub.cached == {external_hash(h) for h in router}


# Handshakes take about a millisecond; a loaded two-core machine may take far longer.
HANDSHAKE_MS = 10_000
TOKEN = "e2e-service-token"


def test_without_the_token_no_event_is_read_and_no_hash_computed(
        tmp_path: Path, zmq_context: zmq.Context) -> None:
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with ServiceProcess(tmp_path, *POOL, "--kv-events", events, "--kv-events-replay", replay,
                        env={"KVALLOC_TOKEN": TOKEN}) as service:
        peer = zmq_context.socket(zmq.SUB)
        monitor = watch(peer)
        peer.subscribe(b"")
        peer.connect(events)
        try:
            assert handshake(monitor, HANDSHAKE_MS) in HANDSHAKE_FAILURES
        finally:
            peer.disable_monitor()  # before its socket closes, as ZeroMQ asks
            peer.close(linger=0)
            monitor.close(linger=0)
        sub = Subscriber(zmq_context, events, replay, TOKEN)
        with Client(service.ipc, worker_id="w", token=TOKEN) as kv:
            kv.register()
            kv.step(new=(["a"], [SYSTEM.size]), prompt_token_ids=SYSTEM)
            kv.step()  # commits the prefill: its blocks are cached and published
        # Not a wait for live batches that stop coming: the subscription may reach the publisher
        # after the step's batch went out (dropped), and a loaded machine may hold one longer
        # than any fixed wait. The replay answers only after what was published before it.
        sub.catch_up(HANDSHAKE_MS)
    guessed = {external_hash(h) for h in block_hashes(SYSTEM, 4)}
    assert len(sub.cached) == SYSTEM.size // 4 and not guessed & sub.cached
    assert sub.cached == {external_hash(h) for h in block_hashes(
        SYSTEM, 4, salt=worker_salt("w", {}), seed=hash_seed(TOKEN))}


# Another local user's subscriber: it tries the token file, then subscribes without keys; it
# prints whether it read the token and how its handshake ended.
OTHER_USER = """
import json, sys, zmq
from zmq.utils.monitor import recv_monitor_message
path, endpoint, timeout_ms = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    token_read = bool(open(path).read())
except OSError:
    token_read = False
sub = zmq.Context().socket(zmq.SUB)
monitor = sub.get_monitor_socket()
sub.subscribe(b"")
sub.connect(endpoint)
ends = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
event = None
while monitor.poll(timeout_ms):
    event = int(recv_monitor_message(monitor)["event"])
    if event & ends:
        break
print(json.dumps({"token_read": token_read, "handshake": event}))
"""


@contextlib.contextmanager
def _readable_pyzmq() -> Iterator[str]:
    """A copy of pyzmq that user nobody can import: the checkout (and its virtual environment)
    may sit in a directory only its owner can enter."""
    shared = Path(tempfile.mkdtemp(prefix="kvalloc-nobody-"))
    try:
        package = Path(zmq.__file__).parent
        for part in (package, package.parent / "pyzmq.libs"):
            if part.exists():
                shutil.copytree(part, shared / part.name)
        for path in (shared, *shared.rglob("*")):
            path.chmod(0o755)
        yield str(shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="runs a subscriber as user nobody: needs root and setpriv")
def test_another_local_user_reads_neither_the_token_nor_an_event(tmp_path: Path) -> None:
    events = f"tcp://127.0.0.1:{free_port()}"
    with ServiceProcess(tmp_path, *POOL, "--kv-events", events,
                        env={"KVALLOC_TOKEN": ""}) as service:
        assert "generated token required" in service.log()
        with _readable_pyzmq() as pythonpath:
            r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                os.path.realpath(sys.executable), "-c", OTHER_USER,
                                str(token_file(events)), events, str(HANDSHAKE_MS)],
                               capture_output=True, text=True, timeout=120, check=False,
                               cwd="/", env={**os.environ, "PYTHONPATH": pythonpath})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert not seen["token_read"]
    assert seen["handshake"] in HANDSHAKE_FAILURES


@pytest.mark.parametrize(("flags", "probe"), [((), 0), (("--cache-group", "team=a,b"), 16)])
def test_workers_share_cached_blocks_only_when_grouped(tmp_path: Path, flags: tuple[str, ...],
                                                       probe: int) -> None:
    with (ServiceProcess(tmp_path, *POOL, "--prefix-caching", *flags) as service,
          Client(service.ipc, worker_id="a") as a, Client(service.ipc, worker_id="b") as b):
        a.register()
        b.register()
        a.step(new=(["secret"], [SYSTEM.size]), prompt_token_ids=SYSTEM)
        a.step()  # written: "secret"'s five blocks are cached
        guess = b.step(new=(["guess"], [SYSTEM.size]), prompt_token_ids=SYSTEM)
        assert guess.cached_tokens.tolist() == [probe]


def test_events_beyond_loopback_without_a_token_are_refused(tmp_path: Path) -> None:
    r = subprocess.run([*kvalloc_command(), "serve", *POOL, "--no-tcp",
                        "--ipc", f"ipc://{tmp_path / 'kvalloc.ipc'}",
                        "--kv-events", f"tcp://0.0.0.0:{free_port()}"],
                       capture_output=True, text=True, timeout=120, check=False,
                       env={k: v for k, v in os.environ.items() if k != "KVALLOC_TOKEN"})
    assert r.returncode == 2
    assert "is reachable beyond this host and KVALLOC_TOKEN is not set" in r.stderr


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
