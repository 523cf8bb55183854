"""fp8 pools: the dtype a window stages in, and the scales each layer's commit quantises with.

The pool stores ``value / scale`` per layer and K/V (`storage`), so the commit multiplies by
reciprocal scales: ``inv``, float32 ``[num_layers, planes]`` (K, then V; a latent pool's one). A
``stage_layer`` call may override a layer's scales for the rest of the window's write of that
layer; the layer's next ``stage_layer`` call without them brings the pool's back.

Invariant: ``inv`` equals the pool's reciprocals everywhere but at the overridden entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from kvalloc.allocator.errors import InvariantViolation, NworInputError
from kvalloc.allocator.nwor.storage import KVStorage

FP8_STAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Scale = float | torch.Tensor | None  # a dequantisation scale; None: the pool's own


def stage_dtype_for(storage: KVStorage, stage_dtype: torch.dtype | None) -> torch.dtype:
    """What a window of ``storage`` stages in: the pool dtype, or for an fp8 pool the model's
    (``stage_dtype``, bf16 by default), quantised on commit."""
    cfg = storage.config
    if storage.is_fp8:
        dtype = stage_dtype or torch.bfloat16
        if dtype not in FP8_STAGE_DTYPES:
            raise NworInputError(f"stage_dtype: {dtype} cannot be quantised to fp8",
                                 field="stage_dtype")
        return dtype
    dtype = stage_dtype or cfg.torch_dtype
    if dtype != cfg.torch_dtype:
        raise NworInputError(f"stage_dtype: {dtype} differs from the pool's {cfg.torch_dtype}",
                             field="stage_dtype")
    return dtype


class Fp8Scales:
    """The reciprocal scales the commit quantises with (``inv``; None for a pool that is not
    fp8, whose commit copies)."""

    def __init__(self, storage: KVStorage, device: torch.device) -> None:
        self.device = device
        self.inv: torch.Tensor | None = None
        self._default: torch.Tensor | None = None
        if storage.is_fp8:
            self._default = torch.reciprocal(storage.plane_scales())
            self.inv = self._default.clone()
        self._overridden: set[tuple[int, int]] = set()

    def checked(self, name: str, scale: Scale) -> Scale:
        """``scale`` as ``set_layer`` takes it; None where nothing is quantised."""
        if self.inv is None or scale is None:
            return None
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or not scale.dtype.is_floating_point:
                raise NworInputError(f"{name}: expected one floating-point value", field=name)
            return scale
        if not (isinstance(scale, int | float) and np.isfinite(scale) and scale > 0):
            raise NworInputError(f"{name}: {scale!r} must be finite and > 0", field=name)
        return float(scale)

    def set_layer(self, layer: int, scales: Sequence[Scale]) -> None:
        """``layer``'s K and V scales (`checked`), None for the pool's own."""
        if self.inv is None:
            return
        for kv, scale in enumerate(scales[: self.inv.shape[1]]):
            self._set(layer, kv, scale)

    def _set(self, layer: int, kv: int, scale: Scale) -> None:
        assert self.inv is not None and self._default is not None
        key = (layer, kv)
        if scale is None:
            if key in self._overridden:
                self.inv[layer, kv].copy_(self._default[layer, kv])
                self._overridden.discard(key)
            return
        tensor = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale)
        self.inv[layer, kv].copy_(torch.reciprocal(
            tensor.reshape(()).to(device=self.device, dtype=torch.float32)))
        self._overridden.add(key)

    def check_invariants(self, num_layers: int) -> None:
        """Reads ``inv`` back: a synchronisation on CUDA."""
        if self.inv is None:
            if self._default is not None or self._overridden:
                raise InvariantViolation("fp8 scales: overrides on a pool that is not fp8")
            return
        assert self._default is not None
        if (self.inv.shape[0] != num_layers or self.inv.shape[1] not in (1, 2)
                or self.inv.dtype != torch.float32):
            raise InvariantViolation("fp8 scales: inv is not float32 [num_layers, planes]")
        kept = torch.ones_like(self.inv, dtype=torch.bool)
        for layer, kv in self._overridden:
            kept[layer, kv] = False
        if not torch.equal(self.inv[kept], self._default[kept]):
            raise InvariantViolation("fp8 scales: an entry nobody overrode left the pool's")
