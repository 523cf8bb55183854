"""Where a stream's sockets are bound decides who reads it: a socket file private to the service's
user (or shared with one group) from the moment anyone can connect, never a live socket taken
over, a TCP stream only with the events secret or the plaintext switch, and every refusal an
`AddressError` that names the endpoint."""

from __future__ import annotations

import grp
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from kvalloc.server.contract.errors import AddressError
from kvalloc.server.service.events.access import EventAccess, bind, release
from pydantic import SecretStr

PLAIN = EventAccess(plaintext=True)


@pytest.fixture
def pub(zmq_context: zmq.Context) -> Iterator[zmq.Socket]:
    sock = zmq_context.socket(zmq.PUB)
    yield sock
    sock.close(linger=0)


def test_a_socket_file_is_the_services_users_alone_or_its_groups(tmp_path: Path,
                                                                    zmq_context: zmq.Context):
    group = grp.getgrgid(os.getgid()).gr_name
    for access, mode in [(EventAccess(), 0o600), (EventAccess(group=group), 0o660)]:
        path = tmp_path / f"events-{mode:o}"
        sock = zmq_context.socket(zmq.PUB)
        try:
            assert bind(sock, f"ipc://{path}", access) == f"ipc://{path}"
            info = path.lstat()
            assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == mode
            assert info.st_gid == os.getgid()
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        finally:
            sock.close(linger=0)
            release(f"ipc://{path}")
        assert not path.exists()


def test_a_live_socket_is_never_taken_over_and_a_dead_one_is_replaced(tmp_path: Path, pub):
    path = tmp_path / "events"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    try:
        with pytest.raises(AddressError, match=f"ipc://{path}: another process is listening"):
            bind(pub, f"ipc://{path}", EventAccess())
    finally:
        listener.close()  # the file stays: a killed service's socket
    assert bind(pub, f"ipc://{path}", EventAccess()) == f"ipc://{path}"
    not_a_socket = tmp_path / "file"
    not_a_socket.write_text("x")
    with pytest.raises(AddressError, match="exists and is not a socket"):
        bind(pub, f"ipc://{not_a_socket}", EventAccess())


def test_tcp_needs_the_events_secret_or_the_plaintext_switch(pub):
    with pytest.raises(AddressError, match="KVALLOC_EVENTS_SECRET is not set"):
        bind(pub, "tcp://127.0.0.1:*", EventAccess())
    assert bind(pub, "tcp://127.0.0.1:*", EventAccess(secret=SecretStr("s"))).startswith(
        "tcp://127.0.0.1:")
    assert pub.curve_server


def test_a_taken_port_names_its_endpoint_and_ipv6_loopback_binds(zmq_context, pub):
    bound = bind(pub, "tcp://127.0.0.1:*", PLAIN)
    second = zmq_context.socket(zmq.PUB)
    try:
        with pytest.raises(AddressError, match=f"{bound}: Address already in use"):
            bind(second, bound, PLAIN)
        assert bind(second, "tcp://[::1]:*", PLAIN).startswith("tcp://[::1]:")
    finally:
        second.close(linger=0)


def test_an_unknown_group_is_refused_before_anything_is_bound(tmp_path: Path, pub):
    with pytest.raises(AddressError, match="no group named 'no-such-group-here'"):
        bind(pub, f"ipc://{tmp_path / 'events'}", EventAccess(group="no-such-group-here"))
    assert list(tmp_path.iterdir()) == []
