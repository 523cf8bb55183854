"""Ctrl-C a real command once it is under way, as a user at a terminal would.

The command's stderr is a terminal (a pty), so its progress bar draws there; SIGINT goes once
the bar shows that steps have run, which is after the command installed its handler (the bar
starts inside the loop). The pty is drained all along, so a chatty bar never blocks the command.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import threading
import time
from dataclasses import dataclass


@dataclass
class Interrupted:
    returncode: int
    stdout: str
    stderr: str  # everything the command wrote to its terminal, bar included
    seconds_to_progress: float  # from start to the first drawn progress
    pid: int  # the command's process id


def interrupt_once_progressing(command: list[str], progress: str, *, timeout_s: float,
                               whole_job: bool = False,
                               signum: int = signal.SIGINT) -> Interrupted:
    """Run ``command``, SIGINT it (or ``signum``) once its terminal output matches the regex
    ``progress``, and wait for it to exit. Each wait is bounded by ``timeout_s``. ``whole_job``:
    the signal goes to the command's whole process group, children too, as a terminal's Ctrl-C
    does."""
    primary, secondary = pty.openpty()
    # A fresh pty is 0 columns wide, and tqdm cuts its bar to the width: give it a terminal's.
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=secondary, text=True, start_new_session=whole_job)
    os.close(secondary)
    terminal: list[bytes] = []
    drain = threading.Thread(target=_drain, args=(primary, terminal), daemon=True)
    drain.start()
    started = time.monotonic()
    try:
        while not re.search(progress, b"".join(terminal).decode(errors="replace")):
            if proc.poll() is not None or time.monotonic() - started > timeout_s:
                raise AssertionError(f"no progress matching {progress!r} in {timeout_s}s: "
                                     f"{b''.join(terminal).decode(errors='replace')[-2000:]}")
            time.sleep(0.05)
        seconds = time.monotonic() - started
        if whole_job:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        stdout, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    drain.join(timeout_s)
    return Interrupted(proc.returncode, stdout,
                       b"".join(terminal).decode(errors="replace"), seconds, proc.pid)


def _drain(fd: int, into: list[bytes]) -> None:
    """Read the pty until every writer is gone (read then fails with EIO)."""
    try:
        while chunk := os.read(fd, 65536):
            into.append(chunk)
    except OSError:
        pass
    finally:
        os.close(fd)
