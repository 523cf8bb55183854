"""KV-cache events in the wire shape vLLM publishes, so KV-aware routers read them unchanged.

Each message is a msgpack ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]`` with every
struct encoded as an array, and each event tagged by its class name (msgspec ``tag=True``):
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``. Block hashes go out as
unsigned 64-bit integers (the first 8 bytes of kvalloc's 128-bit block hash), the form vLLM sends
by default.
"""

from __future__ import annotations

import msgspec

MEDIUM = "GPU"


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """The integer a router sees for one of kvalloc's block hashes."""
    return int.from_bytes(block_hash[:8], "big")
