"""Ctrl-C as "stop at the next step boundary", for the commands that run steps in a loop.

A KeyboardInterrupt raised wherever the signal lands can cut a call to the service in half (a
request sent, its reply never read), after which the client cannot deregister and the worker's
blocks wait for its lease. So the first SIGINT only sets a flag that the loop reads between
steps: the step in progress completes, the command deregisters, prints what it did so far and
exits `INTERRUPTED` (128 + SIGINT, what a shell reports for a process Ctrl-C stopped). A second
SIGINT is a KeyboardInterrupt at once, for a step that does not come back. A command may have
SIGTERM stop it the same way (its status then 128 + SIGTERM).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

INTERRUPTED = 128 + signal.SIGINT


@dataclass
class StopRequest:
    """Set by the first stop signal; read by a loop between its steps."""

    requested: bool = False
    signum: int = signal.SIGINT  # the signal that set it

    def __call__(self) -> bool:
        return self.requested

    @property
    def status(self) -> int:
        """The exit status a shell reports for a process that signal stopped: 128 + it."""
        return 128 + self.signum


@contextlib.contextmanager
def sigint_stops(signals: tuple[int, ...] = (signal.SIGINT,)) -> Iterator[StopRequest]:
    """Inside: the first of ``signals`` (SIGINT unless told; a command that holds shared
    memory adds SIGTERM, whose default would end it without its cleanup) sets the yielded flag
    instead of raising; a second is a KeyboardInterrupt. Off the main thread (where Python
    takes no signals) the flag simply never sets."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def first_signal(signum: int, _frame: FrameType | None) -> None:
        stop.requested, stop.signum = True, signum
        for sig in signals:
            signal.signal(sig, signal.default_int_handler)

    previous = {sig: signal.signal(sig, first_signal) for sig in signals}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
