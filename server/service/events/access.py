"""Who may read a KV event stream, decided where its sockets are bound.

Routers connect unmodified, so a stream is plain ZeroMQ unless the router opts into a key; what
keeps others out depends on the endpoint:

- ``ipc:///path``: the operating system. The socket file is made 0600 (the service's user
  alone) or, with a ``group``, 0660 and owned by that group. It is bound under a temporary name,
  given its mode, then renamed into place, so nobody can connect before the mode holds.
- ``tcp://host:port``: an events-only secret (``KVALLOC_EVENTS_SECRET``, `EventAccess.secret`):
  the socket is a CURVE server admitting the subscriber key derived from that secret alone
  (`server.contract.routing.curve_keys`). Workers hold the service token, never this secret.
  Without it, a TCP stream is served plain only with the explicit ``plaintext`` switch: anyone
  who reaches the port reads every prompt's token ids.
"""

from __future__ import annotations

import contextlib
import grp
import os
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
from kvalloc.server.contract.errors import AddressError
from kvalloc.server.contract.routing import curve_keys
from pydantic import SecretStr

PRIVATE_MODE = 0o600
GROUP_MODE = 0o660


@dataclass(frozen=True)
class EventAccess:
    """``secret``: CURVE on TCP streams; ``plaintext``: TCP streams served plain (the switch);
    ``group``: socket files 0660 with this group instead of 0600."""

    secret: SecretStr | None = None
    plaintext: bool = False
    group: str | None = None

    def check(self, endpoint: str, flag: str) -> None:
        """Refuse, before anything is bound, an endpoint this access cannot protect."""
        if endpoint.startswith("tcp://") and self.secret is None and not self.plaintext:
            raise AddressError(
                f"argument {flag}: {endpoint} is a TCP stream and KVALLOC_EVENTS_SECRET is not "
                "set; set it (routers then use the events-only CURVE keys), use an ipc:// "
                "endpoint (file permissions decide), or pass --kv-events-plaintext to serve it "
                "open")
        if self.group is not None:
            group_id(self.group)


def group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise AddressError(f"argument --kv-events-group: no group named {name!r}") from None


def bind(sock: zmq.Socket, endpoint: str, access: EventAccess) -> str:
    """Bind ``sock`` at ``endpoint`` as ``access`` says; returns the endpoint bound (a TCP
    port picked by the system included). `AddressError` when it cannot be bound, or not as
    ``access`` requires."""
    access.check(endpoint, "kv_events")
    if endpoint.startswith("ipc://"):
        path = Path(endpoint.removeprefix("ipc://"))
        _bind_file(sock, path, access.group)
        return f"ipc://{path}"
    # ZeroMQ binds an IPv6 address (tcp://[::1]:port) only on a socket told to.
    sock.ipv6 = "[" in endpoint
    if access.secret is not None:
        keys = curve_keys(access.secret.get_secret_value())
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise AddressError(f"{endpoint}: {exc.strerror}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _bind_file(sock: zmq.Socket, path: Path, group: str | None) -> None:
    _refuse_taken(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        sock.bind(f"ipc://{temporary}")
    except zmq.ZMQError as exc:
        raise AddressError(f"ipc://{path}: {exc.strerror}") from None
    try:
        if group is None:
            os.chmod(temporary, PRIVATE_MODE)
        else:
            os.chown(temporary, -1, group_id(group))
            os.chmod(temporary, GROUP_MODE)
        os.replace(temporary, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise AddressError(f"ipc://{path}: {exc.strerror}") from None


def _refuse_taken(path: Path) -> None:
    """A live socket at ``path`` belongs to another process: never take it over. A dead one (a
    killed service's) is replaced."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise AddressError(f"ipc://{path}: exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return
    finally:
        probe.close()
    raise AddressError(f"ipc://{path}: another process is listening there")


def release(endpoint: str) -> None:
    """Remove a closed stream's socket file: ZeroMQ would remove the temporary name it bound."""
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            Path(endpoint.removeprefix("ipc://")).unlink()
