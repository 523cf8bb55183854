"""Batch buckets: a decode-only step grows to the smallest of 1, 2, 4, 8 and the multiples of 8
that holds it, within what the staging buffer holds, and never shrinks."""

from __future__ import annotations

import pytest
from kvalloc.worker.step.batch_buckets import batch_bucket


@pytest.mark.parametrize(("entries", "bucket"), [
    (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, 24), (57, 64),
    (64, 64), (65, 72)])
def test_the_smallest_bucket_that_holds_the_batch(entries: int, bucket: int) -> None:
    assert batch_bucket(entries, most=1024) == bucket


def test_the_staging_buffer_caps_the_bucket_but_never_below_the_batch() -> None:
    assert batch_bucket(9, most=12) == 12
    assert batch_bucket(12, most=12) == 12
    assert batch_bucket(5, most=5) == 5


def test_few_buckets_serve_every_batch() -> None:
    assert len({batch_bucket(b, most=256) for b in range(1, 257)}) == 4 + 256 // 8 - 1
