"""Which slice of each sharded dimension a tensor-parallel rank owns.

Every split is into ``world`` contiguous ranges of equal size, rank ``r`` owning the ``r``-th:
KV heads, the query heads that attend to them, and the MLP's intermediate columns. The service
shards its pool by the same rule, so this module imports no torch.distributed and needs no
process group; the rule itself is `allocator.config.shard_span`.
"""

from __future__ import annotations

from kvalloc.allocator import shard_span
from kvalloc.worker.errors import ShardingError


def shard_range(field: str, size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of a dimension of ``size`` that rank ``rank`` of ``world`` owns."""
    _check_divides(field, size, world)
    if not 0 <= rank < world:
        raise ShardingError(f"rank: {rank} is outside 0..{world - 1} (world {world})")
    return shard_span(size, rank, world)


def shard_kv_heads(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """The KV heads ``[start, stop)`` rank ``rank`` holds in its pool shard."""
    return shard_range("num_key_value_heads", num_kv_heads, rank, world)


def shard_query_heads(num_heads: int, num_kv_heads: int, rank: int,
                      world: int) -> tuple[int, int]:
    """The query heads ``[start, stop)`` rank ``rank`` computes: exactly those that attend to its
    KV heads, as transformers groups them (query head ``i`` reads KV head ``i // groups``)."""
    if num_heads % num_kv_heads:
        raise ShardingError(f"num_attention_heads: {num_heads} is not a multiple of "
                            f"num_key_value_heads {num_kv_heads}")
    _check_divides("num_attention_heads", num_heads, world)
    start, stop = shard_kv_heads(num_kv_heads, rank, world)
    groups = num_heads // num_kv_heads
    return start * groups, stop * groups


def _check_divides(field: str, size: int, world: int) -> None:
    if world < 1:
        raise ShardingError(f"world: {world} ranks; a model needs at least 1")
    if size % world:
        raise ShardingError(f"{field}: {size} is not divisible by the world size {world}")
