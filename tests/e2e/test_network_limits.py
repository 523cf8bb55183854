"""The network cannot kill the service, or make it hold memory, without the token.

Real `kvalloc serve` processes on loopback: thousands of half-open connections against a small
descriptor limit; a flood of unauthenticated 8 MiB bodies; calls beyond the in-flight bound; a
body that never completes; a kept connection that stops before its next request's headers. Each
is bounded in count and time. The connection bounds live in the HTTP protocol, so the tests of
them run with each parser the service can use here (`PARSERS`); the others with the default."""

from __future__ import annotations

import argparse
import contextlib
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from proc_status import memory_kib

from server import serve
from server.client import Client
from server.contract.errors import LimitsError
from server.devtools.launch import ServiceProcess
from server.transport.network import connection_budget, http_parsers
from server.transport.token_files import discover_token

SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4",
              "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
              "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "64")
NOFILE = 1024
HALF_OPEN = 2000  # twice the service's descriptor limit
HEADER_TIMEOUT_S = 2.0
BODY = 8 << 20
PARSERS = [p for p in http_parsers() if p != "auto"]


def status_of(sock: socket.socket, timeout_s: float = 10.0) -> tuple[int, dict[str, str]]:
    """The status and headers of the response on ``sock``."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, *lines = data.split(b"\r\n\r\n")[0].decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines if ": " in line)
    return int(head.split()[1]), headers


def send_head(port: int, method: str, path: str, *, length: int = 0,
              token: str | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\n{auth}content-type: application/json"
                 f"\r\ncontent-length: {length}\r\n\r\n".encode())
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """The service closed ``sock`` (EOF after whatever it answered, or a reset)."""
    sock.settimeout(0.5)
    try:
        while chunk := sock.recv(65536):
            del chunk
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path, *SMALL_POOL, "--header-timeout-s", str(HEADER_TIMEOUT_S),
                        nofile=(NOFILE, NOFILE)) as svc:
        yield svc


def test_thousands_of_half_open_connections_leave_ipc_and_rest_serving(
        limited: ServiceProcess) -> None:
    """Twice as many half-open connections as the service has descriptors: those over the
    connection bound are answered 503 and closed, the rest are closed at the header deadline, and
    meanwhile a new IPC worker connects and steps (ZeroMQ never meets EMFILE)."""
    assert limited.port is not None
    held = []
    for _ in range(HALF_OPEN):
        sock = socket.create_connection(("127.0.0.1", limited.port), timeout=5)
        sock.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\n")  # the headers never end
        held.append(sock)
    with Client(limited.ipc, worker_id="during-flood", timeout_s=5) as worker:
        worker.register()
        assert worker.step(new=(["a"], [4])).admitted[0] >= 0
    time.sleep(HEADER_TIMEOUT_S + 1)
    assert all(closed_by_peer(sock) for sock in held)
    for sock in held:
        sock.close()
    assert limited.proc is not None and limited.proc.poll() is None
    assert limited.ready()  # REST over the Unix socket
    with Client(limited.rest_tcp, worker_id="after-flood") as rest:
        rest.register()
        assert rest.step(new=(["b"], [4])).admitted[0] >= 0
    with Client(limited.ipc, worker_id="during-flood") as worker:
        assert worker.get_pool().num_requests == 2


@pytest.mark.parametrize("parser", PARSERS)
def test_connections_over_the_bound_get_503_with_retry_after(tmp_path: Path,
                                                             parser: str) -> None:
    bound = connection_budget(10**6, NOFILE)
    # A header deadline far longer than opening the connections takes: none closes early.
    with ServiceProcess(tmp_path, *SMALL_POOL, "--http", parser, "--header-timeout-s", "120",
                        nofile=(NOFILE, NOFILE)) as svc:
        assert svc.port is not None
        held = [socket.create_connection(("127.0.0.1", svc.port), timeout=5)
                for _ in range(bound + 5)]
        try:
            status, headers = status_of(held[-1])
            assert status == 503 and headers["retry-after"] == "1"
            assert closed_by_peer(held[-1])
            assert not closed_by_peer(held[bound - 1])
        finally:
            for sock in held:
                sock.close()


def test_an_unauthenticated_flood_of_8_mib_bodies_leaves_memory_flat(tmp_path: Path) -> None:
    """The token is checked on the headers: 401 before a byte of the body is read, so 64 posts of
    8 MiB from 16 clients at once cost the service no memory."""
    with ServiceProcess(tmp_path, *SMALL_POOL) as svc:
        assert svc.proc is not None and svc.port is not None
        port, pid = svc.port, svc.proc.pid
        peak_before = memory_kib(pid, "VmHWM")

        def post(_: int) -> int:
            sock = send_head(port, "POST", "/v1/workers", length=BODY)
            try:
                status, _headers = status_of(sock)
                with contextlib.suppress(OSError):  # the service closed: fails part-way
                    sock.sendall(bytes(BODY))
                return status
            finally:
                sock.close()

        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(post, range(64)))
        assert statuses == [401] * 64
        growth_mib = (memory_kib(pid, "VmHWM") - peak_before) / 1024
        assert growth_mib < 32, f"peak RSS grew {growth_mib:.0f} MiB"
        with Client(svc.rest_tcp, worker_id="legit") as client:  # the real worker still serves
            client.register()


@pytest.mark.parametrize("parser", PARSERS)
def test_calls_beyond_the_in_flight_bound_get_503_and_a_slow_body_gets_408(
        tmp_path: Path, parser: str) -> None:
    with ServiceProcess(tmp_path, *SMALL_POOL, "--http", parser, "--max-in-flight", "2",
                        "--body-timeout-s", "1") as svc:
        assert svc.port is not None
        token = discover_token(svc.rest_tcp)
        slow = [send_head(svc.port, "POST", "/v1/workers", length=100, token=token)
                for _ in range(2)]
        for sock in slow:
            sock.sendall(b'{"worker_id"')  # the rest never comes
        time.sleep(0.3)
        extra = send_head(svc.port, "GET", "/v1/pool", token=token)
        status, headers = status_of(extra)
        assert status == 503 and headers["retry-after"] == "1"
        extra.close()
        probe = send_head(svc.port, "GET", "/healthz")  # never mistaken for a dead service
        assert status_of(probe)[0] == 200
        probe.close()
        for sock in slow:
            assert status_of(sock)[0] == 408
            sock.close()
        with Client(svc.rest_tcp, worker_id="after") as client:  # the bound is free again
            assert client.get_pool().num_requests == 0


@pytest.mark.parametrize("parser", PARSERS)
def test_the_header_deadline_restarts_at_each_response_of_a_kept_connection(
        tmp_path: Path, parser: str) -> None:
    """Each request on a kept-alive connection gets the whole deadline from the previous
    response, and one whose headers stop short is closed at it (keep-alive, 5 s, is longer)."""
    request = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
    with ServiceProcess(tmp_path, *SMALL_POOL, "--http", parser,
                        "--header-timeout-s", str(HEADER_TIMEOUT_S)) as svc:
        assert svc.port is not None
        with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as sock:
            for _ in range(2):  # the second comes after the first request's deadline
                time.sleep(HEADER_TIMEOUT_S * 0.6)
                sock.sendall(request)
                assert status_of(sock)[0] == 200
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # the headers never end
            time.sleep(HEADER_TIMEOUT_S + 0.5)
            assert closed_by_peer(sock)


def test_the_descriptor_limit_is_raised_to_the_hard_limit_at_start(tmp_path: Path) -> None:
    with ServiceProcess(tmp_path, *SMALL_POOL, nofile=(256, 2048)) as svc:
        assert svc.proc is not None
        limits = Path(f"/proc/{svc.proc.pid}/limits").read_text()
        (line,) = [ln for ln in limits.splitlines() if ln.startswith("Max open files")]
        assert line.split()[3:5] == ["2048", "2048"]


def test_a_limit_with_no_room_beside_the_reserve_is_refused() -> None:
    assert connection_budget(100, 4096) == 100
    with pytest.raises(LimitsError, match="RLIMIT_NOFILE is 300"):
        connection_budget(100, 300)


@pytest.mark.parametrize("flag", ["--max-connections", "--max-in-flight", "--header-timeout-s",
                                  "--body-timeout-s"])
def test_a_limit_flag_must_be_a_positive_number(flag: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvalloc serve")
    serve.add_arguments(parser)
    assert getattr(parser.parse_args([flag, "3"]), flag[2:].replace("-", "_")) == 3
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([flag, bad])
        assert exit_info.value.code == 2
        assert f"argument {flag}: {bad!r}" in capsys.readouterr().err
