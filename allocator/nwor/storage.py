"""`KVStorage`: the device tensors that hold the KV cache for every block of every layer.

Layout: one allocation ``kv[num_layers, P, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
with ``P = PoolConfig.kv_planes`` planes: for the "kv" layout P = 2 (index 0 of the second axis is
K, 1 is V); for the "latent" layout (MLA) P = 1, one head, and ``head_dim`` is the latent's width
(the compressed KV followed by the rope key), so a block id, a slot and every plane-0 path mean
the same in both.

Why this layout:
- one allocation for all layers, made once, so the pool can be shared with a worker through a
  single CUDA IPC handle / shared-memory segment and never fragments;
- ``kv[l, 0]`` and ``kv[l, 1]`` (or the latent's one ``kv[l, 0]``) are each contiguous
  ``[num_blocks, tokens_per_block, H, D]`` tensors: the paged layout attention kernels
  (FlashAttention / FlashInfer "NHD", FlashMLA's one-head latent) take per layer;
- a token's K (or V) in one layer is one contiguous ``H * D`` row at
  ``slot = block * tokens_per_block + offset``, so the NWOR commit writes whole rows and one
  fused kernel addresses every layer as ``(layer * P + plane) * num_slots + slot``.

The tensor comes from a `placement.TensorAllocator` (shared memory or CUDA IPC in a service,
a plain tensor by default) and is zero-filled here; `KVStorage.over` wraps a pool that exists.

fp8 pools store ``float8_e4m3fn`` with per-layer K and V dequantisation scales
(``value = stored * scale``); writers quantise with ``stored = value / scale``. A latent pool has
one per layer, ``k_scale``.
"""

from __future__ import annotations

import torch
from kvalloc.allocator.common.placement import TensorAllocator, plain_tensor
from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.errors import NworInputError


class KVStorage:
    def __init__(self, config: PoolConfig, *, allocate: TensorAllocator = plain_tensor) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.num_slots = config.total_blocks * config.tokens_per_block
        self.kv = allocate("kv", pool_shape(config), config.torch_dtype, self.device)
        self.kv.zero_()
        self._scales_from(config)

    @classmethod
    def over(cls, config: PoolConfig, kv: torch.Tensor) -> KVStorage:
        """The storage of a pool that already exists (a worker's attached pool): nothing is
        allocated and nothing cleared, since other processes read and write it."""
        storage = cls.__new__(cls)
        storage.config = config
        storage.device = kv.device
        storage.num_slots = config.total_blocks * config.tokens_per_block
        want = pool_shape(config)
        if tuple(kv.shape) != want or kv.dtype != config.torch_dtype:
            raise NworInputError(f"kv: a {tuple(kv.shape)} {kv.dtype} pool is not the configured "
                              f"{want} {config.torch_dtype}", field="kv")
        storage.kv = kv
        storage._scales_from(config)
        return storage

    def _scales_from(self, config: PoolConfig) -> None:
        ones = [1.0] * config.num_layers
        self.k_scale = torch.tensor(config.k_scales or ones, dtype=torch.float32,
                                    device=self.device)
        self.v_scale = torch.tensor(config.v_scales or ones, dtype=torch.float32,
                                    device=self.device)

    @property
    def planes(self) -> int:
        return self.config.kv_planes

    def plane_scales(self) -> torch.Tensor:
        """float32 ``[num_layers, planes]`` dequantisation scales: K then V, or the latent's."""
        scales = (self.k_scale, self.v_scale)[: self.planes]
        return torch.stack(scales, dim=1)

    @property
    def is_fp8(self) -> bool:
        return self.config.dtype == "fp8_e4m3"

    def key_cache(self, layer: int) -> torch.Tensor:
        """``[num_blocks, tokens_per_block, H, D]`` view of one layer's K."""
        return self.kv[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        if self.planes == 1:
            raise NworInputError("kv_layout: a latent pool has no V plane; read key_cache",
                                 field="kv_layout")
        return self.kv[layer, 1]

    def rows(self) -> torch.Tensor:
        """``[num_layers, planes, num_slots, H * D]`` view: one row per (layer, plane, slot)."""
        cfg = self.config
        return self.kv.view(cfg.num_layers, self.planes, self.num_slots,
                            cfg.num_kv_heads * cfg.head_dim)

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def pool_shape(config: PoolConfig) -> tuple[int, int, int, int, int, int]:
    """``(num_layers, kv_planes, num_blocks, tokens_per_block, num_kv_heads, head_dim)``."""
    return (config.num_layers, config.kv_planes, config.total_blocks, config.tokens_per_block,
            config.num_kv_heads, config.head_dim)
