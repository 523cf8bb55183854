"""The IPC frames over a plain Unix stream socket (``stream://``): the listener's bounds against
misbehaving peers, the client's connection handling, and a real ``kvalloc serve`` answering the
same calls over ``stream://`` exactly as over ZeroMQ's ``ipc://``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvalloc.allocator import PoolConfig
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import TokenRejected, TransportTimeout
from kvalloc.server.contract.operations import ERROR, OK
from kvalloc.server.devtools.launch import ServiceProcess
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.transport import stream
from kvalloc.server.transport.ipc import IpcServer
from kvalloc.server.transport.token_files import discover_token
from proc_status import memory_kib
from pydantic import SecretStr


def echo(frames: list[bytes]) -> list[bytes]:
    """A handle that answers every message with its own payload."""
    return [frames[0], OK, frames[-1]]


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[stream.StreamListener]:
    monkeypatch.setattr(stream, "HANDSHAKE_S", 0.5)
    served = stream.StreamListener(tmp_path / "s.stream", echo, max_frame_bytes=1 << 16,
                                   max_connections=2)
    served.start()
    yield served
    served.stop()


def connect(listener: stream.StreamListener) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.connect(str(listener.path))
    return conn


def exchange(conn: socket.socket, frames: list[bytes]) -> list[bytes]:
    conn.sendall(stream.pack(frames))
    return read_reply(conn)


def read_reply(conn: socket.socket) -> list[bytes]:
    reply = stream.Inbox(conn).next_message()
    assert reply is not None, "the listener closed the connection"
    return reply


def closed_at_once(conn: socket.socket) -> bool:
    """Whether the listener closed ``conn`` right away (over its connection bound)."""
    conn.settimeout(0.2)
    try:
        return closed(conn)
    except TimeoutError:
        return False  # still open: being served
    finally:
        conn.settimeout(5)


def closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_messages_are_answered_in_order_on_one_connection(listener) -> None:
    conn = connect(listener)
    for i in range(3):
        assert exchange(conn, [bytes([i]), b"", b"op", b"payload %d" % i]) == [
            bytes([i]), OK, b"payload %d" % i]
    conn.close()
    assert listener.path.stat().st_mode & 0o777 == 0o600


def test_a_silent_connection_is_dropped_and_never_blocks_another(listener) -> None:
    silent = connect(listener)
    talker = connect(listener)
    assert exchange(talker, [b"1", b"", b"op", b"x"])[2] == b"x"
    # Closed within the handshake time (0.5 s here), well before connect()'s 5 s read timeout.
    assert closed(silent)
    assert exchange(talker, [b"2", b"", b"op", b"y"])[2] == b"y"  # an idle talker stays


def test_connections_beyond_the_bound_are_closed_at_once(listener) -> None:
    held = [connect(listener) for _ in range(2)]
    for conn in held:  # both are being served
        assert exchange(conn, [b"1", b"", b"op", b"x"])[2] == b"x"
    extra = connect(listener)
    assert closed(extra)
    held[0].close()
    deadline = time.monotonic() + 10
    while True:  # its serving thread notices the close within a poll or so
        again = connect(listener)
        if not closed_at_once(again) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert exchange(again, [b"1", b"", b"op", b"z"])[2] == b"z"


def test_an_oversized_message_is_refused_unread_and_a_malformed_one_named(listener) -> None:
    conn = connect(listener)
    conn.sendall(stream.LENGTH.pack((1 << 16) + 1))
    _, status, payload = read_reply(conn)
    error = wire.decode(payload, wire.ErrorBody)
    assert (status, error.status, error.code) == (ERROR, 413, "body_too_large")
    assert closed(conn)
    conn = connect(listener)
    body = msgspec.msgpack.encode({"not": "frames"})
    conn.sendall(stream.LENGTH.pack(len(body)) + body)
    _, status, payload = read_reply(conn)
    error = wire.decode(payload, wire.ErrorBody)
    assert (status, error.field) == (ERROR, "frames")
    assert exchange(conn, [b"1", b"", b"op", b"still here"])[2] == b"still here"


def test_a_message_is_read_whole_however_it_is_split_or_joined() -> None:
    """Byte by byte, two messages in one write, one larger than the reading buffer: the same
    frames come out, in order, and nothing of the next message is lost."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.set_timeouts(ours, 5)
    inbox = stream.Inbox(ours)
    small, large = [b"1", b"", b"op", b"x" * 10], [b"2", b"", b"op", b"y" * 200_000]
    sender = threading.Thread(target=lambda: (
        [theirs.send(bytes([b])) for b in stream.pack(small)],
        theirs.sendall(stream.pack(large) + stream.pack(small))))
    sender.start()
    assert [inbox.next_message() for _ in range(3)] == [small, large, small]
    sender.join()
    theirs.close()
    assert inbox.next_message() is None  # closed between messages


