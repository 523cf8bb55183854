"""Share tensors with same-host workers, no copies: POSIX shared memory on CPU, CUDA IPC on GPU.

A handle is a `wire.TensorHandle` of plain fields (a segment name and size, or the hex fields of
a CUDA IPC handle) plus dtype, shape, stride and offset: it travels over JSON or msgpack as data,
never as a pickle, and ``attach(handle)`` rebuilds the same tensor in the worker.

Invariants:
- shared-memory segments are created with mode 0600 (``O_EXCL``: never reusing a stranger's
  file) and unlinked by ``TensorExporter.close()`` / ``release()``;
- a CUDA tensor is exported as is (its memory already lives on the device), and the exporter
  keeps a reference to it so the memory is not reused while workers may map it;
- on CPU ``share()`` returns a *new* shared-memory tensor holding a copy of the input: the caller
  must use the returned tensor from then on.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from . import wire

SHM_DIR = Path("/dev/shm")

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32,
               torch.int64, torch.uint8)
}


class AttachError(RuntimeError):
    """A handle cannot be mapped here (another host, a removed segment, no CUDA)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise AttachError(f"dtype: {name!r} is not a dtype this client maps") from None


class TensorExporter:
    """Creates and owns the service's shared tensors. Segment names are ``<prefix>-<name>``.

    Segments are unlinked by ``release`` / ``close``, and at the latest when the exporter is
    garbage-collected or the interpreter exits (a weakref finalizer): only SIGKILL leaves any.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._owned: dict[str, torch.Tensor] = {}
        self._segments: set[Path] = set()
        self._finalizer = weakref.finalize(self, _unlink_all, self._segments)

    def share(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, wire.TensorHandle]:
        """``tensor`` made shareable: the tensor to use from now on, and its handle."""
        if tensor.is_cuda:
            self._owned[name] = tensor
            return tensor, _cuda_handle(tensor)
        shared, handle = self.empty(name, tuple(tensor.shape), tensor.dtype, tensor.device)
        shared.copy_(tensor)
        return shared, handle

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, wire.TensorHandle]:
        """A new zero-filled shared tensor on ``device`` (shared memory on CPU)."""
        if device.type == "cuda":
            return self.share(torch.zeros(shape, dtype=dtype, device=device), name)
        seg = f"{self.prefix}-{name}"
        numel = max(1, int(torch.Size(shape).numel()))
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.open(SHM_DIR / seg, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._segments.add(SHM_DIR / seg)
        try:
            os.ftruncate(fd, nbytes)  # a fresh tmpfs file reads as zeros
        finally:
            os.close(fd)
        flat = torch.from_file(str(SHM_DIR / seg), shared=True, size=numel, dtype=dtype)
        tensor = flat[: int(torch.Size(shape).numel())].view(shape)
        self._owned[name] = tensor
        return tensor, wire.TensorHandle(
            dtype=dtype_name(dtype), shape=list(shape), stride=list(tensor.stride()),
            storage_offset=0, shm=wire.ShmRef(name=seg, nbytes=nbytes),
        )

    def release(self, name: str) -> None:
        """Forget ``name``; its segment is unlinked (mappings that exist stay valid)."""
        self._owned.pop(name, None)
        path = SHM_DIR / f"{self.prefix}-{name}"
        if path in self._segments:
            self._segments.discard(path)
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self._owned.clear()
        self._finalizer()


def _unlink_all(paths: set[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
    paths.clear()


def _cuda_handle(tensor: torch.Tensor) -> wire.TensorHandle:
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = tensor.untyped_storage()._share_cuda_()
    return wire.TensorHandle(
        dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), stride=list(tensor.stride()),
        storage_offset=tensor.storage_offset(),
        cuda=wire.CudaRef(
            device=int(device), handle=handle.hex(), storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes), ref_counter_handle=ref_handle.hex(),
            ref_counter_offset=int(ref_offset),
            event_handle=event_handle.hex() if event_handle else None,
            event_sync_required=bool(event_sync),
        ),
    )


def attach(handle: wire.TensorHandle) -> torch.Tensor:
    """Map the tensor ``handle`` describes into this process, without copying."""
    dtype = _dtype(handle.dtype)
    if handle.shm is not None:
        path = SHM_DIR / handle.shm.name
        if not path.exists():
            raise AttachError(f"shm: {path} does not exist (is the service on this host?)")
        numel = handle.shm.nbytes // torch.empty((), dtype=dtype).element_size()
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        return flat.as_strided(handle.shape, handle.stride, handle.storage_offset)
    if handle.cuda is not None:
        ref = handle.cuda
        if not torch.cuda.is_available():
            raise AttachError("cuda: the handle is a CUDA IPC handle but CUDA is not available")
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(handle.shape), tuple(handle.stride), handle.storage_offset,
            torch.UntypedStorage, dtype, ref.device, bytes.fromhex(ref.handle),
            ref.storage_size_bytes, ref.storage_offset_bytes, False,
            bytes.fromhex(ref.ref_counter_handle), ref.ref_counter_offset,
            bytes.fromhex(ref.event_handle) if ref.event_handle else None,
            ref.event_sync_required,
        )
    raise AttachError("handle: neither shm nor cuda is set")


def new_event(device: torch.device) -> tuple[torch.cuda.Event, wire.EventHandle]:
    """An interprocess CUDA event and its handle (timing disabled, as CUDA IPC requires)."""
    with torch.cuda.device(device):
        # The event is created lazily on the current device, here the pool's.
        event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        handle = event.ipc_handle()
        index = torch.cuda.current_device()
    return event, wire.EventHandle(device=index, handle=handle.hex())


def open_event(handle: wire.EventHandle) -> torch.cuda.Event:
    return torch.cuda.Event.from_ipc_handle(handle.device, bytes.fromhex(handle.handle))


class StepFence:
    """Orders one worker's forward and the service's step on the device (CUDA pools only).

    - ``forward_done``: the worker records it once its forward has written the staging buffer;
      the service's stream waits on it before it changes the block table or reads staging.
    - ``commit_done``: the service records it after the step (block-table upload and commit); the
      worker's stream waits on it before its next forward reads the table or the pool.

    Both waits are device-side (``Stream.wait_event``): neither process blocks its host thread.
    On a CPU pool there is no fence: the worker's writes are done before it sends the call.
    """

    def __init__(self, forward_done: torch.cuda.Event, commit_done: torch.cuda.Event) -> None:
        self.forward_done = forward_done
        self.commit_done = commit_done

    @classmethod
    def create(cls, device: torch.device) -> tuple[StepFence, wire.EventHandle, wire.EventHandle]:
        (fwd, fwd_handle), (com, com_handle) = new_event(device), new_event(device)
        return cls(fwd, com), fwd_handle, com_handle

    @classmethod
    def open(cls, forward_done: wire.EventHandle, commit_done: wire.EventHandle) -> StepFence:
        return cls(open_event(forward_done), open_event(commit_done))

    def service_begin(self) -> None:
        torch.cuda.current_stream().wait_event(self.forward_done)

    def service_end(self) -> None:
        self.commit_done.record()

    def worker_forward_done(self) -> None:
        self.forward_done.record()

    def worker_before_forward(self) -> None:
        torch.cuda.current_stream().wait_event(self.commit_done)
