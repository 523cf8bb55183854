"""`batch_bucket`: the batch size a decode-only step grows to, so that a few captured graphs
serve every batch.

Under continuous batching the batch changes nearly every step (requests end, new ones finish
their prefill), so a graph per exact size would run most steps eagerly while capturing, and
hold one graph per size it ever saw. A decode-only step of ``b`` entries runs instead as the
smallest bucket at or above ``b``: 1, 2, 4, 8, then every multiple of 8, as engines pad their
graph batches. The grown entries (`LaunchPlan.padded`) are decodes on the rows' spare row
(`worker.step.rows`): they read no history, emit nothing, keep nothing and have no slot, so
they cost only their rows of the GEMMs and their own few keys; at most 7 of them, beside at
least 8 real ones, once a batch is past the small sizes.
"""

from __future__ import annotations

SMALL = (1, 2, 4, 8)
STRIDE = 8  # past the small sizes


def batch_bucket(entries: int, most: int) -> int:
    """The entries a decode-only step of ``entries`` (``>= 1``) runs as: its bucket, or
    ``most`` (what the staging buffer holds at the step's width) where the bucket would exceed
    it, never below ``entries``."""
    bucket = next((size for size in SMALL if size >= entries),
                  -(-entries // STRIDE) * STRIDE)
    return max(entries, min(bucket, most))

