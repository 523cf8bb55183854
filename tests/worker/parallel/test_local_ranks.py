"""`run_local_ranks` with real processes: the ranks meet in one gloo group and their results
come back in rank order, also while another run goes on; a rank that raises, exits or is
killed is named in the parent's `RankFailed` (with the child's traceback when it raised) and
the ranks waiting on it are ended; so is a run past its time limit; killing the parent kills
the ranks; a stoppable run passes its stop on to every rank, which leaves SIGINT to it. After
every run the ranks are gone and the run's directory is removed.

Every time limit here is derived from how long a trivial run took in this session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvalloc.worker.errors import EngineError, RankFailed
from kvalloc.worker.parallel.local_ranks import run_local_ranks
from rank_behaviours import (
    answer,
    answer_unpicklable,
    die_on_rank,
    never_end,
    raise_on_rank,
    until_stopped,
)

WORLD = 2
# A trivial run of two ranks took 5-11 s on the loaded two-core machine, two at once 11-29 s;
# no test here waits for more than two runs' worth of starting ranks.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def run_dir_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where runs make their directory: it must be empty again after each run."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    yield parent
    assert list(parent.iterdir()) == []


@dataclass(frozen=True)
class TrivialRun:
    results: list[object]
    seconds: float  # from start to results: the base every time limit here is derived from
    pid_dir: Path
    left_behind: list[Path]  # what the run left where runs make their directories


@pytest.fixture(scope="module")
def trivial_run(tmp_path_factory: pytest.TempPathFactory) -> TrivialRun:
    pid_dir, temp = tmp_path_factory.mktemp("pids"), tmp_path_factory.mktemp("tmp")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        start = time.monotonic()
        results = run_local_ranks(answer, WORLD, str(pid_dir), "tag")
        seconds = time.monotonic() - start
    return TrivialRun(results, seconds, pid_dir, list(temp.iterdir()))


def _alive(pid: int) -> bool:
    """Not yet ended: a zombie (ended, its parent gone or not yet waiting) counts as ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _pids(pid_dir: Path) -> list[int]:
    return [int((pid_dir / f"rank-{rank}.pid").read_text()) for rank in range(WORLD)]


def _wait_until(condition: Callable[[], bool], limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} after {limit_s:.0f} s"
        time.sleep(0.05)


def test_results_come_back_in_rank_order(trivial_run: TrivialRun) -> None:
    assert trivial_run.results == [(0, WORLD, "tag", 3), (1, WORLD, "tag", 3)]
    assert not any(_alive(pid) for pid in _pids(trivial_run.pid_dir))
    assert trivial_run.left_behind == []


def test_a_rank_that_raises_is_named_with_its_traceback(tmp_path: Path,
                                                       run_dir_parent: Path) -> None:
    """Rank 1 raises while rank 0 waits for it in a barrier."""
    with pytest.raises(RankFailed) as caught:
        run_local_ranks(raise_on_rank, WORLD, str(tmp_path), 1)
    error = caught.value
    assert isinstance(error, EngineError)
    assert error.rank == 1
    assert str(error).startswith("rank 1 of 2 raised ValueError: rank 1 refuses the step\n")
    assert "in raise_on_rank" in error.child_traceback
    assert error.child_traceback in str(error)
    assert not any(_alive(pid) for pid in _pids(tmp_path))  # the waiting rank too


def test_a_stop_asked_of_the_parent_reaches_every_rank(tmp_path: Path,
                                                       run_dir_parent: Path) -> None:
    """The ranks wait for the stop (each SIGINTs itself first, which it ignores); the parent's
    flag turns true once both have started."""
    def asked() -> bool:
        return all((tmp_path / f"rank-{rank}.pid").exists() for rank in range(WORLD))

    assert run_local_ranks(until_stopped, WORLD, str(tmp_path), stop=asked) == [
        (rank, True) for rank in range(WORLD)]
    assert not any(_alive(pid) for pid in _pids(tmp_path))


