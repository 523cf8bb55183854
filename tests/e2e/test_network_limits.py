"""The network cannot kill the service, or make it hold memory, without the token.

Real `kvalloc serve` processes on loopback: thousands of half-open connections against a small
descriptor limit; raw connections past that limit to every endpoint the service listens on by
default; health probes through a flood of half-open connections; a flood of unauthenticated 8 MiB
bodies; calls beyond the in-flight bound; a body that never completes; a kept connection that
stops before its next request's headers. Each is bounded in count and time. The connection
bounds live in the HTTP protocol, so the tests of them run with each parser the service can use
here (`PARSERS`); the others with the default."""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from kvalloc.server import serve
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import LimitsError
from kvalloc.server.devtools.launch import ServiceProcess
from kvalloc.server.transport.network import connection_budget, http_parsers
from kvalloc.server.transport.token_files import discover_token
from proc_status import memory_kib

SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4",
              "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
              "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "64")
NOFILE = 1024
HALF_OPEN = 2000  # twice the service's descriptor limit
HEADER_TIMEOUT_S = 2.0
BODY = 8 << 20
PARSERS = [p for p in http_parsers() if p != "auto"]
SMALL_BOUND = 8
FLOOD = 3 * 1024  # several times the connection bound under NOFILE
PROBES = 20
CONNECT_S = 2.0


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


def half_open(port: int) -> socket.socket:
    """A connection whose request headers never end."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\n")
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
    connection bound evict the oldest, the rest are closed at the header deadline, and meanwhile
    a new IPC worker connects and steps (ZeroMQ never meets EMFILE)."""
    assert limited.port is not None
    held = [half_open(limited.port) for _ in range(HALF_OPEN)]
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
def test_a_connection_over_the_bound_evicts_the_oldest_one_waiting_for_headers(
        tmp_path: Path, parser: str) -> None:
    with ServiceProcess(tmp_path, *SMALL_POOL, "--http", parser, "--header-timeout-s", "120",
                        "--max-connections", str(SMALL_BOUND)) as svc:
        assert svc.port is not None
        held = [half_open(svc.port) for _ in range(SMALL_BOUND)]
        try:
            probe = send_head(svc.port, "GET", "/healthz")
            assert status_of(probe)[0] == 200
            probe.close()
            assert closed_by_peer(held[0])
            assert not any(closed_by_peer(sock) for sock in held[1:])
        finally:
            for sock in held:
                sock.close()


@pytest.mark.parametrize("parser", PARSERS)
def test_a_connection_over_a_bound_of_requests_in_progress_gets_503_with_retry_after(
        tmp_path: Path, parser: str) -> None:
    """Only a connection that finds every other inside a request is refused: a request in
    progress is never cut for a new connection."""
    with ServiceProcess(tmp_path, *SMALL_POOL, "--http", parser, "--body-timeout-s", "120",
                        "--max-connections", str(SMALL_BOUND)) as svc:
        assert svc.port is not None
        token = discover_token(svc.rest_tcp)
        held = [send_head(svc.port, "POST", "/v1/workers", length=100, token=token)
                for _ in range(SMALL_BOUND)]
        try:
            for sock in held:
                sock.sendall(b'{"worker_id"')  # the rest never comes
            time.sleep(0.5)  # (a refusal would come at once; none may come later either)
            extra = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
            status, headers = status_of(extra)
            assert status == 503 and headers["retry-after"] == "1"
            assert closed_by_peer(extra)
            assert not any(closed_by_peer(sock) for sock in held)
        finally:
            for sock in held:
                sock.close()


def test_health_probes_are_answered_through_a_flood_of_half_open_connections(
        tmp_path: Path) -> None:
    """Probes on fresh connections while another client keeps opening half-open ones, several
    times the connection bound in all, none of which the header deadline closes meanwhile:
    every probe is answered 200, as a kubelet's must be."""
    with ServiceProcess(tmp_path, *SMALL_POOL, "--header-timeout-s", "120",
                        nofile=(NOFILE, NOFILE)) as svc:
        assert svc.port is not None
        statuses = probes_during_a_flood(svc.port)
        assert statuses == [200] * PROBES
        with Client(svc.rest_tcp, worker_id="after-flood") as rest:
            rest.register()


def probes_during_a_flood(port: int) -> list[int]:
    """The statuses of `PROBES` probes of /healthz made once the connection bound is full of
    half-open connections, while more keep coming (`FLOOD` in all)."""
    stop = threading.Event()
    flood: list[socket.socket] = []

    def open_half_open() -> None:
        while not stop.is_set() and len(flood) < FLOOD:
            with contextlib.suppress(OSError):  # refused, or closed while sending
                flood.append(half_open(port))

    flooder = threading.Thread(target=open_half_open)
    flooder.start()
    try:
        while len(flood) < connection_budget(10**6, NOFILE) and flooder.is_alive():
            time.sleep(0.01)
        statuses = []
        for _ in range(PROBES):
            probe = send_head(port, "GET", "/healthz")
            statuses.append(status_of(probe)[0])
            probe.close()
    finally:
        stop.set()
        flooder.join()
        for sock in flood:
            sock.close()
    return statuses


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


def test_raw_connections_past_the_descriptor_limit_to_every_default_endpoint_leave_it_alive(
        tmp_path: Path) -> None:
    """What any local process of the service's user can do to its default endpoints: open more
    raw connections to each socket file in its runtime directory, and to its REST port, than the
    service has descriptors. None of them aborts it (ZeroMQ's listener would: it is not among
    the defaults), and a worker registers and steps on the default address afterwards."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    with ServiceProcess(tmp_path, *SMALL_POOL, "--header-timeout-s", str(HEADER_TIMEOUT_S),
                        env={"XDG_RUNTIME_DIR": str(runtime)}, default_ipc=True,
                        nofile=(NOFILE, NOFILE)) as svc:
        assert svc.proc is not None and svc.port is not None
        sockets = [p for p in (runtime / "kvalloc").iterdir() if p.is_socket()]
        assert sockets, "the service listens on no socket file by default"
        held = [*raw_connections(("127.0.0.1", svc.port), socket.AF_INET),
                *(c for path in sockets for c in raw_connections(str(path), socket.AF_UNIX))]
        try:
            time.sleep(1)  # (the listeners accept what they can meanwhile)
            assert svc.proc.poll() is None, f"the service died:\n{svc.log()}"
            with Client(f"stream://{runtime / 'kvalloc' / 'kvalloc.stream'}",
                        worker_id="after-raw-flood", timeout_s=30) as worker:
                worker.register()
                assert worker.step(new=(["a"], [4])).admitted[0] >= 0
        finally:
            for sock in held:
                sock.close()
        assert svc.proc.poll() is None and svc.ready()


def raw_connections(target: str | tuple[str, int], family: int) -> list[socket.socket]:
    """More connections to ``target`` than the service has descriptors, each tried until its
    listener's backlog takes it (or `CONNECT_S` passed: a listener that stopped accepting)."""
    made = []
    for _ in range(NOFILE + NOFILE // 8):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_S)
        deadline = time.monotonic() + CONNECT_S
        while True:
            try:
                sock.connect(target)
            except BlockingIOError:  # a Unix socket's backlog is full: it may drain
                if time.monotonic() < deadline:
                    time.sleep(0.001)
                    continue
            except OSError:
                pass
            else:
                made.append(sock)
                break
            sock.close()
            break
    return made


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
