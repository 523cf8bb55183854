"""Shared memory is promised once: two real `kvalloc serve` processes on one small tmpfs
(``KVALLOC_SHM_DIR``) cannot both count the same free bytes.

Each service's start check counts its pool, tables and every worker's staging against what is
free, and each segment is backed by pages when it is made. So when the services and their
workers together ask for more than the tmpfs holds, a worker process's registration is refused
(507 ``insufficient_memory``, naming the bytes needed and free) instead of the worker dying with
SIGBUS when it writes its staging; and of two services that do not both fit, one starts and the
other exits 2 with one line, leaving nothing in the directory.

Mounting a tmpfs needs root (CI runs as root); without it the tests that need one skip, saying
so, and `tests/server/service/test_memory_backing.py` covers the refusal without a mount. A
``KVALLOC_SHM_DIR`` that is not an absolute path to a directory is refused at start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvalloc.server.contract.sharing import SHM_DIR_ENV
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command

SUPPORT = Path(__file__).resolve().parents[1] / "support"
MIB = 1 << 20
# float32, 2 layers x 2 heads x 64: 2 KiB a token of K/V. A block of 16 tokens is 32 KiB;
# a worker's staging of 4096 tokens is 8 MiB.
SHAPE = ("--device", "cpu", "--dtype", "float32", "--num-layers", "2", "--num-kv-heads", "2",
         "--head-dim", "64", "--tokens-per-block", "16", "--max-batch-size", "8",
         "--max-seq-len", "256", "--max-draft-len", "3", "--max-step-tokens", "4096",
         "--lease-ttl-s", "3600")
STAGING_BYTES = 8 * MIB
# A start imports torch and compiles the step: 20-40 s on a loaded two-core machine.
READY_TIMEOUT_S = 240.0
# A worker process imports torch and the client (8 s alone on a loaded two-core machine; six
# at once share two cores), then registers and writes 8 MiB.
WORKER_TIMEOUT_S = 300.0


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs of its own, unmounted after the test."""
    mount = tmp_path / "shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=1777", "tmpfs",
                           str(mount)], capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"mounting a tmpfs was refused (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def free_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def start_worker(address: str, worker_id: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(SUPPORT / "staging_writer.py"), address,
                             worker_id], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_workers_beyond_what_the_tmpfs_holds_are_refused_not_killed(
        tmp_path: Path, small_tmpfs: Path) -> None:
    """Both services pass their start checks (each needs its 4 MiB pool and 3 x 8 MiB of
    staging, 28 MiB, of 40 free); their six workers' staging (48 MiB) does not fit beside the
    pools. Registered one at a time, exactly as many as the free bytes hold get their staging;
    every other one is refused with 507, and none dies."""
    env = {**os.environ, SHM_DIR_ENV: str(small_tmpfs)}
    services = [ServiceProcess(tmp_path / name, *SHAPE, "--num-blocks", "128", "--max-workers",
                               "3", env=env, ready_timeout_s=READY_TIMEOUT_S, tcp=False)
                for name in ("a", "b")]
    workers: list[subprocess.Popen[str]] = []
    try:
        for svc in services:
            svc.workdir.mkdir()
            svc.start()
        holds = free_bytes(small_tmpfs) // STAGING_BYTES
        assert 0 < holds < 6, "the mount must hold some of the workers' staging, not all"
        workers = [start_worker(svc.stream, f"w{i}", env)
                   for svc in services for i in range(3)]
        lines = []
        for worker in workers:  # one registration at a time: which ones fit is then exact
            worker.stdin.write("register\n")  # type: ignore[union-attr]
            worker.stdin.flush()  # type: ignore[union-attr]
            lines.append(worker.stdout.readline().strip())  # type: ignore[union-attr]
        for worker in workers:
            worker.stdin.close()  # type: ignore[union-attr]
        codes = [w.wait(WORKER_TIMEOUT_S) for w in workers]
        errors = [w.stderr.read() for w in workers]  # type: ignore[union-attr]
        assert all(code in (0, 3) for code in codes), (codes, lines, errors)
        assert lines.count("written") == holds, lines
        refused = [line for line in lines if line != "written"]
        for line in refused:
            assert line.startswith("refused 507 insufficient_memory: shm: the segment "), line
            assert f"needs {STAGING_BYTES} bytes in {small_tmpfs}" in line
            assert "bytes free" in line
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for svc in services:
            svc.stop()
    assert list(small_tmpfs.iterdir()) == []  # every segment and owner file gone


def test_of_two_services_that_do_not_both_fit_one_exits_2_leaving_nothing(
        tmp_path: Path, small_tmpfs: Path) -> None:
    """Two services of a 24 MiB pool each (and one 8 MiB staging buffer) start at once on 40
    MiB: each fits alone. Whichever comes second is refused with exit status 2 and one line,
    by its start check if the first one's pool was already there, else when its own pool cannot
    be backed; the first serves. Neither dies any other way."""
    env = {**os.environ, SHM_DIR_ENV: str(small_tmpfs), "XDG_RUNTIME_DIR": str(tmp_path)}
    procs, probes = [], []
    for name in ("a", "b"):
        probe = ServiceProcess(tmp_path / name, tcp=False)  # its paths, to ask /readyz
        probe.workdir.mkdir()
        procs.append(subprocess.Popen(
            [*kvalloc_command(), "serve", *SHAPE, "--num-blocks", "768", "--max-workers", "1",
             "--no-tcp", "--uds", str(probe.uds), "--ipc", probe.stream],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        probes.append(probe)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not any(p.poll() is not None for p in procs):
            assert not all(probe.ready() for probe in probes), "both services started"
            assert time.monotonic() < deadline, "neither service exited"
            time.sleep(0.2)
        refused, serving = (0, 1) if procs[0].poll() is not None else (1, 0)
        out = procs[refused].stdout.read()  # type: ignore[union-attr]
        assert procs[refused].returncode == 2, out
        errors = [line for line in out.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "Traceback" not in out, out
        assert (f"free in {small_tmpfs}" in errors[0]  # refused by the start check
                or ("needs" in errors[0] and "bytes free" in errors[0])), errors[0]
        # The other serves, unless its pool was being backed at the very moment the refused one's
        # was too (two allocations that overlap may both fall short): then it is refused alike.
        while not probes[serving].ready() and procs[serving].poll() is None:
            assert time.monotonic() < deadline, "the other service neither served nor exited"
            time.sleep(0.2)
        if procs[serving].poll() is not None:
            assert procs[serving].returncode == 2, procs[serving].stdout.read()  # type: ignore
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(READY_TIMEOUT_S)
    assert list(small_tmpfs.iterdir()) == []


@pytest.mark.parametrize("value, says", [("relative/shm", "is not an absolute path"),
                                         ("/nonexistent/kvalloc-shm", "is not a directory")])
def test_a_shm_dir_that_cannot_hold_segments_is_refused_at_start(tmp_path: Path, value: str,
                                                                 says: str) -> None:
    done = subprocess.run([*kvalloc_command(), "serve", "--no-tcp", "--ipc",
                           f"stream://{tmp_path / 'kvalloc.stream'}"],
                          env={**os.environ, SHM_DIR_ENV: value}, capture_output=True, text=True,
                          timeout=READY_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"kvalloc serve: error: {SHM_DIR_ENV}: " + (
        f"{value!r} {says}; workers must find the same directory" if value.startswith("r")
        else f"{value} {says}")
    assert not (tmp_path / "relative").exists()