def test_runs_at_the_same_time_never_meet(tmp_path: Path, run_dir_parent: Path) -> None:
    """Two runs of two ranks at once: each rank's group holds its own run's ranks only."""
    pid_dirs = [tmp_path / "first", tmp_path / "second"]
    for pid_dir in pid_dirs:
        pid_dir.mkdir()
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_local_ranks, answer, WORLD, str(pid_dir), pid_dir.name)
                for pid_dir in pid_dirs]
        results = [run.result() for run in runs]
    assert results == [[(rank, WORLD, tag, 3) for rank in range(WORLD)]
                       for tag in ("first", "second")]


@pytest.mark.parametrize(("how", "ending"), [("exit", "exited with code 3"),
                                             ("kill", "killed by signal 9")])
def test_a_rank_that_dies_is_named(tmp_path: Path, run_dir_parent: Path, how: str,
                                   ending: str) -> None:
    with pytest.raises(RankFailed, match=rf"^rank 1 of 2 {ending}$") as caught:
        run_local_ranks(die_on_rank, WORLD, str(tmp_path), 1, how)
    assert (caught.value.rank, caught.value.child_traceback) == (1, "")
    assert not any(_alive(pid) for pid in _pids(tmp_path))


def test_a_run_past_its_time_limit_is_ended(tmp_path: Path, run_dir_parent: Path,
                                            trivial_run: TrivialRun) -> None:
    """Ended wherever its ranks are when the time is up (starting, or in `never_end`): each
    rank is watched from its start, not from a pid it writes itself."""
    limit_s = round(trivial_run.seconds, 1)
    late = rf"^rank 0: ranks \[0, 1\] still running after {limit_s} s$"
    with _watching_ranks() as seen, pytest.raises(RankFailed, match=late):
        run_local_ranks(never_end, WORLD, str(tmp_path), timeout_s=limit_s)
    assert len(seen) == WORLD
    assert not any(_alive(pid) for pid in seen)


@contextmanager
def _watching_ranks() -> Iterator[set[int]]:
    """The pids of this process's spawned children (not its resource tracker), as they start."""
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            seen.update(_spawned_children())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()


def _spawned_children() -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(proc.joinpath("stat").read_text().rpartition(")")[2].split()[1])
            if ppid == os.getpid() and b"spawn_main" in proc.joinpath("cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError):  # it ended while being read
            continue
    return found


def test_the_ranks_die_with_their_parent(tmp_path: Path, trivial_run: TrivialRun) -> None:
    pid_dir, temp = tmp_path / "pids", tmp_path / "tmp"
    pid_dir.mkdir()
    temp.mkdir()
    program = ("import sys; from rank_behaviours import never_end; "
               "from worker.parallel.local_ranks import run_local_ranks; "
               "run_local_ranks(never_end, 2, sys.argv[1])")
    env = {**os.environ, "TMPDIR": str(temp),  # what a killed parent leaves is the test's
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    parent = subprocess.Popen([sys.executable, "-c", program, str(pid_dir)], env=env)
    try:
        _wait_until(lambda: len(list(pid_dir.glob("*.pid"))) == WORLD, 10 * trivial_run.seconds,
                    "the ranks have not started")
        pids = _pids(pid_dir)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        _wait_until(lambda: not any(_alive(pid) for pid in pids), 10 * trivial_run.seconds,
                    "ranks outlived their parent")
    finally:
        parent.kill()
        parent.wait()


def test_a_world_without_ranks_is_refused() -> None:
    with pytest.raises(EngineError, match=r"^world: 0 ranks; a run needs at least 1$"):
        run_local_ranks(answer, 0, "unused", "tag")


def test_a_function_that_cannot_reach_the_ranks_is_refused() -> None:
    """A lambda does not pickle, so no spawned rank could run it: refused before any starts."""
    with pytest.raises(EngineError, match=r"^fn: <function .*<lambda>.* must pickle"):
        run_local_ranks(lambda rank, world: rank, WORLD)


def test_a_result_that_cannot_come_back_is_its_ranks_error(tmp_path: Path,
                                                           run_dir_parent: Path) -> None:
    with pytest.raises(RankFailed, match=r"^rank [01] of 2 raised (PicklingError|"
                                         r"AttributeError): .*lambda") as caught:
        run_local_ranks(answer_unpicklable, WORLD, str(tmp_path))
    assert "_write_outcome" in caught.value.child_traceback
