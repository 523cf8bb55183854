"""`ServiceProcess`, the launcher the tests start real services with: its default grace for a
graceful stop scales with how long the service took to start, so a stop on a loaded machine is
not cut short by SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kvalloc.server.devtools.launch import ServiceProcess

# Exits 0 on SIGTERM, but only after `seconds` of cleanup: a graceful stop on a slow machine.
SLOW_STOP = """
import signal, sys, time
seconds = float(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(seconds), sys.exit(0)))
print("ready", flush=True)
time.sleep(600)
"""


def test_the_default_grace_outlasts_a_slow_stop_after_a_slow_start(tmp_path: Path) -> None:
    """A stop that takes 12 s (more than the 10 s floor) after a start that took 2 s: the grace
    is ten starts, so the stop completes with status 0 instead of being killed."""
    svc = ServiceProcess(tmp_path, tcp=False)
    svc.proc = subprocess.Popen([sys.executable, "-c", SLOW_STOP, "12"], stdout=subprocess.PIPE)
    try:
        assert svc.proc.stdout is not None and svc.proc.stdout.readline() == b"ready\n"
        svc.started_in_s = 2.0
        began = time.monotonic()
        assert svc.stop() == 0
        assert time.monotonic() - began >= 12
    finally:
        svc.proc.kill()
        svc.proc.wait()
