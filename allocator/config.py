"""`PoolConfig`: the shape of one GPU's paged KV pool and the limits every request lives within.

Invalid combinations fail at construction with a pydantic ``ValidationError`` whose message names
the offending field, so a bad deployment never reaches the allocator.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# torch is imported where a pool's device or dtype is resolved, not here: the fields and their
# defaults are read without it (`kvalloc serve --help`, which would otherwise wait on torch).
if TYPE_CHECKING:
    import torch

KVDType = Literal["bfloat16", "float16", "float32", "fp8_e4m3"]
# "kv": per-head K and V planes. "latent": one plane of one vector per token and layer (MLA's
# compressed KV followed by its rope key), no heads and no separate V.
KVLayout = Literal["kv", "latent"]
_PLANES: dict[str, int] = {"kv": 2, "latent": 1}

# KVDType -> the name of its torch dtype.
_TORCH_DTYPES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    # Exact-token checks against a model's own float32 forward need a float32 pool.
    "float32": "float32",
    "fp8_e4m3": "float8_e4m3fn",
}


class SlackPolicy(str, Enum):
    """How grant sites treat the overlap slack.

    ``reclaim`` is the only correct policy. ``none`` and ``unreclaimed`` exist to reproduce the two
    historical production crashes on purpose: ``none`` grants 1 + D with no slack (the device's
    write reach outruns capacity at a block boundary: IMA); ``unreclaimed`` grants the slack every
    step and never takes it back (capacity leaks D tokens per step until the row overflows).
    """

    RECLAIM = "reclaim"
    NONE = "none"
    UNRECLAIMED = "unreclaimed"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class PoolConfig(BaseModel):
    """One pool: block geometry, model KV shape, dtype, device and scheduler limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_blocks: int | None = Field(
        default=None, gt=0, description="Blocks in the pool; or give memory_budget_bytes."
    )
    memory_budget_bytes: int | None = Field(
        default=None, gt=0, description="Device bytes for the KV of all layers; sets num_blocks."
    )
    tokens_per_block: int = Field(default=16, gt=0)
    num_layers: int = Field(default=2, gt=0)
    num_kv_heads: int = Field(default=2, gt=0, description="KV heads per layer; 1 for latent.")
    head_dim: int = Field(default=64, gt=0, description="Per head; the latent width for latent.")
    kv_layout: KVLayout = Field(
        default="kv", description="kv: per-head K and V; latent: one MLA latent per token.")
    dtype: KVDType = "bfloat16"
    k_scales: tuple[float, ...] | None = Field(
        default=None, description="fp8 only: one K (or latent) dequantisation scale per layer "
        "(default 1.0)."
    )
    v_scales: tuple[float, ...] | None = Field(
        default=None, description="fp8 only: one V dequantisation scale per layer (default 1.0)."
    )
    device: str = Field(default_factory=default_device)
    max_batch_size: int = Field(default=64, gt=0)
    max_seq_len: int = Field(default=4096, gt=0)
    max_draft_len: int = Field(default=3, ge=0)
    overlap_scheduler: bool = True
    slack_policy: SlackPolicy = SlackPolicy.RECLAIM

    @field_validator("device")
    @classmethod
    def _device_exists(cls, value: str) -> str:
        import torch

        try:
            dev = torch.device(value)
        except RuntimeError as exc:
            raise ValueError(f"device: {value!r} is not a torch device ({exc})") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device: {value!r} must be 'cpu' or 'cuda[:N]'")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device: {value!r} requested but CUDA is not available")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(
                    f"device: {value!r} but only {torch.cuda.device_count()} CUDA devices exist"
                )
        return value

    @field_validator("k_scales", "v_scales")
    @classmethod
    def _scales_positive(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if value is not None and any(not (s > 0 and math.isfinite(s)) for s in value):
            raise ValueError("every fp8 scale must be finite and > 0")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PoolConfig:
        if (self.num_blocks is None) == (self.memory_budget_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_budget_bytes")
        if self.kv_layout == "latent":
            self._latent_consistent()
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < self.bytes_per_block:
            raise ValueError(
                f"memory_budget_bytes: {self.memory_budget_bytes} holds no block "
                f"(one block is {self.bytes_per_block} bytes)"
            )
        for name in ("k_scales", "v_scales"):
            scales = getattr(self, name)
            if scales is None:
                continue
            if self.dtype != "fp8_e4m3":
                raise ValueError(f"{name}: only meaningful with dtype 'fp8_e4m3'")
            if len(scales) != self.num_layers:
                raise ValueError(
                    f"{name}: {len(scales)} scales for num_layers={self.num_layers}"
                )
        if self.max_blocks_per_seq > self.total_blocks:
            raise ValueError(
                f"max_seq_len: {self.max_seq_len} needs {self.max_blocks_per_seq} blocks per "
                f"sequence but the pool has {self.total_blocks}"
            )
        return self

    def _latent_consistent(self) -> None:
        if self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads}, a latent pool has one "
                             "(head_dim is the latent's width)")
        if self.v_scales is not None:
            raise ValueError("v_scales: a latent pool has no V; its one scale per layer is "
                             "k_scales")

    @property
    def kv_planes(self) -> int:
        """Planes per layer: 2 (K, V) for "kv", 1 (the latent) for "latent"."""
        return _PLANES[self.kv_layout]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, _TORCH_DTYPES[self.dtype])

    @property
    def bytes_per_block(self) -> int:
        itemsize = self.torch_dtype.itemsize
        return (self.kv_planes * self.num_layers * self.tokens_per_block * self.num_kv_heads
                * self.head_dim * itemsize)

    @property
    def total_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        assert self.memory_budget_bytes is not None
        return self.memory_budget_bytes // self.bytes_per_block

    @property
    def max_slack(self) -> int:
        """Slack a grant may add on top of 1 + D: D under overlap, else nothing."""
        return self.max_draft_len if self.overlap_scheduler else 0

    @property
    def max_blocks_per_seq(self) -> int:
        """ceil((max_seq_len + max_draft_len + 1 + slack) / tokens_per_block) (docs/design.md)."""
        tokens = self.max_seq_len + self.max_draft_len + 1 + self.max_slack
        return -(-tokens // self.tokens_per_block)


def shard_span(size: int, shard: int, shards: int) -> tuple[int, int]:
    """``[start, stop)`` of a dimension of ``size`` that tensor-parallel shard ``shard`` of
    ``shards`` holds: the one split rule, for a pool's KV heads as for a model's heads and MLP
    columns (contiguous, equal ranges). ``shards`` must divide ``size``: callers check it and
    name their field."""
    per_shard = size // shards
    return shard * per_shard, (shard + 1) * per_shard
