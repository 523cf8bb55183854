"""`commit_packed` and `PackedCommit`: NWOR's one device commit, for every caller.

A packed batch is what any commit of a step reduces to:
- per token, int64 ``tokens[t] = (entry, index, bucket)``: the entry (request) it belongs to, its
  index under the keep rule and its histogram bucket (`keep_mask`);
- per entry, int64 ``bound[e]`` (token ``t`` is kept iff ``index < bound[entry]``,
  `window_maths.keep_rule`) and ``limits[e]``, the most ``bound`` may be (then the batch's token
  count): a bound outside ``[0, limit]`` keeps every token instead, never a clamped guess;
- per layer, the staged slots (-1: nothing to write).

The service's `DeferredWriteManager` commits a window with draft indices and accepted counts
(``index`` < 0 for a token that is not a draft); an overlap worker commits its step with each
token's index in its entry and the number of tokens each entry keeps. Both call
`commit_packed`: the keep mask (rejected slots at -1), the protected-block guard where the caller
has not guarded at staging, then the fused write, which reads the writer's fence
(`fence.WriterFence`) on the device and writes nothing for a session that has ended. Device
operations on static buffers only: eager, or captured in a CUDA graph.

Invariant: a token reaches the pool only if it is kept, its slot is not -1, its block is not
protected and its writer's fence is open.
"""

from __future__ import annotations

import torch
from kvalloc.allocator.nwor.commit_kernel import Backend, write_staged
from kvalloc.allocator.nwor.deferred.counters import DeviceCounters
from kvalloc.allocator.nwor.deferred.protection import BlockProtection
from kvalloc.allocator.nwor.fence import WriterFence
from kvalloc.allocator.nwor.keep_mask import mask_rejected


def commit_packed(pool_rows: torch.Tensor, staged: torch.Tensor, slots: torch.Tensor,
                  layer_rows: torch.Tensor, rows: int, tokens: torch.Tensor,
                  bound: torch.Tensor, limits: torch.Tensor, masked: torch.Tensor, *,
                  counters: DeviceCounters | None = None,
                  protection: BlockProtection | None = None,
                  inv_scales: torch.Tensor | None = None, fence: WriterFence | None = None,
                  backend: Backend = "auto") -> None:
    """Write the kept tokens of the first ``rows`` staged rows; ``masked`` (int64 ``[L, >=
    rows]``) receives the slots as written (rejected and refused ones at -1)."""
    mask_rejected(tokens, bound, limits, slots, rows, masked, counters, backend=backend)
    if protection is not None:
        # Each staged token in a protected block counts once (its first layer's slot), kept or
        # not, as the service's guard at staging counts it.
        protection.count(slots[:1, :rows])
        protection.guard(masked[:, :rows], count=False)
    write_staged(pool_rows, staged, masked, layer_rows, rows, inv_scales, backend=backend,
                 fence=fence)


class PackedCommit:
    """`commit_packed` for a writer that stages every layer of a step in one buffer and knows
    each entry's kept tokens on the device (an overlap worker): the static buffers a captured
    step reads, and the writer's counters on the device.

    ``pool_rows`` is `KVStorage.rows()`'s ``[L, P, slots, row]``, ``staged`` ``[L, P, T, row]``
    (``P`` the pool's planes: 2 for K/V, 1 for a latent);
    ``protected`` the owner's bool mask of protected blocks (None: no guard)."""

    def __init__(self, pool_rows: torch.Tensor, staged: torch.Tensor, tokens_per_block: int, *,
                 protected: torch.Tensor | None = None, fence: WriterFence | None = None,
                 backend: Backend = "auto") -> None:
        self.pool_rows, self.staged = pool_rows, staged
        layers, _, capacity, _ = staged.shape
        device = pool_rows.device
        self.fence, self.backend = fence, backend
        self.protection: BlockProtection | None = None
        if protected is not None:
            self.protection = BlockProtection(pool_rows.shape[2] // tokens_per_block,
                                              tokens_per_block, device)
            self.protection.set(protected)
        self.layer_rows = torch.zeros(layers, dtype=torch.int64, device=device)
        self.masked = torch.full((layers, capacity), -1, dtype=torch.int64, device=device)
        # (this step, in total, per bucket): committed tokens, steps with invalid counts, their
        # tokens; every token counts in the one bucket: a worker reports no histogram.
        self.counters: DeviceCounters = (torch.zeros(3, dtype=torch.int64, device=device),
                                         torch.zeros(3, dtype=torch.int64, device=device),
                                         torch.zeros(1, dtype=torch.int64, device=device))

    @property
    def committed(self) -> torch.Tensor:
        """Tokens committed so far (a device scalar)."""
        return self.counters[1][0]

    @property
    def refused(self) -> int:
        """Kept tokens refused for landing in a protected block (a read back)."""
        return 0 if self.protection is None else self.protection.refusals()

    def commit(self, slots: torch.Tensor, index: torch.Tensor, entry: torch.Tensor,
               kept: torch.Tensor, entry_tokens: torch.Tensor) -> None:
        """Write packed token ``t`` (the ``index[t]``-th of entry ``entry[t]``) to ``slots[t]``
        iff ``index[t] < kept[entry[t]]``; ``entry_tokens[e]`` is entry e's token count."""
        n = slots.numel()
        tokens = torch.stack([entry, index, torch.zeros_like(index)], 1)
        limits = torch.cat([entry_tokens.to(torch.int64), entry_tokens.new_full((1,), n)])
        self.layer_rows.fill_(n)
        commit_packed(self.pool_rows, self.staged, slots.expand(self.layer_rows.numel(), n),
                      self.layer_rows, n, tokens, kept, limits, self.masked,
                      counters=self.counters, protection=self.protection, fence=self.fence,
                      backend=self.backend)
