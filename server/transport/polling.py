"""Waiting for the next message without paying a sleeping thread's wake-up on the critical path.

A thread blocked in the kernel costs a wake-up to resume: tens of microseconds where waking an
idle thread is slow (virtual machines, cores in deep idle states), on the waker's side and on its
own, and a thread that slept runs its next Python slower on a cold core. Where a message is due
soon, both IPC carriers ask for it in a loop first (`poll_for`), then block: the client for its
reply, the service for a connection's next call. A worker calls once per scheduler step, so the
service knows roughly when: `CallPacer` learns the gap between an answer and the next call and
polls only around the time it is due, so that a worker whose forward takes milliseconds costs
the service a bounded slice of a core per call, not a core.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

# A poll that took this long shared its core: the wait blocks instead.
CONTENDED_S = 200e-6


def poll_for(ready: Callable[[], bool], seconds: float,
             stop: threading.Event | None = None) -> bool:
    """Call ``ready`` without sleeping until it returns True, for at most ``seconds`` (and not
    past ``stop`` being set); whether it did. ``ready`` should release the GIL (a system call
    does), or other threads wait out the interpreter's switch interval."""
    now = time.perf_counter()
    deadline = now + seconds
    while now < deadline and not (stop is not None and stop.is_set()):
        if ready():
            return True
        # Any other thread with work to do on this core runs first; if one did, the core is
        # not free, and polling on would only take it from the work the wait is for.
        os.sched_yield()
        last, now = now, time.perf_counter()
        if now - last > CONTENDED_S:
            break
    return False


class Wait(NamedTuple):
    """How to wait for the next message: in the kernel for ``sleep_s`` (waking early if it
    comes), then polling until ``spin_s`` later, then in the kernel until it comes."""

    sleep_s: float = 0.0
    spin_s: float = 0.0


def wait_for(wait: Wait, sleep: Callable[[float], bool], ready: Callable[[], bool],
             stop: threading.Event | None = None) -> bool:
    """Wait as ``wait`` says, with ``sleep(seconds)`` (a wait in the kernel, to the millisecond
    below: whether it came) and ``ready`` (a look that does not wait); whether it came before the
    wait ran out. The polling ends when it would have after an exact sleep."""
    if wait.spin_s <= 0:
        return False
    began = time.perf_counter()
    if wait.sleep_s >= 1e-3 and sleep(wait.sleep_s):
        return True
    return poll_for(ready, began + wait.sleep_s + wait.spin_s - time.perf_counter(), stop)


BLOCK = Wait()  # straight into the kernel

# A call further off than this is not polled for: a wake-up is then a small share of the gap.
HORIZON_S = 0.1


class CallPacer:
    """When one connection's next call is due, from the gaps between its last answers and the
    calls that followed; each answer earns one `Wait` that polls for at most ``budget_s``.

    The forecast is the shortest of the last ``history`` gaps, so most calls come after it: the
    poll starts a quarter of the budget before it (at once for a caller that calls back to back)
    and ends three quarters after. Only an answer that is not an error earns a poll: a peer
    without the token, or sending bad input, cannot keep a core busy.
    """

    def __init__(self, budget_s: float, *, history: int = 8,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget_s = budget_s
        self._clock = clock
        self._gaps: deque[float] = deque(maxlen=history)
        self._answered_at: float | None = None  # the last answer, until the next call
        self._earned = False  # the last answer earned a wait not taken yet

    def arrived(self) -> None:
        """A message came: the gap since the answer before it is learnt."""
        if self._answered_at is not None:
            self._gaps.append(self._clock() - self._answered_at)
            self._answered_at = None

    def answered(self, ok: bool) -> None:
        """The message was answered: ``ok`` unless with an error."""
        self._answered_at = self._clock()
        self._earned = ok and self.budget_s > 0

    def next_wait(self) -> Wait:
        """How to wait for the next call: once per answer that earned it, `BLOCK` otherwise
        (and for a wait that ran out)."""
        if not self._earned or self._answered_at is None:
            return BLOCK
        self._earned = False
        due = min(self._gaps, default=0.0)
        if due > HORIZON_S:
            return BLOCK
        since = self._clock() - self._answered_at
        start = max(0.0, due - self.budget_s / 4)
        end = start + self.budget_s
        if since >= end:
            return BLOCK
        return Wait(max(0.0, start - since), end - max(start, since))
