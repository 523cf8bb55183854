"""Random NWOR windows and their expected pool, shared by the CPU and GPU commit tests.

The expected pool is computed here with plain indexing, independently of the code under test:
start from a poisoned pool and write exactly the committed tokens (every non-draft token, and each
request's drafts up to its accepted count) of every staged layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from kvalloc.allocator.config import PoolConfig
from kvalloc.allocator.nwor.storage import KVStorage
from kvalloc.allocator.nwor.window import WindowLayout

# NaN bit patterns: finite staged values (and their saturating fp8 quantisation) never equal them.
POISON_BITS = {torch.bfloat16: 0x7FC1, torch.float16: 0x7E01, torch.float8_e4m3fn: 0x7F,
               torch.float32: 0x7FC00001}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def poisoned_storage(cfg: PoolConfig) -> KVStorage:
    storage = KVStorage(cfg)
    bits(storage.kv).fill_(POISON_BITS[cfg.torch_dtype])
    return storage


def pool_config(device: str, *, dtype: str = "bfloat16", num_layers: int = 3,
                num_blocks: int = 64, scales: bool = False,
                kv_layout: str = "kv") -> PoolConfig:
    """A K/V pool of 2 heads of 16, or a latent pool (one 40-wide latent: 32 + a rope key of 8,
    a small DeepSeek-V3 shape)."""
    latent = kv_layout == "latent"
    extra = {}
    if scales:
        rng = np.random.default_rng(7)
        extra = {"k_scales": tuple(rng.uniform(0.01, 2.0, num_layers).tolist())}
        if not latent:
            extra["v_scales"] = tuple(rng.uniform(0.01, 2.0, num_layers).tolist())
    return PoolConfig(num_blocks=num_blocks, tokens_per_block=4, num_layers=num_layers,
                      num_kv_heads=1 if latent else 2, head_dim=40 if latent else 16,
                      kv_layout=kv_layout, dtype=dtype, device=device,
                      max_seq_len=64, max_batch_size=16, **extra)


def random_layout(rng: np.random.Generator, max_requests: int, max_tokens: int) -> WindowLayout:
    """Prefill chunks and decode requests (1 + D tokens, D drafts, D may be 0), mixed."""
    tokens, drafts = [], []
    for _ in range(int(rng.integers(1, max_requests + 1))):
        if rng.random() < 0.3:
            n, d = int(rng.integers(1, 10)), 0
        else:
            d = int(rng.integers(0, 5))
            n = 1 + d
        if sum(tokens) + n > max_tokens:
            break
        tokens.append(n)
        drafts.append(d)
    return WindowLayout(tokens, drafts)


@dataclass
class Window:
    layout: WindowLayout
    slots: torch.Tensor  # [N] int64, -1 for padding tokens
    keys: torch.Tensor  # [L, N, H, D]
    values: torch.Tensor
    staged_layers: list[int]
    chunks: list[list[int]]  # per staged layer: chunk sizes summing to N
    accepted: list[int]

    def keep(self) -> np.ndarray:
        """Per token: committed (non-draft, or a draft within the accepted count)."""
        keep = []
        for n, d, a in zip(self.layout.num_tokens, self.layout.num_draft, self.accepted,
                           strict=True):
            keep += [True] * (n - d) + [True] * a + [False] * (d - a)
        return np.array(keep, dtype=bool)


def random_window(rng: np.random.Generator, storage: KVStorage, *, max_tokens: int,
                  stage_dtype: torch.dtype, max_requests: int = 8) -> Window:
    cfg = storage.config
    layout = random_layout(rng, max_requests, max_tokens)
    n = layout.total_tokens
    num_slots = storage.num_slots
    slots = torch.from_numpy(rng.permutation(num_slots)[:n].astype(np.int64))
    slots[torch.from_numpy(rng.random(n) < 0.1)] = -1  # padding tokens: staged, never written
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    # Wide dynamic range: subnormal-to-saturating values exercise fp8 rounding everywhere.
    magnitude = torch.from_numpy(10.0 ** rng.uniform(-4, 3, shape)).float()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    keys = (torch.randn(shape, generator=gen) * magnitude).to(stage_dtype)
    values = (torch.randn(shape, generator=gen) * magnitude).to(stage_dtype)
    layers = [layer for layer in range(cfg.num_layers) if rng.random() < 0.85] or [0]
    chunks = []
    for _ in layers:
        cuts = sorted(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 3))),
                                 replace=False).tolist()) if n > 1 else []
        edges = [0, *cuts, n]
        chunks.append([b - a for a, b in itertools.pairwise(edges)])
    accepted = [int(rng.integers(0, d + 1)) for d in layout.num_draft]
    device = storage.device
    return Window(layout, slots.to(device), keys.to(device), values.to(device), layers, chunks,
                  accepted)


def stage(manager, window: Window) -> None:
    for layer, sizes in zip(window.staged_layers, window.chunks, strict=True):
        start = 0
        for size in sizes:
            end = start + size
            values = window.values[layer, start:end] if manager.spec.planes == 2 else None
            manager.stage_layer(layer, window.keys[layer, start:end], values,
                                window.slots[start:end])
            start = end


def expected_after(storage_kv: torch.Tensor, window: Window, keep: np.ndarray,
                   inv_scales: torch.Tensor | None) -> torch.Tensor:
    """``storage_kv`` with exactly the kept, non-padding tokens of every staged layer written."""
    expected = storage_kv.clone()
    num_layers, planes, blocks, tpb, heads, dim = expected.shape
    rows = expected.view(num_layers, planes, blocks * tpb, heads, dim)
    slots = window.slots.cpu()
    write = torch.from_numpy(keep) & (slots >= 0)
    for layer in window.staged_layers:
        for kv, src in enumerate((window.keys, window.values)[:planes]):
            data = src[layer].cpu()[write]
            if inv_scales is not None:
                data = (data.float() * inv_scales[layer, kv].item()).clamp(-448, 448).to(
                    torch.float8_e4m3fn)
            bits(rows)[layer, kv, slots[write].to(rows.device)] = bits(data.to(rows.device))
    return expected
