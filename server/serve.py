"""`kvalloc serve`: one pool, REST and IPC transports over one service core, until stopped.

With no arguments: the embedded default pool (`server.service.settings.default_pool`, CUDA when
present, else CPU), REST on http://127.0.0.1:8900, IPC on stream://<runtime dir>/kvalloc.stream
(ZeroMQ only when asked for: `server.contract.addresses.default_ipc_endpoints` says why). It
logs where it listens. SIGTERM / SIGINT stop it gracefully: REST finishes the calls in flight,
the IPC thread finishes its message, then every socket file and shared-memory segment is
removed.
Secure by default: ``KVALLOC_TOKEN`` (environment only) makes both transports require that
bearer token; without it the service generates one for its lifetime and writes it 0600 where its
own user's clients find it (`server.transport.token_files`), so no other local user can call
``/v1``. Listening beyond loopback without ``KVALLOC_TOKEN`` is refused unless
``--insecure-no-token``. KV events admit holders of that token alone (CURVE keys derived from
it), and the block hashes are keyed with ``KVALLOC_HASH_SEED``, else with the token.

At start it raises RLIMIT_NOFILE to the hard limit, bounds REST connections so a descriptor
reserve stays free (`server.transport.network`), and removes the shared memory of dead instances.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
import uvicorn
from kvalloc.allocator import InvalidValue, SlackPolicy, group_pools
from kvalloc.allocator.commands.config_errors import flag_errors
from kvalloc.server.contract.addresses import (
    claim_socket_path,
    default_ipc_endpoints,
    ipc_path,
    require_directory,
)
from kvalloc.server.contract.errors import (
    AddressError,
    InsecureBinding,
    InsufficientMemory,
    LimitsError,
    PoolTooLarge,
    ShardingInvalid,
)
from kvalloc.server.contract.sharing import SHM_DIR, SHM_DIR_ENV, reap_dead_instances
from kvalloc.server.serve_arguments import (
    LIMIT_FLAGS,
    POOL_FLAGS,
    SERVICE_FLAGS,
    layer_spans,
)
from kvalloc.server.serve_arguments import add_arguments as add_arguments  # a command's two names
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.footprint import Footprint, check_fits, describe_bytes
from kvalloc.server.service.ranks import RankedService, rank_configs
from kvalloc.server.service.settings import (
    EVENTS_SECRET_ENV,
    HASH_SEED_ENV,
    ServiceConfig,
    default_pool,
    secret_from_env,
    token_from_env,
)
from kvalloc.server.service.shards import check_devices, same_device
from kvalloc.server.service.warmup import warm_up
from kvalloc.server.transport.ipc import IpcServer
from kvalloc.server.transport.network import (
    ACCEPT_BACKLOG,
    RestLimits,
    bounded_protocol,
    connection_budget,
    raise_nofile_limit,
)
from kvalloc.server.transport.rest import create_app
from kvalloc.server.transport.token_files import (
    picked_port_files,
    previous_token,
    remove_token_files,
    write_token_files,
)
from pydantic import SecretStr, ValidationError

log = logging.getLogger("kvalloc.serve")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _config(args)
        _check_event_access(config)
        _check_socket_directories(args)
    except ValidationError as exc:
        print(f"kvalloc serve: error: {flag_errors(exc)}", file=sys.stderr)
        return 2
    except (AddressError, ShardingInvalid) as exc:
        print(f"kvalloc serve: error: {exc}", file=sys.stderr)
        return 2
    except InvalidValue as exc:  # groups that do not partition the layers (`group_pools`)
        print(f"kvalloc serve: error: --layer-group: {exc}", file=sys.stderr)
        return 2
    problem = _shm_dir_problem()
    if problem is not None:
        print(f"kvalloc serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        token = _token(args, config.token)
        limits = _limits(args)
    except (InsecureBinding, LimitsError) as exc:
        log.error("%s", exc)
        return 2
    reaped = reap_dead_instances()
    if reaped:
        log.info("removed %d shared-memory segments of dead instances", reaped)
    try:  # after reaping, which frees memory; before anything of the pool is made
        need = check_fits(config)
    except PoolTooLarge as exc:
        log.error("%s", exc)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        core = _start(config)
        ipc = IpcServer(core, args.ipc or default_ipc_endpoints(), token=token)
        reaper = LeaseReaper(core)
    except _Stopped as stop:
        # Whatever the start had made goes with it: the warm-up's core closes on its way out,
        # and every exporter's finalizer unlinks its segments as the process exits.
        _ignore_stops()
        log.info("stopping on %s before serving", stop)
        return 0
    except (InsufficientMemory, AddressError) as exc:  # memory taken since the check, an
        log.error("%s", exc)                            # event endpoint in use
        return 2
    sockets: list[socket.socket] = []
    picked: list[Path] = []  # token files of ports the OS picked: removed at the stop
    status = 0
    try:
        sockets = _rest_sockets(args)
        rest = [_describe(s) for s in sockets]
        app = create_app(core, token=token, metrics=_metrics(core), limits=limits)
        endpoints = ipc.start()
        if token is not None and config.token is None:  # generated: for our own user's clients
            written = write_token_files(token.get_secret_value(), [*rest, *endpoints])
            picked = picked_port_files(written, _addresses(args))
        reaper.start()
        _log_start(config, core, rest, endpoints, need, token)
        server = uvicorn.Server(uvicorn.Config(
            app, log_level=args.log_level, access_log=False, lifespan="off",
            timeout_graceful_shutdown=5, http=bounded_protocol(limits, args.http),
            timeout_keep_alive=int(limits.keep_alive_s), backlog=ACCEPT_BACKLOG))
        server.run(sockets=sockets)  # returns after a graceful stop on SIGTERM / SIGINT
    except _Stopped as stop:
        log.info("stopping on %s", stop)
    except OSError as exc:  # an address in use, a path we may not create
        log.error("cannot listen: %s", exc)
        status = 1
    finally:
        _shut_down(args, ipc, reaper, core, sockets)
        if picked and token is not None:
            remove_token_files(picked, token.get_secret_value())
    return status


def _log_start(config: ServiceConfig, core: ServiceCore, rest: list[str], endpoints: list[str],
               need: Footprint, token: SecretStr | None) -> None:
    pool = config.pool
    log.info("kvalloc serving REST on %s, IPC on %s (epoch %d; %s pool: %d blocks x %d "
             "tokens, %s, %s, %s, staging up to %s%s; lease %.0fs%s)",
             ", ".join(rest) or "-", ", ".join(endpoints), core.epoch, _where(config),
             pool.total_blocks, pool.tokens_per_block, pool.dtype, _layout_note(config),
             describe_bytes(need.pool),
             describe_bytes(need.staging), _tier_note(config), config.lease_ttl_s,
             _token_note(config.token, token))


def _layout_note(config: ServiceConfig) -> str:
    pool = config.pool
    window = ("" if pool.window is None else
              f", window {pool.window}, at most {pool.max_live_blocks_per_seq} blocks a request")
    if config.groups:
        window += ", groups " + ", ".join(
            f"{g.name} (layers {layer_spans(g.layers)}, {g.num_blocks} blocks"
            f"{'' if g.window is None else f', window {g.window}'})" for g in config.groups)
    if pool.kv_layout == "latent":
        return f"{pool.num_layers} layers x a latent of {pool.head_dim} (latent layout{window})"
    return (f"{pool.num_layers} layers x {pool.num_kv_heads} KV heads x {pool.head_dim} "
            f"(kv layout{window})")


def _tier_note(config: ServiceConfig) -> str:
    if not config.host_tier_blocks:
        return ""
    return (f"; host tier {describe_bytes(config.host_tier_blocks * config.pool.bytes_per_block)}"
            f" ({config.host_tier_blocks} blocks)")


def _where(config: ServiceConfig) -> str:
    """The pool's device, or its shards' devices and degree."""
    rank = ("" if config.data_parallel_rank is None
            else f" data-parallel rank {config.data_parallel_rank}")
    ranks = len(config.devices) // config.tensor_parallel
    if ranks > 1:
        rank = f", {ranks} data-parallel ranks"
    if config.tensor_parallel == 1 and ranks <= 1:
        return config.pool.device + rank
    return f"{','.join(config.devices)} tensor-parallel {config.tensor_parallel}{rank}"


def _shut_down(args: argparse.Namespace, ipc: IpcServer, reaper: LeaseReaper, core: ServiceCore,
               sockets: list[socket.socket]) -> None:
    _ignore_stops()
    ipc.stop()
    reaper.stop()
    core.close()
    for sock in sockets:
        sock.close()  # uvicorn may have closed them already; closing twice is harmless
    if args.uds and any(s.family == socket.AF_UNIX for s in sockets):
        Path(args.uds).unlink(missing_ok=True)
    log.info("stopped; shared memory and socket files removed")


def _start(config: ServiceConfig) -> ServiceCore | RankedService:
    """Everything before the service listens: the torch settings, the warm-up and the core."""
    # The per-step host work is small tensors: OpenMP fan-out only adds scheduling latency (ms
    # on a busy host), never speed.
    torch.set_num_threads(1)
    device = torch.device(config.pool.device)
    if device.type == "cuda":
        # "cuda" alone names the current device; set_device needs an index.
        torch.cuda.set_device(device.index if device.index is not None
                              else torch.cuda.current_device())
    _warm_up(config)
    return ServiceCore(config) if len(rank_configs(config)) == 1 else RankedService(config)


def _ignore_stops() -> None:
    """A second signal must not cut the cleanup short."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _warm_up(config: ServiceConfig) -> None:
    """Compile the step now rather than under the lock of the first worker's calls
    (`server.service.warmup`). A failure costs only that: the first calls compile instead."""
    # Said first: on a fresh install the compile is the silent minute of a first start.
    log.info("compiling the step and its commit (seconds from numba's cache, up to a minute "
             "without it)")
    try:
        # Compiled code is per process: one rank's shape compiles what every rank runs.
        log.info("compiled the step and its commit in %.1fs", warm_up(rank_configs(config)[0]))
    except Exception:
        log.exception("warming up failed: the first calls will compile what they need")


