"""`PinnedUploads`: host integers reach the device through one reused pinned buffer.

Rules:
- ``into(dst, values)`` leaves ``dst`` equal to ``values`` cast to its dtype, whatever its shape;
- ``upload(*arrays)`` returns device copies with each array's dtype, however the arrays' sizes
  fall against the buffer's alignment;
- back-to-back calls never overwrite what an earlier call's copy has not read yet: each
  destination ends with its own values, with no synchronisation by the caller in between;
- destinations of one size in bytes but another shape or dtype each get their own values.

`current_stream(index)` is torch's current stream of device ``index``, in and out of a stream
context (CUDA only).

Every test runs on "cpu" and, marked ``gpu`` (skipped without CUDA), on "cuda".
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator.common.device_io import PinnedUploads, current_stream

on_each_device = pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])


@on_each_device
def test_into_writes_the_values_cast_to_the_destination(device: str) -> None:
    uploads = PinnedUploads(torch.device(device))
    dst = torch.full((4, 3), -1, dtype=torch.int64, device=device)
    values = np.arange(12, dtype=np.int32).reshape(4, 3)
    uploads.into(dst, values)
    assert dst.cpu().numpy().tolist() == values.tolist()


@on_each_device
def test_upload_packs_arrays_of_any_size_and_dtype(device: str) -> None:
    uploads = PinnedUploads(torch.device(device))
    rng = np.random.default_rng(0)
    for sizes in ([1, 3, 5], [0, 7, 2], [1000, 1, 999]):
        arrays = [rng.integers(-2**40, 2**40, sizes[0]),
                  rng.integers(-2**30, 2**30, sizes[1]).astype(np.int32),
                  rng.integers(0, 2, sizes[2]).astype(bool)]
        copies = uploads.upload(*arrays)
        for array, copy in zip(arrays, copies, strict=True):
            assert copy.device.type == device
            assert copy.cpu().numpy().tolist() == array.tolist()


@on_each_device
def test_back_to_back_copies_each_land_their_own_values(device: str) -> None:
    uploads = PinnedUploads(torch.device(device))
    targets = [torch.zeros(50_000, dtype=torch.int64, device=device) for _ in range(8)]
    for i, dst in enumerate(targets):  # no synchronisation between the calls
        uploads.into(dst, np.full(50_000, i, dtype=np.int64))
    packed = []
    for i in range(8):
        (copy,) = uploads.upload(np.full(9_999, 100 + i, dtype=np.int64))
        packed.append(copy.clone())  # read before the next call reuses its memory
    for i, dst in enumerate(targets):
        assert torch.equal(dst.cpu(), torch.full((50_000,), i, dtype=torch.int64))
        assert torch.equal(packed[i].cpu(), torch.full((9_999,), 100 + i, dtype=torch.int64))


@on_each_device
def test_destinations_of_one_size_but_other_shapes_or_dtypes_get_their_own_values(
        device: str) -> None:
    uploads = PinnedUploads(torch.device(device))
    shapes = [((4, 3), torch.int64), ((12,), torch.int64), ((6, 2), torch.int64),
              ((24,), torch.int32), ((4, 3), torch.int64)]
    for i, (shape, dtype) in enumerate(shapes):
        dst = torch.zeros(shape, dtype=dtype, device=device)
        values = np.arange(dst.numel()).reshape(shape) * (i + 1)
        uploads.into(dst, values)
        assert dst.cpu().numpy().tolist() == values.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_current_stream_is_torchs_in_and_out_of_a_stream_context() -> None:
    index = torch.cuda.current_device()
    assert current_stream(index) == torch.cuda.current_stream(index)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(index) == side
        assert current_stream(index) == torch.cuda.current_stream(index)
    assert current_stream(index) == torch.cuda.current_stream(index) != side
