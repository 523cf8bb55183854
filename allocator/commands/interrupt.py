"""Ctrl-C as "stop at the next step boundary", for the commands that run steps in a loop.

A KeyboardInterrupt raised wherever the signal lands can cut a call to the service in half (a
request sent, its reply never read), after which the client cannot deregister and the worker's
blocks wait for its lease. So the first SIGINT only sets a flag that the loop reads between
steps: the step in progress completes, the command deregisters, prints what it did so far and
exits `INTERRUPTED` (128 + SIGINT, what a shell reports for a process Ctrl-C stopped). A second
SIGINT is a KeyboardInterrupt at once, for a step that does not come back.
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
    """Set by the first SIGINT; read by a loop between its steps."""

    requested: bool = False

    def __call__(self) -> bool:
        return self.requested


@contextlib.contextmanager
def sigint_stops() -> Iterator[StopRequest]:
    """Inside: the first SIGINT sets the yielded flag instead of raising. Off the main thread
    (where Python takes no signals) the flag simply never sets."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def first_sigint(_signum: int, _frame: FrameType | None) -> None:
        stop.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, first_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
