"""`kvalloc serve`: one pool, REST and IPC transports over one service core, until stopped.

With no arguments: the embedded default pool (`server.settings.default_pool`, CUDA when present,
else CPU), REST on http://127.0.0.1:8900, IPC on ipc://<runtime dir>/kvalloc.ipc. It logs where it
listens. SIGTERM / SIGINT stop it gracefully: REST finishes the calls in flight, the IPC thread
finishes its message, then every socket file and shared-memory segment is removed.
``KVALLOC_TOKEN`` (environment only) makes both transports require that bearer token.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, get_args

import torch
import uvicorn
from pydantic import ValidationError

from allocator import PoolConfig
from allocator.arguments import argument_type
from allocator.config import KVDType

from .addresses import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    AddressError,
    claim_socket_path,
    default_ipc,
    ipc_path,
    port_number,
    require_directory,
    server_endpoint,
    socket_file,
)
from .cli import flag_errors
from .core import ServiceCore
from .ipc import IpcServer
from .rest import create_app
from .settings import DEFAULT_NUM_BLOCKS, ServiceConfig, default_pool, token_from_env

log = logging.getLogger("kvalloc.serve")

# PoolConfig fields that are flags, with their help. Unset flags keep `default_pool()`'s values.
_POOL_FLAGS: dict[str, tuple[type, str]] = {
    "device": (str, "torch device of the pool: cpu, cuda or cuda:N (default: cuda when present, "
                    "else cpu)"),
    "num_blocks": (int, "blocks in the pool"),
    "tokens_per_block": (int, "token slots per block"),
    "num_layers": (int, "model layers whose K/V the pool holds"),
    "num_kv_heads": (int, "KV heads per layer"),
    "head_dim": (int, "elements per head"),
    "dtype": (str, "K/V element type"),
    "max_batch_size": (int, "requests live at once, one block-table row each"),
    "max_seq_len": (int, "longest request: prompt + output tokens"),
    "max_draft_len": (int, "largest draft length D a grant may ask for"),
}
_SERVICE_FLAGS = ("lease_ttl_s", "max_workers", "max_step_tokens", "max_body_bytes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("listen")
    net.add_argument("--host", default=DEFAULT_HOST, help="REST TCP host (default: loopback)")
    net.add_argument("--port", type=argument_type(port_number), default=DEFAULT_PORT,
                     help=f"REST TCP port, 0 for any free one (default {DEFAULT_PORT})")
    net.add_argument("--no-tcp", action="store_true", help="no REST over TCP")
    net.add_argument("--uds", type=argument_type(socket_file), metavar="PATH",
                     help="also serve REST on this Unix socket (created 0600; its directory "
                          "must exist)")
    net.add_argument("--ipc", action="append", type=argument_type(server_endpoint),
                     metavar="ENDPOINT",
                     help="ZeroMQ endpoint, ipc:///path or tcp://127.0.0.1:port; repeatable "
                          "(default: ipc://<runtime dir>/kvalloc.ipc)")
    pool = parser.add_argument_group("pool")
    defaults = PoolConfig.model_fields
    for name, (kind, help_text) in _POOL_FLAGS.items():
        default = DEFAULT_NUM_BLOCKS if name == "num_blocks" else defaults[name].default
        pool.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind,
                          metavar="N" if kind is int else None,
                          choices=get_args(KVDType) if name == "dtype" else None,
                          help=help_text if name == "device" else f"{help_text} "
                                                                  f"(default {default})")
    svc = parser.add_argument_group("service")
    service = ServiceConfig.model_fields
    for name in _SERVICE_FLAGS:
        info = service[name]
        svc.add_argument(f"--{name.replace('_', '-')}", dest=name, type=info.annotation,
                         metavar="N",
                         help=f"{info.description} (default {info.default})")
    cache = parser.add_argument_group("prefix caching")
    cache.add_argument("--prefix-caching", action="store_true",
                       help="share the cached full blocks of prompts sent with token ids")
    cache.add_argument("--kv-events", type=argument_type(server_endpoint), metavar="ENDPOINT",
                       help="publish KV events (vLLM's KVEventBatch) on this ZeroMQ PUB endpoint; "
                            "turns prefix caching on")
    cache.add_argument("--kv-events-replay", type=argument_type(server_endpoint),
                       metavar="ENDPOINT", help="serve KV event replays on this ZeroMQ endpoint")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"], help="log verbosity")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _config(args)
        _check_socket_directories(args)
    except ValidationError as exc:
        print(f"kvalloc serve: error: {flag_errors(exc)}", file=sys.stderr)
        return 2
    except AddressError as exc:
        print(f"kvalloc serve: error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # The per-step host work is small tensors: OpenMP fan-out only adds scheduling latency (ms
    # on a busy host), never speed.
    torch.set_num_threads(1)
    device = torch.device(config.pool.device)
    if device.type == "cuda":
        # "cuda" alone names the current device; set_device needs an index.
        torch.cuda.set_device(device.index if device.index is not None
                              else torch.cuda.current_device())
    core = ServiceCore(config)
    ipc = IpcServer(core, args.ipc or [default_ipc()], token=config.token)
    reaper = LeaseReaper(core)
    sockets: list[socket.socket] = []
    status = 0
    try:
        sockets = _rest_sockets(args)
        rest = [_describe(s) for s in sockets]
        app = create_app(core, token=config.token, metrics=_metrics(core))
        endpoints = ipc.start()
        reaper.start()
        pool = config.pool
        log.info("kvalloc serving REST on %s, IPC on %s (epoch %d; %s pool: %d blocks x %d "
                 "tokens, %s, %d layers x %d KV heads x %d; lease %.0fs%s)",
                 ", ".join(rest) or "-", ", ".join(endpoints), core.epoch, pool.device,
                 pool.total_blocks, pool.tokens_per_block, pool.dtype, pool.num_layers,
                 pool.num_kv_heads, pool.head_dim, config.lease_ttl_s,
                 "; bearer token required" if config.token else "")
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                               lifespan="off", timeout_graceful_shutdown=5))
        server.run(sockets=sockets)  # returns after a graceful stop on SIGTERM / SIGINT
    except _Stopped as stop:
        log.info("stopping on %s", stop)
    except OSError as exc:  # an address in use, a path we may not create
        log.error("cannot listen: %s", exc)
        status = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        ipc.stop()
        reaper.stop()
        core.close()
        for sock in sockets:
            sock.close()  # uvicorn may have closed them already; closing twice is harmless
        if args.uds and any(s.family == socket.AF_UNIX for s in sockets):
            Path(args.uds).unlink(missing_ok=True)
        log.info("stopped; shared memory and socket files removed")
    return status


class _Stopped(Exception):
    """SIGTERM / SIGINT outside uvicorn's own handling (before it serves, or re-raised by it
    once it has shut down gracefully)."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _config(args: argparse.Namespace) -> ServiceConfig:
    pool = {k: getattr(args, k) for k in _POOL_FLAGS if getattr(args, k) is not None}
    service = {k: getattr(args, k) for k in _SERVICE_FLAGS if getattr(args, k) is not None}
    return ServiceConfig(pool=default_pool(**pool), token=token_from_env(),
                         prefix_caching=args.prefix_caching or args.kv_events is not None,
                         kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
                         **service)


