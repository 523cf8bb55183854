"""Where the service listens by default, how a client address names its transport, and the
token both sides read from the environment.

Addresses: ``ipc:///path`` and ``tcp://host:port`` are the IPC transport over ZeroMQ, and
``stream:///path`` the same messages over a plain Unix stream socket; ``http://host:port`` and
``unix:///path`` are REST over TCP and over a Unix socket. The defaults are loopback only, and
socket files live in a per-user directory created 0700.
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Literal

from kvalloc.server.contract.errors import AddressError, NotASocket

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8900
ADDRESS_ENV = "KVALLOC_ADDRESS"
TOKEN_ENV = "KVALLOC_TOKEN"

Transport = Literal["ipc", "stream", "rest"]


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


def default_stream() -> str:
    return f"stream://{runtime_dir() / 'kvalloc.stream'}"


def default_ipc_endpoints() -> list[str]:
    """Where the service serves IPC unless told: the stream socket alone. ZeroMQ only where it
    is asked for (``--ipc ipc:///path``): libzmq aborts the whole process when it runs out of
    descriptors and bounds no connections, so any process that can open its socket could kill
    the service; the stream socket bounds its connections and is the faster local path."""
    return [default_stream()]


def default_client_address() -> str:
    """``KVALLOC_ADDRESS`` if set, else the service's default stream socket (its fastest local
    path)."""
    return os.environ.get(ADDRESS_ENV) or default_stream()


def transport_of(address: str) -> Transport:
    scheme = address.partition("://")[0]
    if scheme in ("ipc", "tcp"):
        return "ipc"
    if scheme == "stream":
        return "stream"
    if scheme in ("http", "unix"):
        return "rest"
    raise AddressError(f"address: {address!r} must start with ipc://, tcp://, stream://, "
                       "http:// or unix://")


def port_number(text: str) -> int:
    """A TCP port, 0 meaning any free one. Out of range is an error, never wrapped or replaced."""
    try:
        port = int(text)
    except ValueError:
        raise AddressError(f"port {text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise AddressError(f"port {port} is out of range 0-65535")
    return port


def socket_file(text: str) -> str:
    """A Unix socket path as a flag names it. Whether its directory exists is checked where the
    socket is made (`require_directory`): a command line may be read on another host."""
    if not text:
        raise AddressError("socket path is empty")
    return text


def require_directory(path: Path) -> None:
    """The directory a socket file will be created in must exist."""
    if not path.parent.is_dir():
        raise AddressError(f"{path}: directory {path.parent} does not exist")


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` or ``stream://`` endpoint; None for ``tcp://``."""
    scheme, _, rest = endpoint.partition("://")
    return Path(rest) if scheme in ("ipc", "stream") else None


def stream_path(endpoint: str) -> Path | None:
    """The socket file of a ``stream://`` endpoint; None for a ZeroMQ one."""
    return Path(endpoint.removeprefix("stream://")) if endpoint.startswith("stream://") else None


def server_endpoint(endpoint: str) -> str:
    """A ZeroMQ endpoint the service can bind: ``ipc:///path`` or ``tcp://host:port`` with a port
    in range (``*`` or 0: any free port)."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme == "ipc":
        socket_file(rest)
        return endpoint
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            raise AddressError(f"{endpoint!r}: need tcp://host:port")
        if port != "*":
            port_number(port)
        return endpoint
    raise AddressError(f"{endpoint!r} is not ipc:///path or tcp://host:port")


def ipc_endpoint(endpoint: str) -> str:
    """An endpoint the IPC transport can serve: a ZeroMQ one (`server_endpoint`) or
    ``stream:///path``."""
    path = stream_path(endpoint)
    if path is not None:
        socket_file(str(path))
        return endpoint
    if endpoint.partition("://")[0] not in ("ipc", "tcp"):  # the schemes listed are this one's
        raise AddressError(f"{endpoint!r} is not ipc:///path, tcp://host:port or "
                           f"stream:///path")
    return server_endpoint(endpoint)


def client_address(address: str) -> str:
    """An address a client can call: a known scheme, and a port in 1-65535 where there is one."""
    kind = transport_of(address)
    scheme, _, rest = address.partition("://")
    if not rest:
        raise AddressError(f"{address!r}: nothing after {scheme}://")
    if scheme in ("tcp", "http"):
        host, colon, port = rest.split("/", 1)[0].rpartition(":")
        if kind == "ipc" and not colon:
            raise AddressError(f"{address!r}: need tcp://host:port")
        if colon and (not host or port_number(port) == 0):
            raise AddressError(f"{address!r}: need a host and a port in 1-65535")
    return address


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
