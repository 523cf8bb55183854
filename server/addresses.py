"""Where the service listens by default, how a client address names its transport, and the
token both sides read from the environment.

Addresses: ``ipc:///path`` and ``tcp://host:port`` are the ZeroMQ transport; ``http://host:port``
and ``unix:///path`` are REST over TCP and over a Unix socket. The defaults are loopback only, and
socket files live in a per-user directory created 0700.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Literal

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8900
ADDRESS_ENV = "KVALLOC_ADDRESS"
TOKEN_ENV = "KVALLOC_TOKEN"

Transport = Literal["ipc", "rest"]


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvalloc`` or ``<tmp>/kvalloc-<uid>``, created 0700 and owned by us."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    uid = os.getuid()
    path = Path(base) / "kvalloc" if base else Path(tempfile.gettempdir()) / f"kvalloc-{uid}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.stat()
    if info.st_uid != uid or stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(f"{path}: must be owned by uid {uid} with mode 0700")
    return path


def default_ipc() -> str:
    return f"ipc://{runtime_dir() / 'kvalloc.ipc'}"


def default_client_address() -> str:
    """``KVALLOC_ADDRESS`` if set, else the service's default IPC endpoint."""
    return os.environ.get(ADDRESS_ENV) or default_ipc()


def transport_of(address: str) -> Transport:
    scheme = address.partition("://")[0]
    if scheme in ("ipc", "tcp"):
        return "ipc"
    if scheme in ("http", "unix"):
        return "rest"
    raise ValueError(f"address: {address!r} must start with ipc://, tcp://, http:// or unix://")


class NotASocket(OSError):
    """Something other than a socket file is at a socket path; it is never removed."""


def claim_socket_path(path: Path) -> None:
    """Make ``path`` free for a new Unix socket: a stale socket file (its server is gone) is
    removed; a live one is an error, so two services never steal each other's clients; anything
    that is not a socket (a regular file, a directory, a link) is refused and left alone."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise NotASocket(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX) as probe:
        if probe.connect_ex(str(path)) == 0:
            raise OSError(f"{path} is in use by a running server")
    path.unlink()