class EagerPeer:
    """A socket stand-in whose every receive fills all the room it is given: where a message
    boundary falls in the reader's buffer is then exact."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)

    def recv_into(self, view: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        n = min(len(view), len(self.data))
        view[:n], self.data = self.data[:n], self.data[n:]
        return n


def test_a_long_stream_of_messages_keeps_the_reading_buffer_small() -> None:
    """Messages that leave the next one's length prefix cut by the end of the buffer, over and
    over, never grow it; the room a large message needed is given back once it is read."""
    usual = len(stream.Inbox(EagerPeer(b""))._buffer)  # type: ignore[arg-type]
    body = b"z" * 60_000  # a length of the same msgpack width as the message's
    overhead = len(stream.pack([b"1", b"", b"op", body])) - len(body)
    message = [b"1", b"", b"op", b"z" * (usual - 2 - overhead)]  # packed: the buffer less 2
    large = [b"2", b"", b"op", b"y" * (5 * usual)]
    assert len(stream.pack(message)) == usual - 2
    inbox = stream.Inbox(EagerPeer(stream.pack(message) * 40 + stream.pack(large)))  # type: ignore[arg-type]
    for _ in range(40):
        assert inbox.next_message() == message
        assert len(inbox._buffer) == usual
    assert inbox.next_message() == large
    assert len(inbox._buffer) == usual
    assert inbox.next_message() is None


def test_a_message_dribbled_slower_than_the_bound_is_dropped(listener) -> None:
    conn = connect(listener)
    message = stream.pack([b"1", b"", b"op", b"slow"])
    conn.sendall(message[:6])  # begun, never completed within 0.5 s
    time.sleep(0.3)
    conn.sendall(message[6:8])
    assert closed(conn)


def test_stopping_ends_idle_connections_and_answers_the_message_in_hand(
        tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()

    def slow_echo(frames: list[bytes]) -> list[bytes]:
        started.set()
        release.wait(5)
        return echo(frames)

    served = stream.StreamListener(tmp_path / "stop.stream", slow_echo, max_frame_bytes=1 << 16,
                                   max_connections=4)
    served.start()
    idle, busy = connect(served), connect(served)
    exchange_done: list[list[bytes]] = []
    caller = threading.Thread(target=lambda: exchange_done.append(
        exchange(busy, [b"1", b"", b"op", b"in hand"])))
    caller.start()
    assert started.wait(5)
    stopper = threading.Thread(target=served.stop)
    stopper.start()
    release.set()
    stopper.join(10)
    caller.join(10)
    assert not stopper.is_alive()
    assert exchange_done == [[b"1", OK, b"in hand"]]
    assert closed(idle)
    assert not served.path.exists()


def test_a_spinning_service_answers_on_both_carriers_and_still_stops_at_once(
        tmp_path: Path) -> None:
    """Connections that poll for their next call (``ipc_spin_s``) far longer than the test
    runs: every call is answered, only calls with the token earn a spin, and stopping does not
    wait for a spin to run out."""
    pool = PoolConfig(num_blocks=64, num_layers=1, device="cpu", max_batch_size=4,
                      max_seq_len=256)
    core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=64, ipc_spin_s=60))
    server = IpcServer(core, [f"ipc://{tmp_path / 'z.ipc'}", f"stream://{tmp_path / 's.stream'}"],
                       token=SecretStr("right"))
    spins: list[int] = []  # the ZeroMQ thread's polls without sleeping
    arrived = server._arrived
    server._arrived = lambda: spins.append(1) or arrived()  # type: ignore[method-assign]
    try:
        zeromq, stream_socket = server.start()
        with Client(zeromq, token="wrong", reply_spin_s=0, retries=0) as client, \
                pytest.raises(TokenRejected):
            client.get_pool()
        assert spins == []  # refused: no spin for the ZeroMQ thread
        for endpoint in (zeromq, stream_socket):
            with Client(endpoint, token="right", reply_spin_s=0) as client:
                assert [client.get_pool().free_blocks for _ in range(3)] == [64] * 3
        assert spins  # answered: the ZeroMQ thread polled for the next call
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive()
    finally:
        core.close()


def test_only_a_call_answered_in_full_earns_a_spin(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection polls for its next message only after an answer that is not an error: a
    peer without the token, or sending bad input, cannot keep a core busy."""
    spins: list[bool] = []
    next_message = stream.Inbox.next_message

    def recorded(self: stream.Inbox, **kwargs: Any) -> list[bytes] | None:
        if threading.current_thread().name == "kvalloc-stream-conn":  # the listener's reads
            spins.append(kwargs["wait"].spin_s > 0)
        return next_message(self, **kwargs)

    monkeypatch.setattr(stream.Inbox, "next_message", recorded)

    def judge(frames: list[bytes]) -> list[bytes]:
        return [frames[0], OK if frames[-1] == b"good" else ERROR, b""]

    served = stream.StreamListener(tmp_path / "judge.stream", judge, max_frame_bytes=1 << 16,
                                   max_connections=2, spin_s=0.25)
    served.start()
    try:
        conn = connect(served)
        statuses = [exchange(conn, [b"1", b"", b"op", payload])[1]
                    for payload in (b"good", b"bad", b"good", b"good")]
        conn.sendall(stream.LENGTH.pack(3) + b"\xc1xx")  # not msgpack: malformed
        assert read_reply(conn)[1] == ERROR
        assert exchange(conn, [b"2", b"", b"op", b"bad"])[1] == ERROR
        conn.close()
    finally:
        served.stop()
    assert statuses == [OK, ERROR, OK, OK]
    # Waits before: the first message, then after good, bad, good, good and malformed ones (the
    # wait after the last answer may be cut short by stop()).
    assert spins[:6] == [False, True, False, True, True, False]


