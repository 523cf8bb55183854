"""Share tensors with same-host workers, no copies: POSIX shared memory on CPU, CUDA IPC on GPU.

A handle is a `wire.TensorHandle` of plain fields (a segment name and size, or the hex fields of
a CUDA IPC handle) plus dtype, shape, stride and offset: it travels over JSON or msgpack as data,
never as a pickle, and ``attach(handle)`` rebuilds the same tensor in the worker.

Invariants:
- shared-memory segments are created with mode 0600 (``O_EXCL``: never reusing a stranger's
  file) and unlinked by ``TensorExporter.close()`` / ``release()``;
- every page of a segment is allocated when it is made (``posix_fallocate``): tmpfs otherwise
  hands pages out on first touch, and a page it cannot hand out then is a SIGBUS in whichever
  process touched it (a worker writing its staging). A shortage is `InsufficientMemory` at
  creation instead, and the half-made segment is unlinked;
- segments live in `SHM_DIR`: ``/dev/shm``, or ``KVALLOC_SHM_DIR`` (read here alone), which the
  service and its workers must agree on;
- nothing outlives a crash for long: each exporter holds an exclusive ``flock`` on its owner file
  ``<prefix>.owner`` (which also records its pid and start time, for people) for as long as it
  lives; the kernel drops the lock however the process dies, and `reap_dead_instances` (run by
  every service at start) removes the segments of each owner file it can lock: a live
  instance's lock cannot be taken, so its segments are never touched. A lock, not the recorded
  pid, decides: pids are reused and differ between pid namespaces sharing one ``/dev/shm``;
- ``attach`` maps only what the service itself could have made: a ``kvalloc-<16 hex>-<name>``
  regular file directly in `SHM_DIR`, opened without following links, never created or grown,
  whose size is exactly the handle's and holds the tensor it describes;
- a CUDA tensor is exported as is (its memory already lives on the device), and the exporter
  keeps a reference to it so the memory is not reused while workers may map it;
- on CPU ``share()`` returns a *new* shared-memory tensor holding a copy of the input: the caller
  must use the returned tensor from then on.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import stat
import warnings
import weakref
from pathlib import Path

import torch
from kvalloc.allocator.common.device_io import current_stream
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import AttachError, InsufficientMemory
from torch.multiprocessing.reductions import rebuild_cuda_tensor

SHM_DIR_ENV = "KVALLOC_SHM_DIR"
# Where every segment lives. A directory of its own (a tmpfs mounted with a size, say) bounds what
# the service may take without touching /dev/shm; workers read the same variable.
SHM_DIR = Path(os.environ.get(SHM_DIR_ENV) or "/dev/shm")
OWNER_SUFFIX = ".owner"
# What `TensorExporter` names its segments: "kvalloc-" + the epoch in 16 hex digits + "-" + kv,
# block_table or staging-<worker id>. A client maps nothing else.
SEGMENT_NAME = re.compile(r"kvalloc-[0-9a-f]{16}-[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int32,
               torch.int64, torch.uint8, torch.bool)
}


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
    garbage-collected or the interpreter exits (a weakref finalizer). A death that runs no Python
    (SIGKILL, an abort, the OOM killer) leaves them, with an unlocked owner file, for the next
    service's `reap_dead_instances`.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._owned: dict[str, torch.Tensor] = {}
        owner, lock = _claim_owner(prefix)
        self._segments: set[Path] = {owner}
        self._finalizer = weakref.finalize(self, _unlink_all, self._segments, lock)

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
        path = SHM_DIR / seg
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._segments.add(path)
        try:
            os.ftruncate(fd, nbytes)  # a fresh tmpfs file reads as zeros
            _back_with_pages(fd, seg, nbytes)
        except BaseException:
            self._segments.discard(path)
            path.unlink(missing_ok=True)
            raise
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


def _back_with_pages(fd: int, name: str, nbytes: int) -> None:
    """Allocate every page of the segment ``fd`` now, so that no later touch can fault for want
    of one; `InsufficientMemory` naming the bytes needed and free when its filesystem has too
    few (the allocation is then undone by the kernel)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        shm = os.statvfs(SHM_DIR)
        raise InsufficientMemory(
            f"shm: the segment {name} needs {nbytes} bytes in {SHM_DIR}, which has "
            f"{shm.f_bavail * shm.f_frsize} bytes free") from None


def _unlink_all(paths: set[Path], lock: int) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
    paths.clear()
    os.close(lock)  # last: a reaper seeing the owner file unlocked finds nothing left to remove


def _claim_owner(prefix: str) -> tuple[Path, int]:
    """Create ``<prefix>.owner`` already locked; returns it and the descriptor holding the lock.

    Written under a scratch name, locked, then renamed into place, so a reaper never sees the
    owner file of a live instance unlocked."""
    owner = SHM_DIR / f"{prefix}{OWNER_SUFFIX}"
    scratch = SHM_DIR / f".{prefix}.{os.getpid()}"
    fd = os.open(scratch, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"pid {os.getpid()} start {_start_time(os.getpid())}\n".encode())
        os.rename(scratch, owner)
    except BaseException:
        os.close(fd)
        scratch.unlink(missing_ok=True)
        raise
    return owner, fd


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks after boot (/proc/<pid>/stat field 22)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return "unknown"


