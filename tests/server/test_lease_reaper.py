"""`kvalloc serve`'s reaper thread: leases are looked at every interval, the shared state is
checked every ``verify_interval_s``, and a check that fails is logged without ending the thread,
so leases keep expiring."""

from __future__ import annotations

import threading
import time

import pytest
from kvalloc.server import serve
from kvalloc.server.service.settings import ServiceConfig

# The reaper looks every 0.05 s here; a loaded two-core machine may hold its thread back for
# seconds, never for this long.
DEADLINE_S = 60.0


class FailingCheckCore:
    """The part of a core the reaper calls, whose shared-state check always raises."""

    def __init__(self) -> None:
        self.config = ServiceConfig(lease_ttl_s=0.2, verify_interval_s=0.05)
        self.looks = 0
        self.checks = 0
        self.event = threading.Event()

    def watch_pauses(self, longest_quiet_s: float) -> None:
        pass

    def expire_leases(self) -> int:
        self.looks += 1
        if self.checks >= 3:
            self.event.set()
        return 0

    def repair_shared_state(self) -> dict[str, int]:
        self.checks += 1
        raise RuntimeError("the check broke")


def test_a_failing_check_is_logged_and_leases_still_expire(
        caplog: pytest.LogCaptureFixture) -> None:
    core = FailingCheckCore()
    reaper = serve.LeaseReaper(core)  # type: ignore[arg-type]
    reaper.start()
    try:
        assert core.event.wait(DEADLINE_S), "the reaper stopped looking at leases"
        looks = core.looks
        deadline = time.monotonic() + DEADLINE_S
        while core.looks == looks:
            assert time.monotonic() < deadline, "the reaper stopped after a failed check"
            time.sleep(0.01)
    finally:
        reaper.stop()
    assert "checking the shared state failed; leases still expire" in caplog.text
