"""What the launcher's tests have their ranks do: answer, raise, die, never end or wait for
the run's stop. Each writes
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
    """Every rank's pid is on disk before any rank goes on (to fail, say)."""
    path = Path(pid_dir) / f"rank-{rank}.pid"
    path.with_suffix(".partial").write_text(str(os.getpid()))
    path.with_suffix(".partial").replace(path)  # whole or absent: a test polls for it
    dist.barrier()


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


def answer_unpicklable(rank: int, world: int, pid_dir: str) -> object:
    """A result that cannot travel back to the parent."""
    _started(pid_dir, rank)
    return lambda: rank


def until_stopped(rank: int, world: int, pid_dir: str, *, stop: object) -> tuple[int, bool]:
    """Wait for the run's stop, ignoring SIGINT meanwhile (a terminal's Ctrl-C reaches it
    too); then say so, with the SIGINT handler the rank had."""
    _started(pid_dir, rank)
    os.kill(os.getpid(), signal.SIGINT)  # ignored: the parent takes Ctrl-C for the ranks
    while not stop():  # type: ignore[operator]
        time.sleep(0.01)
    return rank, signal.getsignal(signal.SIGINT) == signal.SIG_IGN
