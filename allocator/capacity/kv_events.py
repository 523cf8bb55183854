"""KV-cache events in the wire shapes vLLM publishes, so KV-aware routers read them unchanged.

Each message is a msgpack ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]`` (an array,
as in every vLLM release). The events come in one of two shapes (`WireShape`):

- ``maps`` (the default; vLLM releases after 0.23): each event a map tagged ``"type"``, with
  every field today's decoder requires: ``{"type": "BlockStored", "block_hashes", ...,
  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}``;
- ``arrays`` (vLLM 0.23 and earlier): each event an array whose first item is its class name:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.

Block hashes go out as unsigned 64-bit integers, the form vLLM sends when asked for integers:
each block's `router_hashes`, a chain any router can compute from the token ids it reads, never
the keyed hashes the cache looks blocks up by. Their `HashScope` says whether the namespace is in
the chain: not for streams that each carry one engine's blocks (equal content hashes alike on
every engine, as routers that index several engines require), yes for one stream carrying
several namespaces (a block of each stays its own). ``extra_keys`` carries, for each block, its
namespace's digest (`namespace_digest`) where vLLM puts a request's ``cache_salt``; ``medium`` the
tier the block is in (`MEDIUM_POOL`).

Inside the service an event travels with the namespace it belongs to (`NamespacedEvent`), so each
engine's stream carries exactly the blocks that engine can hit.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

# The tier a block is in, in vLLM's words: "GPU" is an engine's own KV cache (vLLM says so on
# every platform, its CPU backend included), "CPU" a host tier blocks are offloaded to. Routers
# score the first alone as the engine's cache (Dynamo's indexer puts "CPU" blocks in a lower tier
# that its scores leave out), so the pool's blocks are "GPU" on any device.
MEDIUM_POOL = "GPU"
MEDIUM_TIER = "CPU"  # the service's host tier (`capacity.host_tier`)
# vLLM's name for a group of layers that all attend over the whole sequence.
FULL_ATTENTION = "full_attention"
# kvalloc keeps one group of layers (vLLM's KV cache group 0).
GROUP_INDEX = 0


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (the tag, under ``"type"``, is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: the tuple its hash covers beyond the tokens (here its namespace).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


def block_stored(routes: list[int], parent: int | None, tokens: ArrayLike, tokens_per_block: int,
                 namespace: bytes, medium: str) -> BlockStored:
    """The `BlockStored` of a run of blocks chained on ``parent`` (None: on the root), in one
    namespace and one medium. ``tokens`` may stay an array: the sender's thread makes it a list
    as it encodes."""
    digest = (namespace_digest(namespace),)
    return BlockStored(routes, parent, tokens, tokens_per_block, None, medium,  # type: ignore[arg-type]
                       None, [digest] * len(routes), GROUP_INDEX, FULL_ATTENTION)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """The shape of vLLM 0.23 and earlier: positional, the class name first."""


def _positional(event: type[KVCacheEvent], fields: int) -> type[_ArrayEvent]:
    """``event`` as vLLM 0.23 sent it: its first ``fields`` fields, in order."""
    names = list(event.__struct_fields__[:fields])
    return msgspec.defstruct(event.__name__, [(n, event.__annotations__[n]) for n in names],
                             bases=(_ArrayEvent,), tag=event.__name__)


# Everything before lora_name (BlockStored) or group_idx (BlockRemoved) is what 0.23 sent.
_ArrayBlockStored = _positional(BlockStored, 6)
_ArrayBlockRemoved = _positional(BlockRemoved, 2)
_ArrayAllBlocksCleared = _positional(AllBlocksCleared, 0)


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class WireShape(str, Enum):
    MAPS = "maps"
    ARRAYS = "arrays"


def _as_array(event: KVCacheEvent) -> _ArrayEvent:
    if isinstance(event, BlockStored):
        return _ArrayBlockStored(event.block_hashes, event.parent_block_hash, event.token_ids,
                                 event.block_size, event.lora_id, event.medium)
    if isinstance(event, BlockRemoved):
        return _ArrayBlockRemoved(event.block_hashes, event.medium)
    return _ArrayAllBlocksCleared()


def _plain(value: Any) -> Any:
    """A numpy array of token ids goes out as a list."""
    tolist = getattr(value, "tolist", None)
    if tolist is None:
        raise NotImplementedError(f"cannot encode {type(value).__name__}")
    return tolist()


def event_encoder() -> msgspec.msgpack.Encoder:
    """The encoder of `encode_batch`: events may hold their token ids as arrays."""
    return msgspec.msgpack.Encoder(enc_hook=_plain)


def encode_batch(encoder: msgspec.msgpack.Encoder, ts: float, events: list[KVCacheEvent],
                 rank: int | None, shape: WireShape = WireShape.MAPS) -> bytes:
    """One batch's msgpack payload in ``shape`` (``encoder``: an `event_encoder`)."""
    if shape is WireShape.ARRAYS:
        return encoder.encode(_ArrayBatch(ts, [_as_array(e) for e in events], rank))
    return encoder.encode(KVEventBatch(ts, events, rank))


class NamespacedEvent(NamedTuple):
    """An event and the namespace (prefix-cache salt) of its blocks; ``None``: every namespace
    (`AllBlocksCleared`)."""

    namespace: bytes | None
    event: KVCacheEvent


class HashScope(str, Enum):
    CONTENT = "content"  # token ids (and the cache key) alone
    NAMESPACE = "namespace"  # the namespace too


def router_hashes(tokens: ArrayLike, tokens_per_block: int, cache_key: bytes = b"",
                  namespace: bytes = b"") -> list[int]:
    """The published hashes of the full blocks of ``tokens`` (a 1-D integer array): BLAKE2b-128
    chained over the parent's 16 bytes and the block's token ids (little-endian int64), from a
    root over the cache key (its length first) and ``namespace``; each hash's first 8 bytes,
    big-endian, as an unsigned integer. Unkeyed: whoever reads an event reads its token ids."""
    chain = route_chain(route_root(cache_key, namespace), tokens, tokens_per_block)
    return [published(digest) for digest in chain]


def route_root(cache_key: bytes = b"", namespace: bytes = b"") -> bytes:
    """Where `router_hashes`' chain starts."""
    return hashlib.blake2b(b"kvalloc-route\0" + len(cache_key).to_bytes(4, "big") + cache_key
                           + namespace, digest_size=16).digest()


def route_chain(parent: bytes, tokens: ArrayLike, tokens_per_block: int) -> list[bytes]:
    """The 16-byte chain digests of the full blocks of ``tokens``, after ``parent``'s."""
    import numpy as np  # here: the event types stay light for the command line's flags

    data = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    step = tokens_per_block * 8
    out = []
    for start in range(0, (len(data) // step) * step, step):
        parent = hashlib.blake2b(parent + data[start : start + step], digest_size=16).digest()
        out.append(parent)
    return out


def published(digest: bytes) -> int:
    """The integer an event carries for a chain digest."""
    return int.from_bytes(digest[:8], "big")


def namespace_digest(namespace: bytes) -> str:
    """What the events say of a namespace: 16 hex digits that tell namespaces apart without
    naming the worker or group behind them."""
    return hashlib.blake2b(namespace, digest_size=8, person=b"kvalloc-ns").hexdigest()
