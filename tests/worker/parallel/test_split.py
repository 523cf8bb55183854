"""The head split: every rank owns one contiguous range of KV heads, the ranges of all ranks
cover every head once, and a rank's query heads are exactly those that read its KV heads as
transformers groups them (query head ``i`` reads KV head ``i // (Hq / Hkv)``). A world size
that does not divide a count is refused, naming the field and the numbers."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from kvalloc.worker.errors import ShardingError
from kvalloc.worker.parallel.split import shard_kv_heads, shard_query_heads, shard_range

SHAPES = [(4, 2, 2), (8, 8, 4), (32, 8, 8), (32, 8, 2), (12, 4, 1), (28, 4, 4)]


@pytest.mark.parametrize(("heads", "kv_heads", "world"), SHAPES)
def test_the_ranks_kv_heads_cover_every_head_once_in_order(heads: int, kv_heads: int,
                                                           world: int) -> None:
    ranges = [shard_kv_heads(kv_heads, rank, world) for rank in range(world)]
    assert [h for start, stop in ranges for h in range(start, stop)] == list(range(kv_heads))
    assert {stop - start for start, stop in ranges} == {kv_heads // world}


@pytest.mark.parametrize(("heads", "kv_heads", "world"), SHAPES)
def test_a_ranks_query_heads_are_those_that_read_its_kv_heads(heads: int, kv_heads: int,
                                                              world: int) -> None:
    groups = heads // kv_heads
    for rank in range(world):
        kv_start, kv_stop = shard_kv_heads(kv_heads, rank, world)
        readers = [i for i in range(heads) if kv_start <= i // groups < kv_stop]
        start, stop = shard_query_heads(heads, kv_heads, rank, world)
        assert list(range(start, stop)) == readers


@pytest.mark.parametrize(("call", "message"), [
    (lambda: shard_kv_heads(2, 0, 4), "num_key_value_heads: 2 is not divisible by the world "
                                      "size 4"),
    (lambda: shard_query_heads(6, 6, 0, 4), "num_attention_heads: 6 is not divisible by the "
                                            "world size 4"),
    (lambda: shard_query_heads(6, 4, 0, 2), "num_attention_heads: 6 is not a multiple of "
                                            "num_key_value_heads 4"),
    (lambda: shard_range("intermediate_size", 100, 0, 3), "intermediate_size: 100 is not "
                                                          "divisible by the world size 3"),
    (lambda: shard_kv_heads(4, -1, 2), "rank: -1 is outside 0..1 (world 2)"),
    (lambda: shard_kv_heads(4, 0, -2), "world: -2 ranks; a model needs at least 1"),
])
def test_a_split_the_world_does_not_divide_is_refused(call: Callable[[], object],
                                                     message: str) -> None:
    with pytest.raises(ShardingError, match=f"^{re.escape(message)}$"):
        call()
