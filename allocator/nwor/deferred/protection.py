"""`BlockProtection`: the guard that keeps NWOR's writes out of protected blocks.

``protect(blocks)`` hands over a bool mask, one entry per pool block, that the caller keeps
current (cached prefix blocks that other requests read). Before anything is written, a staged
slot in a protected block is set to -1, which every write skips: neither the commit nor its
fallback can write it, whatever the caller's slot mapping says. Each such staged token is
counted once, on the device, so the guard never synchronises.

Invariant: the mask is None (no guard) or bool ``[total_blocks]`` on the pool's device.
"""

from __future__ import annotations

import torch
from kvalloc.allocator.errors import InvariantViolation, NworInputError


class BlockProtection:
    def __init__(self, total_blocks: int, tokens_per_block: int, device: torch.device) -> None:
        self.total_blocks = total_blocks
        self.tokens_per_block = tokens_per_block
        self.device = device
        self.blocks: torch.Tensor | None = None
        self._refused = torch.zeros((), dtype=torch.int64, device=device)

    def set(self, blocks: torch.Tensor | None) -> None:
        """Guard the blocks where ``blocks`` is True from now on; None turns the guard off."""
        if blocks is not None and (blocks.dtype != torch.bool or blocks.device != self.device
                                   or blocks.shape != (self.total_blocks,)):
            raise NworInputError(
                f"protect: expected a bool tensor of {self.total_blocks} blocks "
                f"on {self.device}", field="protect")
        self.blocks = blocks

    def guard(self, slots: torch.Tensor, *, count: bool) -> None:
        """Set ``slots`` that land in a protected block to -1 (in place, on the device)."""
        refused = self._refused_in(slots)
        if refused is None:
            return
        if count:
            self._refused += refused.sum()
        slots.masked_fill_(refused, -1)

    def count(self, slots: torch.Tensor) -> None:
        """Count the tokens of ``slots`` that land in a protected block, changing nothing: a
        caller that guards them later, uncounted (`packed_commit`)."""
        refused = self._refused_in(slots)
        if refused is not None:
            self._refused += refused.sum()

    def _refused_in(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Where ``slots`` land in a protected block (None: no guard, or no slot)."""
        if self.blocks is None or slots.numel() == 0:
            return None
        blocks = torch.div(slots, self.tokens_per_block, rounding_mode="floor").clamp_(
            0, self.blocks.numel() - 1)
        return (slots >= 0) & self.blocks[blocks]

    def guard_host_rows(self, staged: torch.Tensor, kept: torch.Tensor | None) -> None:
        """Guard a host-slot window's uploaded rows: ``staged``, and ``kept`` (the same slots
        with rejected tokens at -1), counting each refused token once."""
        self.guard(staged, count=True)
        if kept is not None:
            self.guard(kept, count=False)

    @property
    def variant(self) -> int | None:
        """What a graph that guards bakes in of the guard: the mask's address."""
        return None if self.blocks is None else self.blocks.data_ptr()

    def refusals(self) -> int:
        """Staged tokens refused so far (a read back, so a synchronisation on CUDA)."""
        return int(self._refused) if self.blocks is not None else 0

    def check_invariants(self) -> None:
        if self.blocks is not None and (
                self.blocks.dtype != torch.bool or self.blocks.device != self.device
                or self.blocks.shape != (self.total_blocks,)):
            raise InvariantViolation("protection: the mask is not bool [total_blocks] on the "
                                     "pool's device")
