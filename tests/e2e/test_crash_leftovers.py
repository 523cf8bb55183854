"""A crash leaves nothing that outlives it, and a start never destroys what is not its own.

Real `kvalloc serve` processes: one killed with SIGKILL (no cleanup runs) leaves its segments
until the next service starts and removes them; a live service's segments survive that start;
a regular file where a socket should go is refused and left as it was."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from kvalloc.server.client import Client
from kvalloc.server.contract.addresses import claim_socket_path
from kvalloc.server.contract.errors import NotASocket
from kvalloc.server.contract.sharing import (
    OWNER_SUFFIX,
    SHM_DIR,
    TensorExporter,
    reap_dead_instances,
)
from kvalloc.server.devtools.launch import ServiceProcess

SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4",
              "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
              "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "64")


def segments(epoch: int | None) -> list[Path]:
    assert epoch is not None
    return sorted(SHM_DIR.glob(f"kvalloc-{epoch:016x}[-.]*"))


def test_a_killed_service_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    dead = ServiceProcess(tmp_path / "dead", *SMALL_POOL)
    live = ServiceProcess(tmp_path / "live", *SMALL_POOL)
    for svc in (dead, live):
        svc.workdir.mkdir()
        svc.start()
        with Client(svc.ipc, worker_id="w") as client:
            client.register()  # a staging segment too
    try:
        assert dead.proc is not None
        dead.proc.kill()  # SIGKILL: no finalizer, no cleanup
        dead.proc.wait()
        left = segments(dead.epoch)
        assert {p.name.rsplit("-", 1)[-1] for p in left} >= {"kv", "block_table", "w"}
        mine = segments(live.epoch)
        with ServiceProcess(tmp_path / "dead", *SMALL_POOL) as restarted:  # same addresses
            assert not any(p.exists() for p in left)
            assert segments(live.epoch) == mine  # a live instance is never touched
            assert "shared-memory segments of dead instances" in restarted.log()
            with Client(live.ipc, worker_id="w") as client:
                assert client.get_pool().workers[0].worker_id == "w"
    finally:
        live.stop()
        dead.kill()  # in case the test failed before the restart removed them


def test_an_exporter_holds_its_segments_until_its_process_dies() -> None:
    """In one process: a live exporter's owner file cannot be reaped; once closed, nothing is
    left to reap."""
    exporter = TensorExporter(prefix="kvalloc-00000000000000aa")
    try:
        exporter.empty("kv", (4,), torch.int32, torch.device("cpu"))
        owner = SHM_DIR / f"kvalloc-00000000000000aa{OWNER_SUFFIX}"
        assert owner.exists() and f"pid {os.getpid()} start " in owner.read_text()
        reap_dead_instances()
        assert (SHM_DIR / "kvalloc-00000000000000aa-kv").exists()
    finally:
        exporter.close()
    assert not list(SHM_DIR.glob("kvalloc-00000000000000aa*"))


@pytest.mark.parametrize("flag", ["--uds", "--ipc"])
def test_a_regular_file_at_a_socket_path_is_refused_and_kept(tmp_path: Path, flag: str) -> None:
    victim = tmp_path / "precious"
    victim.write_text("do not delete")
    target = str(victim) if flag == "--uds" else f"ipc://{victim}"
    svc = ServiceProcess(tmp_path, *SMALL_POOL, flag, target)
    with pytest.raises(RuntimeError, match="exited with 1"):
        svc.start()
    assert f"{victim} exists and is not a socket" in svc.log()
    assert victim.read_text() == "do not delete"


def test_claim_socket_path_removes_only_a_stale_socket(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(stale))
    claim_socket_path(stale)
    assert not stale.exists()
    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(live))
        sock.listen(1)
        with pytest.raises(OSError, match="in use"):
            claim_socket_path(live)
    link = tmp_path / "link.sock"
    link.symlink_to(tmp_path / "elsewhere")
    directory = tmp_path / "dir.sock"
    directory.mkdir()
    for path in (link, directory):
        with pytest.raises(NotASocket):
            claim_socket_path(path)
        assert path.is_symlink() or path.is_dir()
