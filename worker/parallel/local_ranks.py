"""N local processes of one function, each a rank of one torch.distributed process group: how
the tests, and a tensor-parallel worker on one host, start their ranks.

`run_local_ranks(fn, world, *args)` spawns ``world`` fresh interpreters (spawn, not fork: a
forked torch whose threads were running can hang), joins them in a process group (gloo on CPU;
NCCL with GPU ``rank`` for rank ``rank``) through a rendezvous file in a directory of the run's
own, so runs in parallel never meet, and calls ``fn(rank, world, *args)`` in each. It returns
what the ranks returned, in rank order. ``fn`` must be a module-level function; its arguments
and results must pickle.

A run may be asked to stop (``stop``, polled while the ranks run: a first Ctrl-C's flag, say):
then every rank's ``stop`` keyword reads true, and how the ranks agree on where they stop is
theirs (a tensor-parallel worker's scheduling rank decides, `worker.shard_client`). Such ranks
ignore SIGINT, which a terminal sends to every process of the job: their parent takes it.

Nothing outlives a run. A child gets SIGKILL when its parent dies (Linux's parent-death
signal). The first rank to fail, or a run past ``timeout_s``, ends the others (a rank blocked
in a collective with a dead peer would wait for the group's own timeout), and the failure
surfaces as `RankFailed` naming the rank, with the child's traceback text (none for an error
the worker raises on purpose, a `WorkerError`: its message says what was wrong). Results travel as
files in the run's directory, which is removed: a multiprocessing queue would hand tensors over
through shared memory, and a pipe fills up while the parent waits for the exit.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from kvalloc.worker.errors import EngineError, RankFailed, WorkerError

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.05  # how often the parent looks at its stop (how soon a stop reaches the ranks)


@dataclass(frozen=True)
class _Job:
    """What a child needs to become rank ``rank``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    rank: int
    world: int
    backend: str
    run_dir: str
    timeout_s: float
    parent_pid: int
    stop: Any = None  # a multiprocessing Event the parent sets, when the run may be stopped


@dataclass(frozen=True)
class _Outcome:
    """What a rank leaves in its result file."""

    value: Any  # fn's result, or "Type: message" of what it raised
    child_traceback: str  # empty for a result
    at: float  # time.time() when written: of several failed ranks, the first is the cause


def run_local_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 600.0,
                    stop: Callable[[], bool] | None = None) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each in its own process,
    all in one process group of ``backend``; `RankFailed` if any rank fails or the whole run
    takes longer than ``timeout_s``. With ``stop``, each rank is called with a ``stop``
    keyword too: a callable that reads true once ``stop()`` has."""
    if world < 1:
        raise EngineError(f"world: {world} ranks; a run needs at least 1")
    _check_pickles(fn, args)
    context = multiprocessing.get_context("spawn")
    event = context.Event() if stop is not None else None  # stop(), as the ranks see it
    with tempfile.TemporaryDirectory(prefix="kvalloc-ranks-") as run_dir:
        procs = [context.Process(
            target=_rank_main, name=f"kvalloc-rank-{rank}",
            args=(_Job(fn, args, rank, world, backend, run_dir, timeout_s, os.getpid(),
                       event),))
            for rank in range(world)]
        try:
            for proc in procs:
                proc.start()
            _wait_for_all(procs, Path(run_dir), time.monotonic() + timeout_s, timeout_s,
                          stop, event)
            return [_read_outcome(Path(run_dir), rank).value for rank in range(world)]
        finally:
            _end(procs)


def _check_pickles(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Here, not in ``Process.start``: that would raise with some ranks already started."""
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise EngineError(f"fn: {fn!r} and its arguments must pickle (a module-level function "
                          f"and plain values): {exc}") from None


def _wait_for_all(procs: list[BaseProcess], run_dir: Path, deadline: float, timeout_s: float,
                  stop: Callable[[], bool] | None, event: Any) -> None:
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while running:
        ready = wait(list(running), timeout=min(max(0.0, deadline - time.monotonic()), _POLL_S))
        if stop is not None and not event.is_set() and stop():
            event.set()
        if not ready and time.monotonic() < deadline:
            continue
        if not ready:
            late = sorted(running.values())
            raise RankFailed(f"rank {late[0]}: ranks {late} still running after {timeout_s} s",
                             rank=late[0])
        exited = [running.pop(sentinel) for sentinel in ready]
        failed = [rank for rank in exited if _exit_code(procs[rank]) != 0]
        if failed:
            raise _failure(procs, run_dir, failed)


def _exit_code(proc: BaseProcess) -> int:
    proc.join()  # its sentinel is ready: it has exited, this only reaps it
    return proc.exitcode or 0


def _failure(procs: list[BaseProcess], run_dir: Path, failed: list[int]) -> RankFailed:
    """The failure of the rank most likely to have failed first among those that ended
    together: one that died without a word (a crash, which its peers' errors in their
    collectives follow), else the one that raised first. The others are named after it."""
    outcomes = {rank: _read_outcome(run_dir, rank) for rank in failed
                if (run_dir / f"rank-{rank}").exists()}
    rank = min(failed, key=lambda r: (r in outcomes, outcomes[r].at if r in outcomes else 0))
    others = f" (ranks {sorted(set(failed) - {rank})} failed too)" if len(failed) > 1 else ""
    world = len(procs)
    if rank not in outcomes:
        code = procs[rank].exitcode or 0
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return RankFailed(f"rank {rank} of {world} {how}{others}", rank=rank)
    outcome = outcomes[rank]
    trace = f"\nits traceback:\n{outcome.child_traceback}" if outcome.child_traceback else ""
    return RankFailed(f"rank {rank} of {world} raised {outcome.value}{others}{trace}",
                      rank=rank, child_traceback=outcome.child_traceback)


def _end(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join()


def _rank_main(job: _Job) -> None:
    _die_with_parent(job.parent_pid)
    if job.stop is not None:  # the parent turns Ctrl-C into the stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _join_group(job)
        stop = {"stop": job.stop.is_set} if job.stop is not None else {}
        result = job.fn(job.rank, job.world, *job.args, **stop)
        dist.destroy_process_group()
        # Last: once a result is written, nothing is left that could fail the rank.
        _write_outcome(job, _Outcome(result, "", time.time()))
    except BaseException as exc:  # KeyboardInterrupt too: whatever ends fn reaches the parent
        # An error the worker raises on purpose names what was wrong in its message: its
        # traceback would bury that line under the rank's frames.
        trace = "" if isinstance(exc, WorkerError) else traceback.format_exc()
        _write_outcome(job, _Outcome(f"{type(exc).__name__}: {exc}", trace, time.time()))
        sys.exit(1)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _join_group(job: _Job) -> None:
    if job.backend == "nccl":
        torch.cuda.set_device(job.rank)
    else:
        # The ranks share the host's cores: torch's default of one thread per core in each
        # would oversubscribe them world times.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.world))
    dist.init_process_group(job.backend, init_method=f"file://{job.run_dir}/rendezvous",
                            rank=job.rank, world_size=job.world,
                            timeout=timedelta(seconds=job.timeout_s))


def _write_outcome(job: _Job, outcome: _Outcome) -> None:
    """Whole or not at all: the parent may read it the moment this process exits."""
    data = pickle.dumps(outcome)  # first: a result that does not pickle is the rank's error
    path = Path(job.run_dir) / f"rank-{job.rank}"
    path.with_suffix(".partial").write_bytes(data)
    path.with_suffix(".partial").replace(path)


def _read_outcome(run_dir: Path, rank: int) -> _Outcome:
    return pickle.loads((run_dir / f"rank-{rank}").read_bytes())
