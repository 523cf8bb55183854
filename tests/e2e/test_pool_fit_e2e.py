"""A typo in the pool size refuses to start instead of taking the host down: a real
`kvalloc serve` asked for twice the memory free where its pool lives exits 2 at once, its message
naming the size, what is free and the flag, and leaves nothing in /dev/shm. (Its address space is
capped, so that a service that did try would fail on its own instead of stalling the host.)"""

from __future__ import annotations

import functools
import os
import resource
import subprocess
from pathlib import Path

import pytest
import torch
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.devtools.launch import kvalloc_command
from kvalloc.server.service.footprint import free_memory
from kvalloc.server.service.settings import default_pool

ADDRESS_SPACE = 16 << 30  # far above what a service of the default shape maps, far below a TiB
START_TIMEOUT_S = 120  # imports and the check, on a loaded 2-core machine; nothing is compiled


def cap_address_space(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def owner_files_of(pid: int) -> list[Path]:
    """The owner files (live or left behind) of kvalloc services started as ``pid``."""
    return [p for p in SHM_DIR.glob("*kvalloc-*") if f"pid {pid} " in _text(p)
            or p.name.endswith(f".{pid}")]


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace") if path.suffix == ".owner" else ""
    except OSError:
        return ""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_pool_twice_the_free_memory_exits_2_naming_size_free_and_flag(
        tmp_path: Path, device: str) -> None:
    block = default_pool(device=device).bytes_per_block
    blocks = 2 * min(n for _, n in free_memory(torch.device(device))) // block
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with subprocess.Popen(
            [*kvalloc_command(), "serve", "--device", device, "--num-blocks", str(blocks),
             "--port", "0"], env={**os.environ, "XDG_RUNTIME_DIR": str(run)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=functools.partial(cap_address_space, ADDRESS_SPACE) if device == "cpu"
            else None) as proc:
        out, message = proc.communicate(timeout=START_TIMEOUT_S)
    assert proc.returncode == 2, out + message
    assert f"--num-blocks {blocks}" in message and "lower --num-blocks" in message
    assert ("free in /dev/shm" if device == "cpu" else f"free on {device}") in message
    assert "Traceback" not in message
    assert owner_files_of(proc.pid) == []
