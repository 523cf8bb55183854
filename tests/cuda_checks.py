"""What GPU tests check beyond values: `no_host_sync`, that a block of CUDA work never makes
the host wait for the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Any synchronising CUDA call inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
