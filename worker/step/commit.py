"""`WorkerCommit`: an overlap worker's NWOR commit into the attached pool, on its own device.

An overlap worker learns its accepted counts on the device a step before the service does, so it
writes its kept tokens itself: the library's `DeferredWriteManager` over the attached pool,
reading the worker's staging buffer in place, with device slots and device counts, so nothing
waits for the host. The service publishes which blocks are cached prefix blocks that other
requests read (the attachment's ``protected`` mask, kept current by its steps); the commit
refuses every slot in them exactly as the service's own commit does.
"""

from __future__ import annotations

import numpy as np
import torch

from allocator import PoolConfig
from allocator.nwor.deferred_writes import DeferredWriteManager
from allocator.nwor.storage import KVStorage
from allocator.nwor.window import WindowLayout
from server.client import AttachedPool
from server.contract import wire


class WorkerCommit:
    def __init__(self, writes: DeferredWriteManager, staging: torch.Tensor) -> None:
        self.writes, self.staging = writes, staging

    def commit(self, num_tokens: np.ndarray, slots: torch.Tensor, kept: torch.Tensor) -> None:
        """Write the first ``kept[e]`` tokens of every entry (``num_tokens [R]``, packed in
        staging) to ``slots`` (-1: skip). Every token counts as a draft of the window: an entry
        keeps what its request goes on with, which only the device knows."""
        writes = self.writes
        writes.begin_window(WindowLayout.of_arrays(num_tokens, num_tokens))
        writes.stage_from(self.staging, slots)
        writes.commit(kept)


def worker_commit(pool: AttachedPool, layout: wire.PoolLayout) -> WorkerCommit:
    """The commit of a worker attached to ``pool``, shaped by the service's ``layout``."""
    config = PoolConfig(
        num_blocks=layout.num_blocks, tokens_per_block=layout.tokens_per_block,
        num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, dtype=layout.dtype, device=str(pool.kv.device),
        max_batch_size=layout.max_batch_size, max_draft_len=layout.max_draft_len,
        # The row length the service's blocks per row allow; only the pool's shape matters here.
        max_seq_len=max(1, layout.max_blocks_per_seq * layout.tokens_per_block
                        - 1 - 2 * layout.max_draft_len),
        overlap_scheduler=layout.overlap_scheduler,
        k_scales=layout.k_scales, v_scales=layout.v_scales)
    writes = DeferredWriteManager(KVStorage.over(config, pool.kv),
                                  max_tokens=layout.max_step_tokens,
                                  stage_dtype=pool.staging.dtype)
    if pool.protected is not None:
        writes.protect(pool.protected)
    return WorkerCommit(writes, pool.staging)
