"""A real `kvalloc serve`'s first start, with nothing compiled (an empty numba cache, as on a
fresh install): a stop signal during it ends the service at once, with the graceful stop's
status, no traceback and no shared memory left; and a compile that outlasts the service's lease
neither fails the warm-up nor logs an error, and says what it is doing before it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from kvalloc.server.client import Client
from kvalloc.server.contract.sharing import OWNER_SUFFIX, SHM_DIR
from kvalloc.server.devtools.launch import ServiceProcess, kvalloc_command

SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4",
              "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
              "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "64")
COMPILE_TIMEOUT_S = 300.0  # compiling every loop from nothing, at start, on a loaded machine
# A stop during the start takes what a graceful stop takes (about 1 s on a quiet two-core
# machine, as `ServiceProcess.stop` measured), after whatever C call the signal lands in: Python
# runs its handler between bytecodes, and compiling the step is one LLVM call of tens of seconds
# on a loaded machine (a stop waited past 60 s once under a full test run). An unheeded stop
# never ends (the service serves), so any bound that covers a whole compile tells the two apart.
STOP_TIMEOUT_S = COMPILE_TIMEOUT_S


def owned_by(pid: int, since: float = 0.0) -> list[Path]:
    """The owner files of the shared-memory exporters process ``pid`` created (written at or
    after ``since``, a `time.time()`: a killed process of an earlier test may have left one
    under a pid the system has since given to this one)."""
    owners = []
    for owner in SHM_DIR.glob(f"kvalloc-*{OWNER_SUFFIX}"):
        try:
            if (owner.read_text().startswith(f"pid {pid} ")
                    and owner.stat().st_mtime >= since):
                owners.append(owner)
        except OSError:  # removed meanwhile
            pass
    return owners


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_the_first_start_stops_it(tmp_path: Path, signum: int) -> None:
    """The signal lands once the warm-up's throwaway pool exists (its owner file, with the
    service's pid, is the sign), long before its compile ends: the service exits with the
    graceful stop's status, logs no error or traceback, never serves, and every segment of
    that pool is gone."""
    cmd = [*kvalloc_command(), "serve", "--no-tcp", "--uds", str(tmp_path / "rest.sock"),
           "--ipc", f"stream://{tmp_path / 'kvalloc.stream'}", *SMALL_POOL]
    log_path = tmp_path / "serve.log"
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    spawned = time.time() - 1.0  # the file system's clock may round down
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    try:
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        while not (owners := owned_by(proc.pid, spawned)):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        proc.send_signal(signum)
        status = proc.wait(STOP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    assert status == 0, out
    assert "Traceback" not in out and " ERROR " not in out, out
    assert "serving REST" not in out, out
    assert f"stopping on {signal.Signals(signum).name}" in out, out
    for owner in owners:
        prefix = owner.name.removesuffix(OWNER_SUFFIX)
        assert not list(SHM_DIR.glob(f"{prefix}[-.]*")), prefix
    assert owned_by(proc.pid, spawned) == []


def test_a_first_start_slower_than_the_lease_logs_no_error_and_serves(tmp_path: Path) -> None:
    """A 1 s lease against a compile of many seconds between the warm-up's calls: the log says
    it is compiling, then that it compiled, with no ERROR; and the service answers."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    with ServiceProcess(tmp_path, *SMALL_POOL, "--lease-ttl-s", "1", env=env,
                        ready_timeout_s=COMPILE_TIMEOUT_S, tcp=False) as svc:
        out = svc.log()
        assert " ERROR " not in out and "Traceback" not in out, out
        assert out.index("compiling the step") < out.index("compiled the step"), out
        # What it serves is read without a lease: a 1 s one is shorter than a loaded machine's
        # pause between two calls.
        with Client(svc.stream, worker_id="first") as client:
            assert client.get_pool(verify=True).invariants == "ok"
