"""What the launcher's tests have their ranks do: answer, raise, die or never end. Each writes
its pid to ``pid_dir`` first, so a test can tell the process is gone afterwards.

The ranks import this module by name (spawned children get the parent's ``sys.path``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _started(pid_dir: str, rank: int) -> None:
    path = Path(pid_dir) / f"rank-{rank}.pid"
    path.with_suffix(".partial").write_text(str(os.getpid()))
    path.with_suffix(".partial").replace(path)  # whole or absent: the test polls for it


def answer(rank: int, world: int, pid_dir: str, tag: str) -> tuple[int, int, str, int]:
    """Who the group says this rank is, and the sum of every rank's number over the group."""
    _started(pid_dir, rank)
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), tag, int(total)


def raise_on_rank(rank: int, world: int, pid_dir: str, failing: int) -> None:
    """Rank ``failing`` raises; the others wait for it in a collective that never completes."""
    _started(pid_dir, rank)
    if rank == failing:
        raise ValueError(f"rank {rank} refuses the step")
    dist.barrier()


def die_on_rank(rank: int, world: int, pid_dir: str, failing: int, how: str) -> None:
    """Rank ``failing`` ends without a Python exception: ``how`` is ``"exit"`` (code 3) or
    ``"kill"`` (SIGKILL); the others wait for it."""
    _started(pid_dir, rank)
    if rank == failing:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def never_end(rank: int, world: int, pid_dir: str) -> None:
    _started(pid_dir, rank)
    while True:
        time.sleep(3600)
