"""`fuse_model`: every fused forward the worker runs a CUDA model with, switched in one place.

The engine calls it on a CUDA model, and the benchmarks on the model whose forward they time as
the worker runs it: RMSNorm in one launch (`worker.norm`), the rotary embedding and the staging
copies in one (`worker.attention.rotary`), gate and up in one GEMM and SiLU-and-multiply in one
launch (`worker.mlp`). Each switch is per module instance and takes only the calls its kernel
takes; the model is changed in place, and a second call changes nothing.
"""

from __future__ import annotations

import torch
from kvalloc.worker.attention.rotary import fuse_attention_modules
from kvalloc.worker.mlp.gated_mlp import fuse_gated_mlps
from kvalloc.worker.norm.rms_norm import fuse_rms_norms


def fuse_model(model: torch.nn.Module) -> dict[str, int]:
    """Switch ``model``'s modules to the worker's fused forwards; how many of each kind."""
    return {"rms_norms": fuse_rms_norms(model), "attention": fuse_attention_modules(model),
            "mlps": fuse_gated_mlps(model)}
