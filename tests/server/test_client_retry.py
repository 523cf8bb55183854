"""The client's retries, against a scripted ZeroMQ ROUTER standing in for the service: a call that
times out is sent again unchanged (same step id, so the service answers without re-applying), and
a late reply to the abandoned attempt is never mistaken for the answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import TransportTimeout
from kvalloc.server.contract.operations import OK

REPLY = wire.PoolState  # any reply type will do; get_pool's is the simplest to build


def pool_reply(free_blocks: int) -> bytes:
    layout = wire.PoolLayout(num_blocks=8, tokens_per_block=4, num_layers=1, num_kv_heads=1,
                             head_dim=8, dtype="bfloat16", staging_dtype="bfloat16", device="cpu",
                             max_batch_size=2, max_blocks_per_seq=4, max_draft_len=3,
                             max_step_tokens=8, overlap_scheduler=True)
    return wire.encode_msgpack(REPLY(
        epoch=1, layout=layout, free_blocks=free_blocks, used_blocks=8 - free_blocks,
        parked_blocks=0,
        num_requests=0, workers=[], capacity_tokens=0, history_tokens=0, pending_slack_tokens=0,
        leases_expired=0, counters={}, invariants="unchecked"))


@pytest.fixture
def fake_service(tmp_path: Path) -> Iterator[Callable[[Callable[[zmq.Socket], None]], str]]:
    """Run ``script(router_socket)`` in a thread on a fresh ipc:// endpoint; returns it. The
    socket stays open until the test is over: closed earlier (linger 0), it would drop the
    replies its I/O thread had not sent yet."""
    ctx = zmq.Context()
    threads: list[threading.Thread] = []
    sockets: list[zmq.Socket] = []

    def start(script: Callable[[zmq.Socket], None]) -> str:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{tmp_path / 'fake.ipc'}"
        sock.bind(endpoint)
        sockets.append(sock)
        threads.append(threading.Thread(target=script, args=(sock,), daemon=True))
        threads[-1].start()
        return endpoint

    yield start
    for t in threads:
        t.join(timeout=10)
    for sock in sockets:
        sock.close()
    ctx.term()


def test_a_timed_out_call_is_resent_unchanged_and_a_late_reply_is_dropped(
        fake_service: Callable[[Callable[[zmq.Socket], None]], str]) -> None:
    attempts: list[list[bytes]] = []

    def script(sock: zmq.Socket) -> None:
        attempts.append(sock.recv_multipart())  # first attempt: no answer in time
        attempts.append(sock.recv_multipart())  # the retry
        (peer, first_seq, *_), (_, retry_seq, *_) = attempts
        sock.send_multipart([peer, first_seq, OK, pool_reply(free_blocks=1)])  # too late
        sock.send_multipart([peer, retry_seq, OK, pool_reply(free_blocks=2)])

    with Client(fake_service(script), timeout_s=30.0, retries=1, reply_spin_s=0) as client:
        # The first attempt's wait ends at once, as a timeout would; the retry waits for real (a
        # loaded machine may take seconds to schedule the fake service, which must not matter).
        # No spin: every wait is the one poll counted here.
        sock = client._transport._sock
        waits: list[int] = []

        def poll(timeout: int, flags: int = zmq.POLLIN) -> int:
            waits.append(timeout)
            return 0 if len(waits) == 1 else zmq.Socket.poll(sock, timeout, flags)

        sock.poll = poll
        assert client.get_pool(verify=True).free_blocks == 2
    first, retry = (a[2:] for a in attempts)
    assert first == retry  # token, op and payload: byte for byte the same call
    assert msgspec.msgpack.decode(first[-1]) == {"verify": True}
    assert len(waits) == 3  # the first attempt's, then the retry's past the late reply


def test_the_call_gives_up_after_its_retries(
        fake_service: Callable[[Callable[[zmq.Socket], None]], str]) -> None:
    attempts: list[list[bytes]] = []

    def script(sock: zmq.Socket) -> None:
        while sock.poll(2000):
            attempts.append(sock.recv_multipart())

    with Client(fake_service(script), timeout_s=0.2, retries=2) as client, \
            pytest.raises(TransportTimeout):
        client.get_pool()
    # The client gave up 0.2 s after its last attempt; the fake service may not have read it yet.
    deadline = time.monotonic() + 10
    while len(attempts) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(attempts) == 3
