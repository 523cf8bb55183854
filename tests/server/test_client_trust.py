"""The client trusts nothing it maps: only the service's own ``/dev/shm`` segments, opened without
following links, never created or grown, exactly the size the handle describes; the block table
read-only. A rogue server on the worker's address cannot make it map and overwrite a file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import AttachError
from kvalloc.server.contract.operations import OK
from kvalloc.server.contract.sharing import SHM_DIR, TensorExporter, attach
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

PREFIX = "kvalloc-00000000000000bb"
ROGUE = SHM_DIR / f"{PREFIX}-rogue"
Exported = tuple[torch.Tensor, wire.TensorHandle]


@pytest.fixture
def exported() -> Iterator[Exported]:
    exporter = TensorExporter(prefix=PREFIX)
    tensor, handle = exporter.empty("table", (4, 8), torch.int32, torch.device("cpu"))
    tensor.fill_(7)
    yield tensor, handle
    exporter.close()


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "victim"
    path.write_bytes(b"precious" * 16)
    yield path
    ROGUE.unlink(missing_ok=True)


def with_shm(handle: wire.TensorHandle, **changes: object) -> wire.TensorHandle:
    assert handle.shm is not None
    return msgspec.structs.replace(handle, shm=msgspec.structs.replace(handle.shm, **changes))


def test_a_genuine_segment_maps_without_copies(exported: Exported) -> None:
    tensor, handle = exported
    mapped = attach(handle)
    mapped[0, 0] = 3
    assert tensor[0, 0] == 3 and attach(handle, writable=False)[0, 0] == 3


@pytest.mark.parametrize("name", ["../../tmp/victim", "/tmp/victim", "kvalloc-xyz-kv",
                                  f"{PREFIX}-kv\n", "passwd", f"{PREFIX}-a/b"])
def test_names_the_service_could_not_have_made_are_refused(exported: Exported,
                                                          name: str) -> None:
    _, handle = exported
    with pytest.raises(AttachError, match=r"shm\.name"):
        attach(with_shm(handle, name=name))


def test_a_link_in_dev_shm_is_not_followed(exported: Exported, victim: Path) -> None:
    _, handle = exported
    ROGUE.symlink_to(victim)
    with pytest.raises(AttachError, match="without following links"):
        attach(with_shm(handle, name=ROGUE.name, nbytes=victim.stat().st_size))
    assert victim.read_bytes() == b"precious" * 16


def test_sizes_must_match_the_file_and_hold_the_tensor(exported: Exported) -> None:
    _, handle = exported
    assert handle.shm is not None
    size = handle.shm.nbytes
    path = SHM_DIR / handle.shm.name
    with pytest.raises(AttachError, match="regular file"):
        attach(with_shm(handle, nbytes=size * 2))  # never grown to fit
    assert path.stat().st_size == size
    with pytest.raises(AttachError, match="cannot hold"):
        attach(with_shm(handle, nbytes=0))
    too_big = msgspec.structs.replace(handle, shape=[8, 8])
    with pytest.raises(AttachError, match="cannot hold"):
        attach(too_big)
    bad_stride = msgspec.structs.replace(handle, stride=[-8, 1])
    with pytest.raises(AttachError, match="do not describe a tensor"):
        attach(bad_stride)


def test_a_read_only_mapping_refuses_writes(exported: Exported) -> None:
    """A worker writing the read-only block table dies (SIGSEGV) and the table is unchanged."""
    tensor, handle = exported
    script = textwrap.dedent(f"""
        from server.contract import wire
        from server.contract.sharing import attach
        handle = wire.decode({wire.encode_msgpack(handle)!r}, wire.TensorHandle)
        table = attach(handle, writable=False)
        assert int(table[1, 1]) == 7
        table[1, 1] = 99
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert out.returncode == -11, out.stderr.decode()
    assert int(tensor[1, 1]) == 7


def test_a_rogue_server_cannot_make_a_worker_overwrite_a_file(
        tmp_path: Path, victim: Path, make_config: Callable[..., object]) -> None:
    """The rogue answers ``register`` with a genuine-looking registration whose pool is a link
    (named like a segment) to the victim, sized to match: the worker refuses to map it."""
    core = ServiceCore(ServiceConfig(pool=make_config(), max_step_tokens=64))
    try:
        genuine = core.register(wire.RegisterRequest(worker_id="w"))
    finally:
        core.close()
    ROGUE.symlink_to(victim)
    kv = with_shm(genuine.attachment.kv, name=ROGUE.name, nbytes=victim.stat().st_size)
    kv = msgspec.structs.replace(kv, shape=[victim.stat().st_size // 2], stride=[1])
    forged = msgspec.structs.replace(
        genuine, attachment=msgspec.structs.replace(genuine.attachment, kv=kv))
    address = f"ipc://{tmp_path / 'rogue.ipc'}"
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(address)
    try:
        with Client(address, worker_id="w", token="t", timeout_s=5, retries=0) as worker:
            def answer() -> None:
                identity, seq, *_ = rogue.recv_multipart()
                rogue.send_multipart([identity, seq, OK, wire.encode_msgpack(forged)])

            thread = threading.Thread(target=answer)
            thread.start()
            with pytest.raises(AttachError, match="without following links"):
                worker.register()
            thread.join()
            assert worker.pool is None
    finally:
        rogue.close()
        ctx.term()
    assert victim.read_bytes() == b"precious" * 16
