"""`poll_for`: wait for something without sleeping, for a bounded time.

A thread blocked in the kernel costs a wake-up to resume: tens of microseconds where waking an
idle thread is slow (virtual machines, cores in deep idle states), on the waker's side and on its
own. Where the event is due soon, both IPC carriers ask for it in a loop first (the client for
its reply, a service with ``ipc_spin_s`` for a connection's next call), then block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def poll_for(ready: Callable[[], bool], seconds: float,
             stop: threading.Event | None = None) -> bool:
    """Call ``ready`` without sleeping until it returns True, for at most ``seconds`` (and not
    past ``stop`` being set); whether it did. ``ready`` should release the GIL (a system call
    does), or other threads wait out the interpreter's switch interval."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
        if ready():
            return True
    return False
