"""Where a service's generated token lies, so that only its own user's clients find it.

With no ``KVALLOC_TOKEN`` the service makes a random token for its lifetime and writes it, mode
0600, once per endpoint it listens on:

- beside a socket file (``ipc:///path``, ``stream:///path`` or REST's ``--uds path``):
  ``path.token``;
- for a TCP endpoint (``http://host:port``, ``tcp://host:port``): ``<runtime dir>/<scheme>-<host>-
  <port>.token`` in the per-user runtime directory (0700); ``localhost`` is spelled 127.0.0.1.

A client given no token looks at the file for its address (`discover_token`): another local user
can neither read the file nor connect to the 0600 sockets, so without the token they get 401 on
every ``/v1`` operation.

The files stay when the service stops, and a service starting on the same endpoint reuses the
token it finds there (`previous_token`), so its clients keep working across restarts; removing
the files before a start rotates it. The file of an endpoint whose port the OS picked (``--port
0``, ``tcp://host:*``) no later start would find again: the service removes it when it stops
(`picked_port_files`, `remove_token_files`), so that such runs leave nothing behind.

Only a private file (a regular file owned by this user, mode 0600, not a link) is ever read, by
the service or a client: a token someone else planted is never adopted.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from kvalloc.server.contract.addresses import runtime_dir
from kvalloc.server.contract.errors import AddressError

SUFFIX = ".token"
# One service, two spellings: a service bound on ``localhost`` listens on 127.0.0.1, and a client
# may name either; both must find the same file. (urlsplit has lower-cased the host already.)
_LOOPBACK_NAMES = {"localhost": "127.0.0.1", "localhost.": "127.0.0.1"}


def token_file(address: str) -> Path:
    """The token file for a client address or a bound endpoint (``ipc://``, ``stream://``,
    ``unix://``, ``http://``, ``tcp://``)."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "unix", "stream"):
        return Path(rest + SUFFIX)
    if scheme in ("http", "tcp"):
        parts = urlsplit(address)
        host = _LOOPBACK_NAMES.get(parts.hostname or "", parts.hostname or "")
        host = host.replace(":", "_")  # IPv6 colons out of the file name
        return runtime_dir() / f"{scheme}-{host}-{parts.port}{SUFFIX}"
    raise AddressError(f"address: {address!r} must start with ipc://, stream://, unix://, "
                       "http:// or tcp://")


def write_token_files(token: str, endpoints: Iterable[str]) -> list[Path]:
    """Write ``token`` 0600 for each endpoint; returns the files (for `remove_token_files`).

    Each file is written under a fresh name and renamed into place: whatever was at the path
    (a stale file, a link someone planted) is replaced, never followed or written through."""
    written = []
    for endpoint in endpoints:
        path = token_file(endpoint)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)
        os.replace(scratch, path)
        written.append(path)
    return written


def picked_port_files(written: Iterable[Path], requested: Iterable[str]) -> list[Path]:
    """Of the token files ``written`` for the bound endpoints, those of no endpoint in
    ``requested`` (as the command line asked for them): their ports were picked at bind time."""
    known = set()
    for address in requested:
        with contextlib.suppress(ValueError):  # "tcp://host:*" names no port: not known
            known.add(token_file(address))
    return [path for path in written if path not in known]


def remove_token_files(paths: Iterable[Path], token: str) -> None:
    """Remove each file that still holds ``token`` (never one another service wrote since)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if path.read_text().strip() == token:
                path.unlink()


def previous_token(addresses: Iterable[str]) -> str | None:
    """The token a previous service left for one of ``addresses``, if any."""
    return next((t for t in map(discover_token, addresses) if t is not None), None)


def discover_token(address: str) -> str | None:
    """The generated token of the service at ``address``, if its file exists and is private."""
    try:
        fd = os.open(token_file(address), os.O_RDONLY | os.O_NOFOLLOW)
    except (OSError, ValueError):
        return None
    try:
        info = os.fstat(fd)
        private = (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
                   and not info.st_mode & 0o077)
        return (os.read(fd, 4096).decode(errors="replace").strip() or None) if private else None
    finally:
        os.close(fd)
