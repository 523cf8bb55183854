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


def claim_socket_path(path: Path) -> None:
    """Make ``path`` free for a new Unix socket: a stale socket file (its server is gone) is
    removed; a live one is an error, so two services never steal each other's clients."""
    if not path.exists():
        return
    with socket.socket(socket.AF_UNIX) as probe:
        if probe.connect_ex(str(path)) == 0:
            raise OSError(f"{path} is in use by a running server")
    path.unlink()
