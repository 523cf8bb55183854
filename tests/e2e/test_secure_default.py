"""Secure by default: with no token configured, only the service's own user can call ``/v1``.

A real `kvalloc serve` generates a token, writes it 0600 beside each endpoint, and requires it on
both transports; its own user's clients find it, another user (``nobody``) gets 401 on every
operation over TCP and cannot open the files or sockets. Listening beyond loopback without a
token is refused unless ``--insecure-no-token``."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvalloc.server import serve
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import InsecureBinding
from kvalloc.server.contract.operations import OPERATIONS
from kvalloc.server.devtools.launch import ServiceProcess, free_port
from kvalloc.server.transport.token_files import discover_token, token_file
from pydantic import SecretStr

SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4",
              "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
              "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "64")
NOBODY = 65534

# Runs as another user with the system interpreter (the venv may live where they cannot read):
# every /v1 operation over TCP without a token, then the token files and the sockets.
AS_ANOTHER_USER = """
import http.client, json, socket, sys
port, calls, files, sockets = json.loads(sys.argv[1])
out = {"statuses": [], "files": [], "sockets": []}
for method, path in calls:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=b"{}" if method == "POST" else None,
                 headers={"content-type": "application/json"})
    out["statuses"].append(conn.getresponse().status)
    conn.close()
for path in files:
    try:
        open(path).read()
        out["files"].append("read")
    except OSError as exc:
        out["files"].append(type(exc).__name__)
for path in sockets:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        out["sockets"].append("connected")
    except OSError as exc:
        out["sockets"].append(type(exc).__name__)
    finally:
        s.close()
print(json.dumps(out))
"""


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServiceProcess]:
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    with ServiceProcess(tmp_path, *SMALL_POOL) as svc:
        yield svc


def test_a_generated_token_guards_every_transport_and_the_owner_finds_it(
        service: ServiceProcess) -> None:
    files = [token_file(a) for a in (service.ipc, service.rest_unix, service.rest_tcp)]
    tokens = {f.read_text() for f in files}
    assert len(tokens) == 1 and len(tokens.pop()) >= 32
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert httpx.get(f"{service.rest_tcp}/v1/pool").status_code == 401
    assert httpx.get(f"{service.rest_tcp}/healthz").status_code == 200  # probes stay open
    token = discover_token(service.rest_tcp)
    for scheme in ("Bearer", "bearer"):
        headers = {"authorization": f"{scheme} {token}"}
        assert httpx.get(f"{service.rest_tcp}/v1/pool", headers=headers).status_code == 200
    with pytest.raises(Exception, match="401"):
        Client(service.ipc, worker_id="w", token="guess").register()
    for address in (service.ipc, service.rest_unix, service.rest_tcp):
        with Client(address, worker_id="owner") as client:  # no token given: discovered
            client.register()
            client.deregister()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory another user may traverse (0711), so only the files' own modes keep them out."""
    path = Path(tempfile.mkdtemp(prefix="kvalloc-test-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_local_user_gets_no_v1_operation(open_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    calls = [(op.method, op.path.format(**dict.fromkeys(op.path_fields, "x")))
             for op in OPERATIONS.values()]
    with ServiceProcess(open_dir, *SMALL_POOL) as service:
        files = [str(token_file(a)) for a in (service.ipc, service.rest_unix, service.rest_tcp)]
        sockets = [service.ipc.removeprefix("ipc://"), str(service.uds)]
        python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
        out = subprocess.run(
            [python, "-c", AS_ANOTHER_USER, json.dumps([service.port, calls, files, sockets])],
            capture_output=True, text=True, timeout=60, cwd="/",
            preexec_fn=lambda: (os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["statuses"] == [401] * len(calls)
    assert seen["files"] == ["PermissionError"] * len(files)
    assert seen["sockets"] == ["PermissionError"] * len(sockets)


def test_localhost_and_127_0_0_1_are_one_service_to_token_discovery(
        service: ServiceProcess) -> None:
    """The service listens on 127.0.0.1; its owner naming it ``localhost`` (REST or a
    ``--ipc tcp://`` endpoint spelt either way) finds the same token, not a 401."""
    by_name = service.rest_tcp.replace("127.0.0.1", "localhost")
    assert discover_token(by_name) == discover_token(service.rest_tcp) is not None
    assert token_file("tcp://LOCALHOST:5555") == token_file("tcp://127.0.0.1:5555")
    with Client(by_name, worker_id="owner") as client:
        client.register()
        client.deregister()


def test_a_token_file_someone_else_could_write_is_never_adopted(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                ) -> None:
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    planted = token_file(f"ipc://{tmp_path / 'kvalloc.ipc'}")
    planted.write_text("planted")
    planted.chmod(0o644)
    with ServiceProcess(tmp_path, *SMALL_POOL) as svc:
        token = discover_token(svc.ipc)
        assert token not in (None, "planted")
        assert stat.S_IMODE(planted.stat().st_mode) == 0o600


def test_a_restarted_service_keeps_its_generated_token(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    with ServiceProcess(tmp_path, *SMALL_POOL) as svc:
        first = discover_token(svc.ipc)
    with ServiceProcess(tmp_path, *SMALL_POOL) as svc:
        assert discover_token(svc.ipc) == first


def test_token_files_of_ports_the_os_picked_go_when_the_service_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--port 0`` and ``--ipc tcp://127.0.0.1:*``: no later start finds those ports' files
    again, so they go with the service; a fixed port's file and the socket files' stay for the
    next start (`test_a_restarted_service_keeps_its_generated_token`)."""
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))  # the service's and this test's
    with ServiceProcess(tmp_path, *SMALL_POOL, "--port", "0", "--ipc", "tcp://127.0.0.1:*") as svc:
        picked = sorted(p.name for p in (run / "kvalloc").glob("*.token"))
        assert [name.split("-")[0] for name in picked] == ["http", "tcp"], picked
        assert svc.stop() == 0
    assert list((run / "kvalloc").glob("*.token")) == []
    assert discover_token(svc.ipc) is not None
    with ServiceProcess(tmp_path, *SMALL_POOL) as svc:
        fixed = token_file(svc.rest_tcp)
        assert fixed.exists()
    assert fixed.exists()


@pytest.mark.parametrize("listen", [("--host", "0.0.0.0"),
                                    ("--ipc", "tcp://0.0.0.0:{port}")])
def test_listening_beyond_loopback_without_a_token_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listen: tuple[str, str]) -> None:
    """Refused before anything is bound; a configured token or the explicit flag lifts it."""
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    flags = [listen[0], listen[1].format(port=free_port())]
    svc = ServiceProcess(tmp_path, *SMALL_POOL, *flags)
    with pytest.raises(RuntimeError, match="exited with 2"):
        svc.start()
    assert "KVALLOC_TOKEN is not set" in svc.log() and "--insecure-no-token" in svc.log()
    assert not svc.uds.exists()
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(flags)
    assert serve._token(args, SecretStr("t0ken")) == SecretStr("t0ken")
    assert serve._token(parser.parse_args([*flags, "--insecure-no-token"]), None) is None
    with pytest.raises(InsecureBinding, match=re.escape(flags[1].split(":")[0])):
        serve._token(args, None)


def test_insecure_no_token_serves_open_and_says_so_loudly(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVALLOC_TOKEN", raising=False)
    with ServiceProcess(tmp_path, *SMALL_POOL, "--insecure-no-token") as svc:
        assert "WARNING kvalloc.serve: INSECURE" in svc.log()
        assert httpx.get(f"{svc.rest_tcp}/v1/pool").status_code == 200
        assert discover_token(svc.ipc) is None