def test_a_second_listener_on_a_live_path_fails_and_leaves_the_first_serving(
        listener) -> None:
    second = stream.StreamListener(listener.path, echo, max_frame_bytes=1 << 16,
                                   max_connections=2)
    with pytest.raises(OSError):
        second.start()
    second.stop()  # as a service stops after failing to listen
    assert listener.path.exists()
    assert exchange(connect(listener), [b"1", b"", b"op", b"still"])[2] == b"still"


def test_a_silent_service_times_out_and_the_next_call_reconnects(tmp_path: Path) -> None:
    path = tmp_path / "silent.stream"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    accepted: list[socket.socket] = []

    def accept() -> None:
        for _ in range(2):
            accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    with Client(f"stream://{path}", timeout_s=0.3, retries=1) as client, \
            pytest.raises(TransportTimeout):
        client.get_pool()
    thread.join(5)
    assert len(accepted) == 2  # the retry did not reuse the timed-out connection
    for conn in accepted:
        conn.close()
    server.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("stream"), "--device", "cpu", "--num-blocks",
                        "400", "--max-batch-size", "16") as svc:
        yield svc


def run_script(address: str, worker_id: str) -> list[object]:
    """A short life of two requests; the replies that do not depend on handle values."""
    seen: list[object] = []
    with Client(address, worker_id=worker_id) as client:
        client.register()
        reply = client.step(new=(["a", "b"], [40, 7]))
        handles = reply.admitted
        for accepted in ([3, 3], [0, 2], [1, 0]):
            reply = client.step(results=(handles, accepted) if seen else None,
                                grants=(handles, [3, 3]))
            seen.append((reply.scheduled.num_tokens.tolist(),
                         reply.scheduled.start_positions.tolist(), reply.committed))
        reply = client.step(results=(handles, [2, 2]), finished=handles)
        seen.append((reply.committed, len(reply.scheduled)))
        pool = client.get_pool(verify=True)
        seen.append(pool.invariants)
        client.deregister()
    return seen


def test_a_real_service_answers_over_stream_as_over_zeromq(service: ServiceProcess) -> None:
    assert run_script(service.stream, "over-stream") == run_script(service.ipc, "over-zeromq")


# ---------------------------------------------------------------- peers without the token

GUARDED_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4",
                "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
                "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "64",
                "--max-workers", "1")
SLOTS = 2 * 1 + 8  # the stream socket's connection bound at --max-workers 1
FRAME_LIMIT = 4 * (8 << 20)  # 4 x the default --max-body-bytes


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path, *GUARDED_POOL, tcp=False) as svc:
        yield svc


def raw(svc: ServiceProcess) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5 * stream.HANDSHAKE_S)  # the service closes it well before
    conn.connect(svc.stream.removeprefix("stream://"))
    return conn


def get_pool_call(token: bytes) -> bytes:
    return stream.pack([b"\x00" * 8, token, b"get_pool", msgspec.msgpack.encode({})])


@pytest.mark.parametrize("token", [b"w" * 43, b"short", b""])
def test_a_message_with_a_wrong_token_is_refused_and_its_connection_closed(
        guarded: ServiceProcess, token: bytes) -> None:
    conn = raw(guarded)
    conn.sendall(get_pool_call(token))
    seq, status, payload = read_reply(conn)
    assert (status, wire.decode(payload, wire.ErrorBody).code) == (ERROR, "unauthorized")
    assert seq == b"\x00" * 8  # echoed: a client takes it as its call's answer
    assert closed(conn)


