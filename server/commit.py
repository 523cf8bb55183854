"""`Committer`: the service's NWOR commit of one worker's window, on the pool's device.

One `DeferredWriteManager` serves every worker: the core calls ``commit`` under its lock, and a
whole window (begin, stage every layer from the worker's shared staging buffer, commit) runs
inside that one call, so windows of different workers never interleave.

Requests the settling call reverted or finished commit nothing: they enter the layout as all
drafts with 0 accepted, so NWOR counts their tokens as rejected (never written) and
``committed == written`` holds; `server.window.Window.commit_slots` has already set their slots
to -1, which keeps even a fallback from writing them.
"""

from __future__ import annotations

import numpy as np
import torch

from allocator.deferred_writes import DeferredWriteManager, WindowLayout
from allocator.device_io import upload_int64
from allocator.kv_storage import KVStorage

from . import wire
from .window import Window


class Committer:
    def __init__(self, storage: KVStorage, *, max_tokens: int, stage_dtype: torch.dtype) -> None:
        self.device = storage.device
        self.num_layers = storage.config.num_layers
        self.writes = DeferredWriteManager(storage, max_tokens=max_tokens, stage_dtype=stage_dtype)

    def commit(self, staging: torch.Tensor, window: Window, accepted: np.ndarray,
               slots: np.ndarray, dropped: np.ndarray) -> wire.CommitSummary:
        """Write ``window``'s committed tokens from ``staging`` (``[L, 2, T, H, D]``).

        ``accepted`` and ``dropped`` are per window request; ``slots`` per token (-1: skip).
        """
        n = window.total_tokens
        drafts = np.where(dropped, window.num_tokens, window.num_drafts)
        writes = self.writes
        writes.begin_window(WindowLayout(tuple(window.num_tokens.tolist()),
                                         tuple(drafts.tolist())))
        slot_mapping = upload_int64(slots, self.device)
        for layer in range(self.num_layers):
            writes.stage_layer(layer, staging[layer, 0, :n], staging[layer, 1, :n], slot_mapping)
        writes.commit(np.where(dropped, 0, accepted))
        stats = writes.last_window
        assert stats is not None
        return wire.CommitSummary(tokens=stats.tokens,
                                  written=stats.committed + stats.fallback_tokens,
                                  fallback=stats.fallback_reason)

