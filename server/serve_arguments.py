"""`kvalloc serve`'s flags, apart from the command so that ``--help`` imports no torch, numba or
FastAPI: the defaults it shows are read from `PoolConfig`, `ServiceConfig` and `RestLimits`,
which import none of them (uvicorn's HTTP protocols are imported: ``--http`` lists the parsers
this install serves). `server.serve` runs the command.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, get_args

from kvalloc.allocator import KVDType, KVLayout, PoolConfig, SlackPolicy, WireShape
from kvalloc.allocator.commands.arguments import argument_type
from kvalloc.server.contract.addresses import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ipc_endpoint,
    port_number,
    server_endpoint,
    socket_file,
)
from kvalloc.server.service.settings import DEFAULT_NUM_BLOCKS, ServiceConfig
from kvalloc.server.transport.network import DEFAULT_LIMITS, http_parsers

if TYPE_CHECKING:  # its module imports torch, which --help must not
    from kvalloc.allocator import LayerGroup

# PoolConfig fields that are flags, with their help. Unset flags keep `default_pool()`'s values.
POOL_FLAGS: dict[str, tuple[type, str]] = {
    "device": (str, "torch device of the pool: cpu, cuda or cuda:N (default: cuda when present, "
                    "else cpu)"),
    "num_blocks": (int, "blocks in the pool"),
    "tokens_per_block": (int, "token slots per block"),
    "num_layers": (int, "model layers whose K/V the pool holds"),
    "num_kv_heads": (int, "KV heads per layer"),
    "head_dim": (int, "elements per head"),
    "kv_layout": (str, "kv: per-head K and V; latent: one MLA latent (DeepSeek-V2/V3) per token "
                       "and layer, no V, with --num-kv-heads 1 and --head-dim its width (e.g. "
                       "512 + 64 = 576)"),
    "dtype": (str, "K/V element type"),
    "max_batch_size": (int, "requests live at once, one block-table row each"),
    "max_seq_len": (int, "longest request: prompt + output tokens"),
    "max_draft_len": (int, "largest draft length D a grant may ask for"),
    "slack_policy": (str, "overlap slack: reclaim is the only correct one; none and unreclaimed "
                          "reproduce the two crashes kvalloc prevents, on purpose"),
    "window": (int, "sliding window in tokens: each request gives back the blocks behind its "
                    "window, for models whose every layer slides that far at most (Mistral); "
                    "not with prefix caching (default: none, full attention)"),
}
_FLAG_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": get_args(KVDType), "kv_layout": get_args(KVLayout),
    "slack_policy": tuple(p.value for p in SlackPolicy)}
_DEFAULT_IN_HELP = ("device", "window")  # their help says their default in words
SERVICE_FLAGS = ("lease_ttl_s", "max_workers", "max_step_tokens", "max_body_bytes", "ipc_spin_s",
                 "verify_interval_s")


# RestLimits fields that are flags: name, type, help.
LIMIT_FLAGS: tuple[tuple[str, type[int] | type[float], str], ...] = (
    ("max_connections", int, "REST connections at once; lowered to fit RLIMIT_NOFILE"),
    ("max_in_flight", int, "REST calls being served at once; more are answered 503 with "
                           "Retry-After"),
    ("header_timeout_s", float, "close a REST connection whose request headers take longer"),
    ("body_timeout_s", float, "answer 408 to a request body that takes longer"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("listen")
    net.add_argument("--host", default=DEFAULT_HOST, help="REST TCP host (default: loopback)")
    net.add_argument("--port", type=argument_type(port_number), default=DEFAULT_PORT,
                     help=f"REST TCP port, 0 for any free one (default {DEFAULT_PORT})")
    net.add_argument("--no-tcp", action="store_true", help="no REST over TCP")
    net.add_argument("--uds", type=argument_type(socket_file), metavar="PATH",
                     help="also serve REST on this Unix socket (created 0600; its directory "
                          "must exist)")
    net.add_argument("--ipc", action="append", type=argument_type(ipc_endpoint),
                     metavar="ENDPOINT",
                     help="IPC endpoint: ZeroMQ's ipc:///path or tcp://127.0.0.1:port, or "
                          "stream:///path (the same messages on a plain Unix socket, the fastest "
                          "local path); repeatable (default: stream://<runtime dir>/kvalloc.stream "
                          "alone)")
    pool = parser.add_argument_group("pool")
    defaults = PoolConfig.model_fields
    for name, (kind, help_text) in POOL_FLAGS.items():
        default = DEFAULT_NUM_BLOCKS if name == "num_blocks" else defaults[name].default
        default = getattr(default, "value", default)  # an enum's flag spelling
        pool.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind,
                          metavar="N" if kind is int else None,
                          choices=_FLAG_CHOICES.get(name),
                          help=help_text if name in _DEFAULT_IN_HELP else f"{help_text} "
                                                                          f"(default {default})")
    shards = parser.add_argument_group("devices")
    shards.add_argument("--devices", metavar="DEVICE[,DEVICE...]",
                        help="one pool shard per device, in shard order, e.g. cuda:0,cuda:1 (a "
                             "device may repeat: cpu,cpu); the first is the pool's device "
                             "(default: --device alone)")
    shards.add_argument("--tensor-parallel", type=_positive(int), default=1, metavar="N",
                        help="shards the pool's KV heads are split into, one per device: "
                             "num_kv_heads / N heads each (default 1)")
    shards.add_argument("--layer-group", dest="layer_groups", action="append",
                        type=argument_type(layer_group), default=[],
                        metavar="NAME:LAYERS:BLOCKS[:WINDOW]",
                        help="a KV cache group (repeatable; their layers partition "
                             "--num-layers): its model layers (e.g. 0-3,8,10-11), the blocks of "
                             "its own pool, and its sliding window in tokens (none: full "
                             "attention); workers must attach (same host). Not with "
                             "--window, --host-tier, --kv-events or --tensor-parallel")
    shards.add_argument("--data-parallel-rank", type=int, metavar="K",
                        help="the data-parallel rank this service allocates for (one service "
                             "per rank): KV events carry it, workers of other ranks are refused")
    svc = parser.add_argument_group("service")
    service = ServiceConfig.model_fields
    for name in SERVICE_FLAGS:
        info = service[name]
        svc.add_argument(f"--{name.replace('_', '-')}", dest=name, type=info.annotation,
                         metavar="N",
                         help=f"{info.description} (default {info.default})")
    limits = parser.add_argument_group("network limits")
    for name, kind, help_text in LIMIT_FLAGS:
        default = getattr(DEFAULT_LIMITS, name)
        limits.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_positive(kind),
                            default=default, help=f"{help_text} (default {default:g})")
    limits.add_argument("--http", choices=http_parsers(), default="auto",
                        help="REST's HTTP parser (default auto: httptools, a C parser, when it "
                             "is installed, else h11)")
    parser.add_argument("--no-nwor", dest="nwor", action="store_false",
                        help="write every staged token, rejected drafts too (as an engine "
                             "without No-Write-On-Reject; default: only accepted ones)")
    parser.add_argument("--insecure-no-token", action="store_true",
                        help="serve without any token, even beyond loopback: anyone who can "
                             "connect controls the service")
    _add_cache_arguments(parser.add_argument_group("prefix caching"))
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"], help="log verbosity")


def _add_cache_arguments(cache: argparse._ArgumentGroup) -> None:
    cache.add_argument("--prefix-caching", action="store_true",
                       help="share the cached full blocks of prompts sent with token ids")
    cache.add_argument("--host-tier", dest="host_tier_bytes", type=argument_type(byte_size),
                       default=0, metavar="SIZE",
                       help="a host tier of SIZE bytes (e.g. 64GiB) below the pool: every cached "
                            "block is copied there as it registers and prompts whose prefix the "
                            "pool evicted are served from it; turns prefix caching on")
    cache.add_argument("--host-tier-onboard", dest="host_tier_onboard_bytes",
                       type=argument_type(byte_size), default=256 << 20, metavar="SIZE",
                       help="the most bytes one step copies back from the host tier (default "
                            "256MiB; 0: no bound): a longer prefix comes back over several "
                            "steps, its prompt refused as onboarding until it is all there")
    cache.add_argument("--kv-events", type=argument_type(server_endpoint), metavar="ENDPOINT",
                       help="publish KV events (vLLM's KVEventBatch) on this ZeroMQ PUB endpoint; "
                            "'ipc:///DIR/events-{worker}': one stream per worker; turns prefix "
                            "caching on")
    cache.add_argument("--kv-events-replay", type=argument_type(server_endpoint),
                       metavar="ENDPOINT", help="serve KV event replays on this ZeroMQ endpoint")
    cache.add_argument("--kv-events-shape", choices=[s.value for s in WireShape],
                       default=WireShape.MAPS.value,
                       help="maps: vLLM after 0.23 (default); arrays: vLLM 0.23 and earlier")
    cache.add_argument("--kv-events-group", metavar="GROUP",
                       help="event socket files 0660 owned by GROUP (default 0600: this user)")
    cache.add_argument("--kv-events-plaintext", action="store_true",
                       help="serve TCP event streams without KVALLOC_EVENTS_SECRET: whoever "
                            "reaches them reads every prompt's token ids")
    cache.add_argument("--cache-group", action="append", type=_cache_group, default=[],
                       metavar="NAME=ID[,ID...]",
                       help="these workers share one prefix-cache namespace (repeatable); every "
                            "other worker's cached blocks are its own")


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a number of ``kind`` above zero (argparse names the flag on error)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return value
    parse.__name__ = kind.__name__
    return parse


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def byte_size(text: str) -> int:
    """``64GiB``, ``512M``, ``1048576``: a number of bytes in binary units (``B`` or ``iB``
    after the letter optional, its case too)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size in bytes (e.g. 64GiB, 512MiB, 1048576)")
    return int(float(match[1]) * _UNITS[match[2].lower()])