def test_a_wrong_token_after_calls_with_the_right_one_closes_the_connection_too(
        guarded: ServiceProcess) -> None:
    token = discover_token(guarded.stream)
    assert token is not None
    conn = raw(guarded)
    conn.sendall(get_pool_call(token.encode()))
    assert read_reply(conn)[1] == OK
    conn.sendall(get_pool_call(b"w" * len(token)))
    _, status, payload = read_reply(conn)
    assert (status, wire.decode(payload, wire.ErrorBody).code) == (ERROR, "unauthorized")
    assert closed(conn)


def test_peers_without_the_token_cannot_hold_the_slots_workers_need(
        guarded: ServiceProcess) -> None:
    """Every slot taken, half by peers that sent a wrong token and stayed, half by silent ones:
    the first are closed at their refusal, the silent ones make way, oldest first, and a worker
    registers and steps at once, its connection then kept however many strangers come."""
    refused = [raw(guarded) for _ in range(SLOTS // 2)]
    for conn in refused:
        conn.sendall(get_pool_call(b"w" * 43))
    silent = [raw(guarded) for _ in range(SLOTS - len(refused))]
    for conn in refused:
        read_reply(conn)
        assert closed(conn)
    with Client(guarded.stream, worker_id="not-locked-out", timeout_s=30, retries=0) as worker:
        worker.register(attach=False)
        assert worker.step(new=(["a"], [4])).admitted[0] >= 0
        assert closed(silent[0])  # the oldest made way
        strangers = [raw(guarded) for _ in range(2 * SLOTS)]
        assert worker.get_pool().num_requests == 1
        assert worker.deregister().freed_requests == 1
    for conn in [*refused, *silent, *strangers]:
        conn.close()


BURSTS, BURST = 5, 100  # silent connects: each burst past the old backlog of 64


def test_bursts_of_silent_connects_leave_fresh_workers_connecting_and_stepping(
        tmp_path: Path) -> None:
    """Bursts of connects that never send a byte, faster than the service accepts, each past
    the listen backlog the service once had (64: a Unix socket's full backlog refuses a connect
    at once). After each burst, while its peers still wait to be accepted or shed, a fresh
    worker connects, registers and steps on its first try and within its usual timeout; a
    worker connected before the first burst keeps stepping."""
    with ServiceProcess(tmp_path, *GUARDED_POOL[:-2], "--max-workers", "2", tcp=False) as svc:
        run_bursts(svc)


def run_bursts(svc: ServiceProcess) -> None:
    path = svc.stream.removeprefix("stream://")
    held: list[socket.socket] = []
    with Client(svc.stream, worker_id="connected", retries=0) as worker:
        worker.register(attach=False)
        handle = worker.step(new=(["kept"], [4])).admitted[0]
        try:
            for burst in range(BURSTS):
                for _ in range(BURST):
                    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    conn.setblocking(False)
                    try:
                        conn.connect(path)
                    except BlockingIOError:  # this kernel's backlog is full: burst enough
                        conn.close()
                        break
                    held.append(conn)
                with Client(svc.stream, worker_id=f"fresh-{burst}", retries=0) as fresh:
                    fresh.register(attach=False)
                    assert fresh.step(new=([f"r{burst}"], [4])).admitted[0] >= 0
                    assert fresh.deregister().freed_requests == 1
                reply = worker.step(results=([handle], [0]) if burst else None,
                                    grants=([handle], [0]))
                assert reply.scheduled.num_tokens.tolist() == [1]
        finally:
            for conn in held:
                conn.close()
        assert worker.get_pool().num_requests == 1
        assert worker.deregister().freed_requests == 1


def test_a_header_announcing_a_huge_message_allocates_nothing_before_the_token(
        guarded: ServiceProcess) -> None:
    """Headers announcing messages of nearly the frame limit on every slot, with the first bytes
    of their frames but no token yet: the service buffers none of it and drops each at the
    message deadline, its peak memory unchanged."""
    assert guarded.proc is not None
    pid = guarded.proc.pid
    peak_before = memory_kib(pid, "VmHWM")
    held = [raw(guarded) for _ in range(SLOTS)]
    for conn in held:
        conn.sendall(stream.LENGTH.pack(FRAME_LIMIT - 1) + b"\x94\xc4\x08" + b"\x00" * 8)
    for conn in held:  # closed at the message deadline
        assert closed(conn)
        conn.close()
    growth_mib = (memory_kib(pid, "VmHWM") - peak_before) / 1024
    assert growth_mib < 16, f"peak RSS grew {growth_mib:.0f} MiB"
    with Client(guarded.stream, worker_id="after", retries=0) as worker:
        assert worker.get_pool().num_requests == 0
