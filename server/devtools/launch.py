"""`ServiceProcess`: ``kvalloc serve`` in a subprocess, for tests, benchmarks and load generation.

    with ServiceProcess(tmp_path, "--num-blocks", "256") as svc:
        client = Client(svc.ipc)          # or svc.stream, svc.rest_unix, svc.rest_tcp

It listens on a free loopback port, a Unix socket, and ``ipc://`` and ``stream://`` paths under
``workdir``, and ``start`` returns once ``/readyz`` answers. Leaving the ``with`` block stops it
(SIGTERM, then SIGKILL after a grace period); and on Linux the service also receives SIGTERM if
the thread that started it dies, so no process outlives its owner. Its log is
``workdir/serve.log``.
"""

from __future__ import annotations

import ctypes
import functools
import http.client
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvalloc.server.contract.sharing import SHM_DIR


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kvalloc_command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = shutil.which("kvalloc", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "kvalloc.server.cli"]


class ServiceProcess:
    def __init__(self, workdir: Path, *args: str, env: dict[str, str] | None = None,
                 tcp: bool = True, ready_timeout_s: float = 60.0,
                 nofile: tuple[int, int] | None = None, default_ipc: bool = False) -> None:
        """``default_ipc``: serve IPC where the service does unless told (under the
        ``XDG_RUNTIME_DIR`` of ``env``) instead of on ``ipc`` and ``stream`` in ``workdir``."""
        self.workdir = Path(workdir)
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.port = free_port() if tcp else None
        self.uds = self.workdir / "rest.sock"
        self.ipc = f"ipc://{self.workdir / 'kvalloc.ipc'}"
        self.stream = f"stream://{self.workdir / 'kvalloc.stream'}"
        self.log_path = self.workdir / "serve.log"
        self.ready_timeout_s = ready_timeout_s
        self.nofile = nofile  # RLIMIT_NOFILE (soft, hard) for the service, e.g. to exhaust it
        self.default_ipc = default_ipc
        self.proc: subprocess.Popen[bytes] | None = None
        self.epoch: int | None = None
        self.started_in_s: float | None = None  # from spawn to ready, at the last start

    @property
    def rest_unix(self) -> str:
        return f"unix://{self.uds}"

    @property
    def rest_tcp(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        listen = ["--port", str(self.port)] if self.port is not None else ["--no-tcp"]
        ipc = [] if self.default_ipc else ["--ipc", self.ipc, "--ipc", self.stream]
        cmd = [*kvalloc_command(), "serve", "--uds", str(self.uds), *ipc, *listen, *self.args]
        spawned = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=functools.partial(_prepare_child,
                                                                      self.nofile))
        self._wait_ready()
        self.started_in_s = time.monotonic() - spawned
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvalloc serve exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            if self.ready():
                return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"kvalloc serve not ready after {self.ready_timeout_s}s:\n{self.log()}")

    def ready(self) -> bool:
        """``GET /readyz`` over the Unix socket answers 200 (and tells the service's epoch)."""
        conn = _UnixHTTPConnection(str(self.uds), timeout=2.0)
        try:
            conn.request("GET", "/readyz")
            resp = conn.getresponse()
            if resp.status != 200:
                return False
            self.epoch = int(json.loads(resp.read())["epoch"])
            return True
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within ``grace_s``; the exit status.

        By default the grace scales with how long the start took: a graceful stop (calls in
        flight, sockets, segments) took about half a start, 1 s against 2-3 s on a quiet
        two-core machine, and both stretch alike when the machine is loaded; so ten starts, and
        never under 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        if grace_s is None:
            grace_s = max(10.0, 10 * (self.started_in_s or 0.0))
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would; then remove the shared memory the service left behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.epoch is not None:
            for leftover in SHM_DIR.glob(f"kvalloc-{self.epoch:016x}[-.]*"):  # segments, owner
                leftover.unlink(missing_ok=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _prepare_child(nofile: tuple[int, int] | None) -> None:
    """In the child, before exec: its descriptor limit, if given; and on Linux, SIGTERM it when
    the thread that started it dies, so a killed test run (even SIGKILL) leaves no service
    behind."""
    if nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)
