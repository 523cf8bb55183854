"""Prefix caching and KV events end to end: a real ``kvalloc serve --kv-events`` process, a worker
over IPC or REST sharing a system prompt between requests, and a subscriber written from vLLM's
message shape that rebuilds the service's cached blocks from the events it publishes. A
Unix-socket stream is this user's alone (another user cannot connect); a TCP stream admits holders
of the events secret alone, never the token workers hold, and is served plain only behind its own
switch; each worker's stream carries its namespace's blocks alone; workers share cached blocks
only when the operator groups them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from kv_event_subscriber import HANDSHAKE_FAILURES, Subscriber, handshake, watch
from kvalloc.allocator.capacity.kv_events import router_hashes
from kvalloc.server.client import Client
from kvalloc.server.contract.routing import authenticate_subscriber, worker_salt
from kvalloc.server.devtools.launch import ServiceProcess, free_port, kvalloc_command

POOL = ("--device", "cpu", "--num-blocks", "128", "--tokens-per-block", "4",
        "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8",
        "--max-batch-size", "16", "--max-seq-len", "64", "--max-step-tokens", "128")
SYSTEM = np.arange(300, 320)  # five blocks


SEED = "e2e-hash-seed"  # keys the cache's own hashes alone: the published ones never depend on it


@pytest.mark.parametrize("transport", ["ipc", "rest"])
def test_a_router_sees_what_the_service_caches_and_workers_skip_the_cached_prefill(
        tmp_path: Path, transport: str, zmq_context: zmq.Context) -> None:
    events, replay = (f"ipc://{tmp_path / name}" for name in ("events", "replay"))
    with ServiceProcess(tmp_path, *POOL, "--kv-events", events, "--kv-events-replay", replay,
                        env={"KVALLOC_HASH_SEED": SEED}) as service:
        sub = Subscriber(zmq_context, events, replay)  # a plain socket: file modes decide
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
        sub.catch_up(HANDSHAKE_MS)
        assert stat.S_IMODE(os.stat(events.removeprefix("ipc://")).st_mode) == 0o600
    # One stream for the service: its hashes cover each block's namespace too.
    assert sub.cached == set(router_hashes(prompt, 4, namespace=worker_salt("w", {})))


# Handshakes take about a millisecond; a loaded two-core machine may take far longer.
HANDSHAKE_MS = 10_000
TOKEN = "e2e-service-token"
EVENTS_SECRET = "e2e-events-secret"


def test_a_tcp_stream_admits_the_events_secret_and_neither_the_workers_token_nor_none(
        tmp_path: Path, zmq_context: zmq.Context) -> None:
    events, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with ServiceProcess(tmp_path, *POOL, "--kv-events", events, "--kv-events-replay", replay,
                        env={"KVALLOC_TOKEN": TOKEN, "KVALLOC_EVENTS_SECRET": EVENTS_SECRET,
                             "KVALLOC_HASH_SEED": SEED}) as service:
        for key in (None, TOKEN):  # no keys; the keys a worker could derive from its token
            peer = zmq_context.socket(zmq.SUB)
            if key is not None:
                authenticate_subscriber(peer, key)
            monitor = watch(peer)
            peer.subscribe(b"")
            peer.connect(events)
            try:
                assert handshake(monitor, HANDSHAKE_MS) in HANDSHAKE_FAILURES
            finally:
                peer.disable_monitor()  # before its socket closes, as ZeroMQ asks
                peer.close(linger=0)
                monitor.close(linger=0)
        sub = Subscriber(zmq_context, events, replay, EVENTS_SECRET)
        with Client(service.ipc, worker_id="w", token=TOKEN) as kv:
            kv.register()
            kv.step(new=(["a"], [SYSTEM.size]), prompt_token_ids=SYSTEM)
            kv.step()  # commits the prefill: its blocks are cached and published
        # Not a wait for live batches that stop coming: the subscription may reach the publisher
        # after the step's batch went out (dropped), and a loaded machine may hold one longer
        # than any fixed wait. The replay answers only after what was published before it.
        sub.catch_up(HANDSHAKE_MS)
    assert sub.cached == set(router_hashes(SYSTEM, 4, namespace=worker_salt("w", {})))


def test_each_workers_stream_carries_its_own_namespace_and_none_of_anothers_prompts(
        tmp_path: Path, zmq_context: zmq.Context) -> None:
    template = f"ipc://{tmp_path}/events-{{worker}}"
    replays = f"ipc://{tmp_path}/replay-{{worker}}"
    with ServiceProcess(tmp_path, *POOL, "--kv-events", template, "--kv-events-replay", replays,
                        "--cache-group", "team=alice,carol") as service:
        clients = {name: Client(service.ipc, worker_id=name) for name in ("alice", "bob",
                                                                          "carol")}
        try:
            for kv in clients.values():
                kv.register()
            alice_prompt = np.arange(500, 524)
            clients["alice"].step(new=(["a"], [24]), prompt_token_ids=alice_prompt)
            clients["alice"].step()
            clients["bob"].step(new=(["b"], [20]), prompt_token_ids=SYSTEM)
            clients["bob"].step()
            subs = {name: Subscriber(zmq_context, template.format(worker=name),
                                     replays.format(worker=name)) for name in clients}
            for sub in subs.values():
                sub.catch_up(HANDSHAKE_MS)
            seen = {name: set(sub.token_ids) for name, sub in subs.items()}
            assert seen["alice"] == seen["carol"] == set(alice_prompt.tolist())
            assert seen["bob"] == set(SYSTEM.tolist())  # none of alice's token ids
            clients["bob"].deregister()
            assert not (tmp_path / "events-bob").exists()  # its stream closed with its session
        finally:
            for kv in clients.values():
                kv.close()


# Another local user's subscriber on a Unix-socket stream: it prints how its connection ended.
OTHER_USER = """
import json, sys, time, zmq
from zmq.utils.monitor import recv_monitor_message
endpoint, timeout_ms = sys.argv[1], int(sys.argv[2])
sub = zmq.Context().socket(zmq.SUB)
monitor = sub.get_monitor_socket()
sub.subscribe(b"")
sub.connect(endpoint)
deadline, succeeded = time.monotonic() + timeout_ms / 1000, False
while not succeeded and monitor.poll(max(1, int((deadline - time.monotonic()) * 1000))):
    succeeded = recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    if time.monotonic() > deadline:
        break
