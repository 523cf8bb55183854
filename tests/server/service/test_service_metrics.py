"""``/metrics`` never waits for the step lock: the core publishes what scrapes read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from server import serve
from server.contract import wire
from server.contract.columns import StepCall
from server.service.core import ServiceCore
from server.service.settings import ServiceConfig


def live_requests(body: bytes) -> float:
    return next(s.value for f in text_string_to_metric_families(body.decode())
                for s in f.samples if s.name == "kvalloc_live_requests")


def test_a_scrape_answers_while_a_step_holds_the_lock(make_config: Callable[..., object]) -> None:
    core = ServiceCore(ServiceConfig(pool=make_config(), max_step_tokens=64))
    try:
        render = serve._metrics(core)
        assert render is not None
        reg = core.register(wire.RegisterRequest(worker_id="w"))
        core.step(StepCall.build("w", reg.session, reg.epoch, 0, new_req_ids=["a"],
                                 prompt_lens=[4]))
        time.sleep(0.3)  # past min_interval_s: the lease check publishes what it held back
        core.expire_leases()
        bodies: list[bytes] = []
        with core.lock:  # a step in progress, as long as it likes
            scraper = threading.Thread(target=lambda: bodies.append(render()[0]))
            scraper.start()
            scraper.join(timeout=30)
            assert not scraper.is_alive(), "the scrape waited for the step lock"
        assert live_requests(bodies[0]) == 1
    finally:
        core.close()