def _check_socket_directories(args: argparse.Namespace) -> None:
    """Every socket file's directory exists, before anything is bound (the default IPC socket's
    directory is created by `default_ipc`)."""
    for flag, path in [("--uds", args.uds), *(("--ipc", ipc_path(e)) for e in args.ipc or [])]:
        if path is not None:
            try:
                require_directory(Path(path))
            except AddressError as exc:
                raise AddressError(f"argument {flag}: {exc}") from None


def _rest_sockets(args: argparse.Namespace) -> list[socket.socket]:
    sockets = []
    if not args.no_tcp:
        tcp = socket.create_server((args.host, args.port))
        # Accepted sockets inherit this. asyncio would set it itself, but only on sockets made
        # with proto=IPPROTO_TCP; without it every reply waits ~40 ms for a delayed ACK.
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sockets.append(tcp)
    if args.uds:
        sockets.append(_unix_socket(Path(args.uds)))
    for sock in sockets:
        sock.setblocking(False)
    return sockets


def _unix_socket(path: Path) -> socket.socket:
    """Bind ``path`` 0600 (see `claim_socket_path` for an existing file)."""
    claim_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(1024)
    return sock


def _describe(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix://{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


def _metrics(core: ServiceCore) -> Callable[[], tuple[bytes, str]] | None:
    """The Prometheus exposition of `allocator.metrics`, when it and prometheus_client exist."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        from allocator.metrics import AllocatorMetrics
    except ImportError as exc:
        log.warning("no /metrics: %s", exc)
        return None
    registry = CollectorRegistry()
    metrics: Any = AllocatorMetrics(registry, core.manager, core.committer.writes, lock=core.lock)
    core.add_observer(metrics)
    return lambda: (generate_latest(registry), CONTENT_TYPE_LATEST)


class LeaseReaper:
    """Expires silent workers' leases even when no call arrives to notice them."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        self.interval = min(1.0, core.config.lease_ttl_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvalloc-leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.core.expire_leases()
