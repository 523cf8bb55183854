"""Every segment the service makes is backed by memory when it is promised: its pages are
allocated at creation, so a shortage is a typed refusal then (`InsufficientMemory`, 507
``insufficient_memory``, naming the bytes needed and free) instead of a SIGBUS in whichever
process first touches a page. A refusal leaves nothing behind: at start no segment of the core,
at registration no staging buffer, no open fence word and no session.

The shortage is made here by an allocation that fails as a full tmpfs fails (ENOSPC);
`tests/e2e/test_shm_backing_e2e.py` fills a real one."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kvalloc.allocator import CLOSED
from kvalloc.server.contract import sharing, wire
from kvalloc.server.contract.errors import AttachError, InsufficientMemory, describe
from kvalloc.server.contract.sharing import SHM_DIR, TensorExporter
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

EPOCH = 0x5EED_0BAC_ED00


def full_for(names: tuple[str, ...]) -> Callable[[int, int, int], None]:
    """``os.posix_fallocate`` as it behaves on a filesystem too full for the segments whose
    names end with one of ``names`` (every other one is allocated for real)."""
    allocate = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(names):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allocate(fd, offset, length)
    return fallocate


def segments(epoch: int) -> list[Path]:
    return sorted(SHM_DIR.glob(f"kvalloc-{epoch:016x}-*"))


def test_a_segment_has_its_pages_when_it_is_made() -> None:
    """A file only truncated to its size holds no pages (st_blocks 0) until touched; the
    exporter's segments hold all of theirs."""
    exporter = TensorExporter(prefix=f"kvalloc-{EPOCH:016x}")
    try:
        tensor, handle = exporter.empty("staging-w", (1 << 20,), torch.float32,
                                        torch.device("cpu"))
        info = (SHM_DIR / handle.shm.name).stat()
        assert info.st_blocks * 512 >= info.st_size == 4 << 20
        assert not tensor.any()  # still zero-filled
    finally:
        exporter.close()


def test_a_staging_buffer_that_cannot_be_backed_refuses_the_registration(
        make_config, monkeypatch: pytest.MonkeyPatch) -> None:
    core = ServiceCore(ServiceConfig(pool=make_config(num_layers=2), max_step_tokens=64,
                                     max_workers=2), epoch=EPOCH)
    try:
        before = segments(EPOCH)
        monkeypatch.setattr(os, "posix_fallocate", full_for(("-staging-w1",)))
        with pytest.raises(InsufficientMemory) as refused:
            core.register(wire.RegisterRequest(worker_id="w1"))
        body = describe(refused.value)
        assert (body.status, body.code) == (507, "insufficient_memory")
        itemsize = torch.empty((), dtype=core.pool.staging_dtype).element_size()
        staging_bytes = 2 * 2 * 64 * core.layout.num_kv_heads * core.layout.head_dim * itemsize
        assert f"staging-w1 needs {staging_bytes} bytes in {SHM_DIR}" in body.message
        assert "bytes free" in body.message
        # Nothing left: no segment, no session, every fence word closed.
        assert segments(EPOCH) == before
        assert len(core.registry) == 0
        assert core.pool.words[0].words.tolist() == [CLOSED, CLOSED]
        core.check_invariants()
        monkeypatch.undo()
        assert core.register(wire.RegisterRequest(worker_id="w1")).attachment.staging is not None
        core.check_invariants()
    finally:
        core.close()


def test_a_shard_that_cannot_be_backed_leaves_no_other_shards_staging(
        make_config, monkeypatch: pytest.MonkeyPatch) -> None:
    core = ServiceCore(ServiceConfig(pool=make_config(num_layers=2, num_kv_heads=2),
                                     max_step_tokens=64, devices=["cpu", "cpu"],
                                     tensor_parallel=2), epoch=EPOCH)
    try:
        before = segments(EPOCH)
        monkeypatch.setattr(os, "posix_fallocate", full_for(("-shard1-staging-w1",)))
        with pytest.raises(InsufficientMemory, match="shard1-staging-w1 needs"):
            core.register(wire.RegisterRequest(worker_id="w1"))
        assert segments(EPOCH) == before  # shard 0's staging went too
        assert len(core.registry) == 0
        core.check_invariants()
    finally:
        core.close()


@pytest.mark.parametrize("segment", ["-kv", "-block_table", "-fence_words", "-protected"])
def test_a_core_whose_pool_cannot_be_backed_is_not_made_and_leaves_nothing(
        make_config, monkeypatch: pytest.MonkeyPatch, segment: str) -> None:
    monkeypatch.setattr(os, "posix_fallocate", full_for((segment,)))
    config = ServiceConfig(pool=make_config(num_layers=2), max_step_tokens=64,
                           prefix_caching=True)
    with pytest.raises(InsufficientMemory, match=f"{segment.lstrip('-')} needs \\d+ bytes"):
        ServiceCore(config, epoch=EPOCH)
    assert list(SHM_DIR.glob(f"kvalloc-{EPOCH:016x}*")) == []  # the owner file too


def test_another_allocation_failure_is_not_called_a_shortage(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "posix_fallocate", broken)
    exporter = TensorExporter(prefix=f"kvalloc-{EPOCH:016x}")
    try:
        with pytest.raises(OSError) as failed:
            exporter.empty("kv", (16,), torch.float32, torch.device("cpu"))
        assert failed.value.errno == errno.EIO and not isinstance(failed.value,
                                                                  InsufficientMemory)
        assert segments(EPOCH) == []
    finally:
        exporter.close()


def test_a_worker_maps_segments_from_the_services_directory_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``KVALLOC_SHM_DIR`` elsewhere, a handle naming a segment that exists only in
    /dev/shm is refused: the name cannot leave the directory, and nothing else is looked at."""
    exporter = TensorExporter(prefix=f"kvalloc-{EPOCH:016x}")
    try:
        _, handle = exporter.empty("kv", (16,), torch.float32, torch.device("cpu"))
        assert sharing.attach(handle).numel() == 16
        monkeypatch.setattr(sharing, "SHM_DIR", tmp_path)
        with pytest.raises(AttachError, match=f"{tmp_path}/{handle.shm.name} does not exist"):
            sharing.attach(handle)
    finally:
        monkeypatch.undo()
        exporter.close()