print(json.dumps({"handshake": succeeded}))
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


def _subscribe_as(user: list[str], endpoint: str, pythonpath: str) -> bool:
    r = subprocess.run([*user, os.path.realpath(sys.executable), "-c", OTHER_USER, endpoint,
                        str(OTHER_USER_MS)], capture_output=True, text=True, timeout=120,
                       check=False, cwd="/", env={**os.environ, "PYTHONPATH": pythonpath})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["handshake"]


# Nobody's connection is refused by the file mode and retried quietly: this bounds the wait for a
# handshake that never comes; the owner's, on the same machine, takes milliseconds.
OTHER_USER_MS = 3_000


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="runs a subscriber as user nobody: needs root and setpriv")
def test_an_unmodified_subscriber_of_the_services_user_reads_a_stream_and_nobody_cannot(
        tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # the directory does not keep nobody out: the socket's mode does
    events = f"ipc://{tmp_path / 'events'}"
    with (ServiceProcess(tmp_path, *POOL, "--kv-events", events),
          _readable_pyzmq() as pythonpath):
        nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        assert _subscribe_as([], events, pythonpath)
        assert not _subscribe_as(nobody, events, pythonpath)


def test_an_event_endpoint_in_use_or_tcp_without_a_secret_ends_in_one_line(
        tmp_path: Path) -> None:
    events = f"ipc://{tmp_path / 'events'}"

    def serve(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*kvalloc_command(), "serve", *POOL, "--no-tcp",
                               "--ipc", f"ipc://{tmp_path / 'second.ipc'}", *flags],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={k: v for k, v in os.environ.items()
                                   if k != "KVALLOC_EVENTS_SECRET"})

    with ServiceProcess(tmp_path, *POOL, "--kv-events", events):
        taken = serve("--kv-events", events)
    assert taken.returncode == 2, taken.stderr
    assert "another process is listening there" in taken.stderr
    assert "Traceback" not in taken.stderr
    plain = serve("--kv-events", f"tcp://127.0.0.1:{free_port()}")
    assert plain.returncode == 2
    assert plain.stderr.count("\n") == 1 and "KVALLOC_EVENTS_SECRET is not set" in plain.stderr


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


def test_plain_tcp_events_need_their_own_switch_and_are_logged_loudly(tmp_path: Path) -> None:
    """The control plane's token says nothing of events: a plain TCP stream is served only with
    ``--kv-events-plaintext``, and the start says what it exposes."""
    events = f"tcp://127.0.0.1:{free_port()}"
    with ServiceProcess(tmp_path, *POOL, "--kv-events", events, "--kv-events-plaintext",
                        env={"KVALLOC_TOKEN": TOKEN}) as service:
        assert "INSECURE: --kv-events-plaintext" in service.log()
        assert "reads the token ids of every cached prompt" in service.log()


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