def layer_group(text: str) -> Any:
    """``NAME:LAYERS:BLOCKS[:WINDOW]`` as a `LayerGroup` (LAYERS: ``0-3,8,10-11``, in the order
    the group's pool holds them); a ValueError saying what is wrong."""
    # Imported here: the group's module imports torch, which --help must not.
    from kvalloc.allocator import LayerGroup
    from kvalloc.allocator.commands.config_errors import reason
    from pydantic import ValidationError

    parts = text.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"{text!r} is not NAME:LAYERS:BLOCKS[:WINDOW] (e.g. full:0-3:4096 or "
                         f"sliding:4-7:512:1024)")
    name, layers, blocks, *window = parts
    try:
        return LayerGroup(name=name, layers=_layer_list(layers), num_blocks=_integer(blocks),
                          window=_integer(window[0]) if window else None)
    except ValidationError as exc:
        why = "; ".join(f"{error['loc'][-1]}: {reason(error)}" for error in exc.errors())
    except ValueError as exc:  # the layers or a number
        why = str(exc)
    raise ValueError(f"{text!r}: {why}")


def layer_group_flag(group: LayerGroup) -> str:
    """A `LayerGroup` as the ``--layer-group`` flag `layer_group` parses back to it."""
    window = "" if group.window is None else f":{group.window}"
    return f"--layer-group {group.name}:{layer_spans(group.layers)}:{group.num_blocks}{window}"


def layer_spans(layers: Sequence[int]) -> str:
    """(0, 1, 2, 3, 8) -> 0-3,8: layers as ``--layer-group`` takes them."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _layer_list(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11]."""
    layers: list[int] = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        start = _integer(first)
        stop = _integer(last) if dash else start
        if stop < start:
            raise ValueError(f"layers: {part!r} runs backwards")
        layers += range(start, stop + 1)
    return layers


def _integer(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a whole number")
    return int(text)


def _cache_group(text: str) -> tuple[str, list[str]]:
    """An argparse type: ``NAME=ID,ID`` (argparse names the flag on error)."""
    name, _, ids = text.partition("=")
    workers = [w.strip() for w in ids.split(",") if w.strip()]
    if not name.strip() or not workers:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=ID[,ID...]")
    return name.strip(), workers
