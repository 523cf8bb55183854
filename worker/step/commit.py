"""`WorkerCommit`: an overlap worker's NWOR commit into the attached pool, on its own device.

An overlap worker learns its accepted counts on the device a step before the service does, so it
writes its kept tokens itself, with the library's commit kernel (`write_staged`, the one the
service's `DeferredWriteManager` writes with): each entry keeps its first ``kept[e]`` tokens,
every other slot becomes -1, and one launch writes every layer's K and V from the worker's
staging buffer. Nothing here keeps host state or reads a device value back, so the same commit
runs eagerly or inside a captured CUDA graph (where the manager's per-window host bookkeeping
could not run). The service publishes which blocks are cached prefix blocks that other requests
read (the attachment's ``protected`` mask, kept current by its steps); a slot in one of them is
refused, as the service's own commit refuses it. Committed and refused tokens are counted on
the device.
"""

from __future__ import annotations

import torch

from allocator.nwor.commit_kernel import write_staged
from server.client import AttachedPool


class WorkerCommit:
    def __init__(self, pool: AttachedPool) -> None:
        layers, _, blocks, self.tokens_per_block, heads, dim = pool.kv.shape
        self.pool_rows = pool.kv.view(layers, 2, blocks * self.tokens_per_block, heads * dim)
        self.staged = pool.staging.view(layers, 2, pool.staging.shape[2], heads * dim)
        self.protected = pool.protected
        device = pool.kv.device
        self.layer_rows = torch.zeros(layers, dtype=torch.int64, device=device)
        self.committed = torch.zeros((), dtype=torch.int64, device=device)
        self.refused = torch.zeros((), dtype=torch.int64, device=device)

    def commit(self, slots: torch.Tensor, index: torch.Tensor, entry: torch.Tensor,
               kept: torch.Tensor) -> None:
        """Write packed token ``t`` (``index[t]``-th of entry ``entry[t]``) to ``slots[t]`` iff
        ``index[t] < kept[entry[t]]`` and its block is not protected."""
        keep = (index < kept[entry]) & (slots >= 0)
        if self.protected is not None:
            block = (slots // self.tokens_per_block).clamp(min=0)
            refused = keep & self.protected[block]
            self.refused += refused.sum()
            keep &= ~refused
        self.committed += keep.sum()
        n = slots.numel()
        self.layer_rows.fill_(n)
        write_staged(self.pool_rows, self.staged,
                     torch.where(keep, slots, -1).expand(self.layer_rows.numel(), n),
                     self.layer_rows, n)