def reap_dead_instances() -> int:
    """Remove the segments and owner files of this user's dead exporters; returns how many
    segments went. An owner file whose lock is held belongs to a live instance and is skipped."""
    removed = 0
    for owner in SHM_DIR.glob(f"kvalloc-*{OWNER_SUFFIX}"):
        try:
            fd = os.open(owner, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, a link, or another user's
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive
            prefix = owner.name.removesuffix(OWNER_SUFFIX)
            for segment in SHM_DIR.glob(f"{prefix}-*"):
                segment.unlink(missing_ok=True)
                removed += 1
            owner.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed


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


def attach(handle: wire.TensorHandle, *, writable: bool = True) -> torch.Tensor:
    """Map the tensor ``handle`` describes into this process, without copying.

    A shared-memory handle is checked first (see the module's invariants); ``writable=False``
    maps it read-only, so a stray write crashes this process instead of changing what every
    other worker reads. A CUDA IPC handle cannot be mapped read-only."""
    dtype = _dtype(handle.dtype)
    if handle.shm is not None:
        return _map_segment(handle, handle.shm, dtype, writable)
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


def _map_segment(handle: wire.TensorHandle, ref: wire.ShmRef, dtype: torch.dtype,
                 writable: bool) -> torch.Tensor:
    if not SEGMENT_NAME.fullmatch(ref.name):
        raise AttachError(f"shm.name: {ref.name!r} is not a kvalloc segment name")
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = _span(handle)
    if ref.nbytes <= 0 or ref.nbytes % itemsize or span * itemsize > ref.nbytes:
        raise AttachError(f"shm.nbytes: {ref.nbytes} bytes cannot hold {handle.dtype} "
                          f"{handle.shape} (stride {handle.stride}, offset "
                          f"{handle.storage_offset})")
    path = SHM_DIR / ref.name
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AttachError(f"shm: {path} does not exist (is the service on this host?)") from None
    except OSError as exc:  # ELOOP: a symbolic link
        raise AttachError(f"shm: {path} cannot be opened without following links ({exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != ref.nbytes:
            raise AttachError(f"shm: {path} is not a {ref.nbytes}-byte regular file")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        memory = mmap.mmap(fd, ref.nbytes, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # torch has no read-only tensors and says so; the mapping itself refuses the write.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(memory, dtype=dtype, count=ref.nbytes // itemsize)
    return flat.as_strided(handle.shape, handle.stride, handle.storage_offset)


def _span(handle: wire.TensorHandle) -> int:
    """Elements from the storage's start through the handle's last element (0 if it has none)."""
    if len(handle.shape) != len(handle.stride) or any(d < 0 for d in handle.shape) or any(
            s < 0 for s in handle.stride) or handle.storage_offset < 0:
        raise AttachError(f"handle: shape {handle.shape} / stride {handle.stride} / offset "
                          f"{handle.storage_offset} do not describe a tensor")
    if 0 in handle.shape:
        return 0
    return handle.storage_offset + 1 + sum(
        (d - 1) * s for d, s in zip(handle.shape, handle.stride, strict=True))


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

    def __init__(self, forward_done: torch.cuda.Event, commit_done: torch.cuda.Event,
                 device: int) -> None:
        self.forward_done = forward_done
        self.commit_done = commit_done
        self._index = device

    @classmethod
    def create(cls, device: torch.device) -> tuple[StepFence, wire.EventHandle, wire.EventHandle]:
        (fwd, fwd_handle), (com, com_handle) = new_event(device), new_event(device)
        return cls(fwd, com, fwd_handle.device), fwd_handle, com_handle

    @classmethod
    def open(cls, forward_done: wire.EventHandle, commit_done: wire.EventHandle) -> StepFence:
        return cls(open_event(forward_done), open_event(commit_done), forward_done.device)

    def service_begin(self) -> None:
        current_stream(self._index).wait_event(self.forward_done)

    def service_end(self) -> None:
        self.commit_done.record(current_stream(self._index))

    def worker_forward_done(self) -> None:
        self.forward_done.record(current_stream(self._index))

    def worker_before_forward(self) -> None:
        current_stream(self._index).wait_event(self.commit_done)


class FenceGroup:
    """The fences of every shard of a tensor-parallel pool, one per device, used as one
    `StepFence`: the service's stream on each shard's device waits on that shard's forward and
    records that shard's commit. A worker that drives every shard from one process uses it too;
    a worker of one process per shard records and waits on its own shard's `StepFence` alone,
    and every rank's ``worker_forward_done`` must come before the scheduling rank sends the step
    (the service waits on the last record it finds)."""

    def __init__(self, fences: list[StepFence]) -> None:
        self.fences = fences

    def service_begin(self) -> None:
        for fence in self.fences:
            fence.service_begin()

    def service_end(self) -> None:
        for fence in self.fences:
            fence.service_end()

    def worker_forward_done(self) -> None:
        for fence in self.fences:
            fence.worker_forward_done()

    def worker_before_forward(self) -> None:
        for fence in self.fences:
            fence.worker_before_forward()
