"""Where the allocator's tensors live: a hook that makes each one.

`KVStorage` and `BlockTable` never call ``torch.empty`` themselves; they ask a `TensorAllocator`
for every tensor, by name. A library user takes the default (plain tensors); a service passes an
allocator that returns tensors other processes can map (shared memory on CPU, CUDA IPC on a GPU),
so the pool and the block table are shared by injection instead of being swapped in afterwards.

Names asked for: ``"kv"`` (the pool, `KVStorage`) and ``"block_table"`` (int32, `BlockTable`).
The caller fills the tensor it gets (zeros for the pool, -1 for the table), so an allocator may
hand back uninitialised memory.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TensorAllocator(Protocol):
    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor: ...


def plain_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """The default: an ordinary tensor owned by this process."""
    del name  # every tensor is placed the same way
    return torch.empty(shape, dtype=dtype, device=device)