class _Stopped(BaseException):
    """SIGTERM / SIGINT outside uvicorn's own handling (during the start, or re-raised by it
    once it has shut down gracefully). A BaseException, as KeyboardInterrupt is, so that no
    ``except Exception`` on its way (the warm-up's) takes a stop for a failure."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _config(args: argparse.Namespace) -> ServiceConfig:
    pool = {k: getattr(args, k) for k in POOL_FLAGS if getattr(args, k) is not None}
    service = {k: getattr(args, k) for k in SERVICE_FLAGS if getattr(args, k) is not None}
    devices = _devices(args)
    if devices:
        pool["device"] = devices[0]
    if args.layer_groups:  # refused naming the flag, not the configuration
        group_pools(default_pool(**pool), args.layer_groups)
    if pool.get("slack_policy", SlackPolicy.RECLAIM) != SlackPolicy.RECLAIM:
        log.warning("--slack-policy %s: overlap workers will crash or overflow their rows on "
                    "purpose (a reproduction, never for serving)", pool["slack_policy"])
    return ServiceConfig(pool=default_pool(**pool), token=token_from_env(), nwor=args.nwor,
                         prefix_caching=(args.prefix_caching or args.kv_events is not None
                                         or args.host_tier_bytes > 0),
                         host_tier_bytes=args.host_tier_bytes,
                         host_tier_onboard_bytes=args.host_tier_onboard_bytes,
                         kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
                         kv_events_shape=args.kv_events_shape,
                         kv_events_secret=secret_from_env(EVENTS_SECRET_ENV),
                         kv_events_plaintext=args.kv_events_plaintext,
                         kv_events_group=args.kv_events_group,
                         hash_seed=secret_from_env(HASH_SEED_ENV),
                         cache_groups=_groups(args.cache_group),
                         devices=devices, tensor_parallel=args.tensor_parallel,
                         groups=args.layer_groups,
                         data_parallel_rank=args.data_parallel_rank, **service)


def _devices(args: argparse.Namespace) -> list[str]:
    """``--devices`` as a list, each a device of this host (`ShardingInvalid` otherwise)."""
    if not args.devices:
        return []
    devices = [d.strip() for d in args.devices.split(",")]
    check_devices(devices)
    if args.device is not None and not same_device(args.device, devices[0]):
        raise ShardingInvalid(f"devices: --device {args.device} is not the first of --devices "
                              f"{args.devices}")
    return devices


def _groups(groups: list[tuple[str, list[str]]]) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for name, ids in groups:
        merged.setdefault(name, []).extend(ids)
    return merged


def _shm_dir_problem() -> str | None:
    """Why the directory of the shared-memory segments cannot hold them (None: it can)."""
    if not SHM_DIR.is_absolute():
        # The service and its workers resolve it from their own working directories.
        return (f"{SHM_DIR_ENV}: {str(SHM_DIR)!r} is not an absolute path; workers must find "
                f"the same directory")
    if not SHM_DIR.is_dir():
        return f"{SHM_DIR_ENV}: {SHM_DIR} is not a directory"
    return None


def _check_socket_directories(args: argparse.Namespace) -> None:
    """Every socket file's directory exists, before anything is bound (the default IPC sockets'
    directory is created by `default_ipc_endpoints`)."""
    for flag, path in [("--uds", args.uds), *(("--ipc", ipc_path(e)) for e in args.ipc or [])]:
        if path is not None:
            try:
                require_directory(Path(path))
            except AddressError as exc:
                raise AddressError(f"argument {flag}: {exc}") from None


def _token(args: argparse.Namespace, configured: SecretStr | None) -> SecretStr | None:
    """The token both transports require: ``KVALLOC_TOKEN``, else a fresh random one, else none
    (``--insecure-no-token``: logged loudly)."""
    if configured is not None:
        return configured
    if args.insecure_no_token:
        log.warning("INSECURE: --insecure-no-token: no token at all; anyone who can connect to "
                    "%s can read the pool, deregister workers and take every worker slot",
                    ", ".join(_exposed(args)) or "the local endpoints")
        return None
    exposed = _exposed(args)
    if exposed:
        raise InsecureBinding(
            f"listen: {', '.join(exposed)} is reachable beyond this host and KVALLOC_TOKEN is "
            f"not set; set KVALLOC_TOKEN (or pass --insecure-no-token to serve it open)")
    return SecretStr(previous_token(_addresses(args)) or secrets.token_urlsafe(32))


def _addresses(args: argparse.Namespace) -> list[str]:
    """The endpoints this service will listen on that are known before binding (port 0 is not)."""
    tcp = [] if args.no_tcp or args.port == 0 else [f"http://{args.host}:{args.port}"]
    uds = [f"unix://{args.uds}"] if args.uds else []
    return [*uds, *(args.ipc or default_ipc_endpoints()), *tcp]


def _check_event_access(config: ServiceConfig) -> None:
    """Every rank's event endpoints can be protected (`EventAccess.check`); plain TCP streams
    are logged loudly."""
    access = config.event_access
    for rank in rank_configs(config):
        for flag, endpoint in [("--kv-events", rank.kv_events),
                               ("--kv-events-replay", rank.kv_events_replay)]:
            if endpoint is not None:
                access.check(endpoint, flag)
                path = ipc_path(endpoint)
                if path is not None:
                    require_directory(path)
                if endpoint.startswith("tcp://") and access.secret is None:
                    log.warning("INSECURE: --kv-events-plaintext: anyone who reaches %s reads "
                                "the token ids of every cached prompt; keep it behind a network "
                                "policy that admits the routers alone", endpoint)


def _token_note(configured: SecretStr | None, token: SecretStr | None) -> str:
    if token is None:
        return "; NO TOKEN (insecure)"
    return ("; bearer token required" if configured is not None
            else "; generated token required (written 0600 beside each endpoint)")


def _exposed(args: argparse.Namespace) -> list[str]:
    """The TCP endpoints that listen beyond loopback."""
    hosts = [] if args.no_tcp else [(f"http://{args.host}:{args.port}", args.host)]
    for address in args.ipc or []:
        if address is not None and address.startswith("tcp://"):
            hosts.append((address, address.removeprefix("tcp://").rpartition(":")[0]))
    return [address for address, host in hosts if not _is_loopback(host)]


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", "0.0.0.0" parse; a name or an interface may be anything
        return False


def _limits(args: argparse.Namespace) -> RestLimits:
    flags = {name: getattr(args, name) for name, _, _ in LIMIT_FLAGS}
    nofile = raise_nofile_limit()
    return RestLimits(**{**flags, "max_connections": connection_budget(flags["max_connections"],
                                                                       nofile)})


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
    sock.listen(ACCEPT_BACKLOG)
    return sock


def _describe(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix://{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


def _metrics(core: ServiceCore | RankedService) -> Callable[[], tuple[bytes, str]] | None:
    """The Prometheus exposition of `allocator.metrics` and `server.service.metrics`, when
    prometheus_client exists."""
    try:
        from kvalloc.allocator import AllocatorMetrics
        from kvalloc.server.service.metrics import ServiceMetrics, rank_metrics
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    except ImportError as exc:
        log.warning("no /metrics: %s", exc)
        return None
    registry = CollectorRegistry()
    if isinstance(core, RankedService):
        rank_metrics(core, registry)
        return lambda: (generate_latest(registry), CONTENT_TYPE_LATEST)
    # Scrapes read what the core publishes under its lock: they never take it themselves.
    stores = core.pool.tier_stores  # every shard copies the same blocks: the first tells
    metrics = ServiceMetrics(registry, AllocatorMetrics(
        registry, core.manager, core.pool.committer.writes,
        tier_copies=stores[0] if stores else None))
    with core.lock:
        core.add_observer(metrics)
        metrics.state_changed()
    return lambda: (generate_latest(registry), CONTENT_TYPE_LATEST)


class LeaseReaper:
    """Expires silent workers' leases even when no call arrives to notice them, and puts back
    shared state another process changed (`ServiceCore.repair_shared_state`) every
    ``verify_interval_s``, whether or not anyone asks for a verify."""

    def __init__(self, core: ServiceCore | RankedService) -> None:
        self.core = core
        self.interval = min(1.0, core.config.lease_ttl_s / 4)
        self.verify_interval = core.config.verify_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvalloc-leases", daemon=True)

    def start(self) -> None:
        # It looks every interval: a gap of two means the whole service was paused.
        self.core.watch_pauses(2 * self.interval)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        # Leases are looked at no less often than before: the pause watch counts on it.
        tick = min(self.interval, self.verify_interval)
        verify_at = time.monotonic() + self.verify_interval
        while not self._stop.wait(tick):
            self.core.expire_leases()
            if time.monotonic() >= verify_at:
                try:
                    self.core.repair_shared_state()
                except Exception:  # a failed check must not end lease expiry with the thread
                    log.exception("checking the shared state failed; leases still expire")
                verify_at = time.monotonic() + self.verify_interval
