"""The client's REST transport against a scripted HTTP server standing in for the service: one
kept-alive connection, a connection the service closed while idle replaced without the caller
noticing, a reply read whole whatever pieces it arrives in, an early refusal delivered though the
body could not be sent, and silence, absence or a reply that is not the service's reported as
the client's own errors."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.contract.errors import ServiceUnreachable, TokenRejected, TransportTimeout

Script = Callable[[socket.socket, int], None]  # (accepted connection, its number)


def pool_state(free_blocks: int) -> bytes:
    layout = wire.PoolLayout(num_blocks=8, tokens_per_block=4, num_layers=1, num_kv_heads=1,
                             head_dim=8, dtype="bfloat16", staging_dtype="bfloat16", device="cpu",
                             max_batch_size=2, max_blocks_per_seq=4, max_draft_len=3,
                             max_step_tokens=8, overlap_scheduler=True)
    return wire.encode_json(wire.PoolState(
        epoch=1, layout=layout, free_blocks=free_blocks, used_blocks=8 - free_blocks,
        parked_blocks=0,
        num_requests=0, workers=[], capacity_tokens=0, history_tokens=0, pending_slack_tokens=0,
        leases_expired=0, counters={}, invariants="unchecked"))


def read_request(conn: socket.socket) -> bytes:
    """One request's head (the client's GETs carry no body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    return data


def answer(conn: socket.socket, body: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)


@pytest.fixture
def fake_http() -> Iterator[Callable[[Script], str]]:
    """Serve every accepted connection, one after another, with ``script(conn, n)`` in a
    thread; returns the address."""
    listener = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []

    def start(script: Script) -> str:
        def accept() -> None:
            n = 0
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    script(conn, n)
                n += 1

        threads.append(threading.Thread(target=accept, daemon=True))
        threads[-1].start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    listener.close()


def test_calls_share_one_connection_and_an_idle_close_is_replaced_unseen(
        fake_http: Callable[[Script], str]) -> None:
    heads: list[bytes] = []
    connections: list[int] = []

    def script(conn: socket.socket, n: int) -> None:
        connections.append(n)
        for _ in range(2):  # two calls on this connection, then an idle close
            head = read_request(conn)
            if not head:
                return  # the client closed it
            heads.append(head)
            answer(conn, pool_state(free_blocks=len(heads)))

    address = fake_http(script)
    with Client(address, timeout_s=5, retries=0) as client:
        assert [client.get_pool(verify=True).free_blocks for _ in range(3)] == [1, 2, 3]
    assert connections == [0, 1]  # the third call found the first connection closed
    assert len(heads) == 3
    assert all(h.startswith(b"GET /v1/pool?verify=true HTTP/1.1") for h in heads)


def test_a_reply_arriving_in_pieces_is_read_whole(fake_http: Callable[[Script], str]) -> None:
    """Head and body in several writes, header names in any case: the reply is the same."""
    body = pool_state(free_blocks=5)
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")
    pieces = [head[:7], head[7:-3], head[-3:] + body[:10], body[10:-1], body[-1:]]

    def script(conn: socket.socket, n: int) -> None:
        while read_request(conn):
            for piece in pieces:
                conn.sendall(piece)
                time.sleep(0.02)  # each piece its own segment

    address = fake_http(script)
    with Client(address, timeout_s=5, retries=0) as client:
        assert [client.get_pool().free_blocks for _ in range(2)] == [5, 5]


def test_a_reply_without_a_declared_length_is_refused(
        fake_http: Callable[[Script], str]) -> None:
    """The service declares every body's length; a chunked reply is not the service's."""
    def script(conn: socket.socket, n: int) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")

    address = fake_http(script)
    with Client(address, timeout_s=5, retries=0) as client, \
            pytest.raises(ServiceUnreachable, match="does not declare its length"):
        client.get_pool()


def test_silence_is_a_timeout_and_no_listener_is_unreachable(
        fake_http: Callable[[Script], str]) -> None:
    done = threading.Event()

    def script(conn: socket.socket, n: int) -> None:
        read_request(conn)
        done.wait(10)  # never answers

    address = fake_http(script)
    with Client(address, timeout_s=0.3, retries=0) as client, pytest.raises(TransportTimeout):
        client.get_pool()
    done.set()
    free = socket.create_server(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    with Client(f"http://127.0.0.1:{port}", timeout_s=1, retries=0) as client, \
            pytest.raises(ServiceUnreachable):
        client.get_pool()


def test_an_answer_given_before_the_body_was_read_reaches_the_caller(tmp_path: Path) -> None:
    """The service refuses a call on its headers alone (here a missing token) and closes the
    connection; the client's body write fails, and the refusal is still what the caller gets."""
    path = tmp_path / "rest.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    refusal = wire.encode_json(wire.ErrorBody(status=401, code="unauthorized",
                                              field="authorization", message="no token"))

    def refuse_on_the_head() -> None:
        conn, _ = listener.accept()
        with conn:
            read_request(conn)
            conn.sendall(b"HTTP/1.1 401 Unauthorized\r\nconnection: close\r\ncontent-type: "
                         b"application/json\r\ncontent-length: " + str(len(refusal)).encode()
                         + b"\r\n\r\n" + refusal)

    thread = threading.Thread(target=refuse_on_the_head, daemon=True)
    thread.start()
    # A body far larger than the socket's buffers: its write cannot finish before the close.
    call = StepCall.build("w", 1, 1, 0, new_req_ids=["long"], prompt_lens=[400_000],
                          prompt_token_ids=np.arange(400_000))
    with Client(f"unix://{path}", timeout_s=5, retries=0) as client, \
            pytest.raises(TokenRejected) as refused:
        client.call("step", call)
    assert refused.value.status == 401
    thread.join(5)
    listener.close()
