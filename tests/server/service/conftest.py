"""The service core in process, for the tests of this folder: ``clock`` (a `FakeClock` the test
moves), ``make_core(service=..., **pool)`` (cores over ``make_config(num_layers=2, **pool)``
with a lease of `TTL`, closed after the test; ``service``: more `ServiceConfig` fields) and
``core`` (one of them, at the defaults)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import pytest
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from service_harness import TTL, FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_core(make_config: Callable[..., object],
              clock: FakeClock) -> Iterator[Callable[..., ServiceCore]]:
    cores: list[ServiceCore] = []

    def factory(*, service: Mapping[str, object] | None = None, **pool: object) -> ServiceCore:
        config = ServiceConfig(pool=make_config(**{"num_layers": 2, **pool}), lease_ttl_s=TTL,
                               max_step_tokens=64, **(service or {}))
        cores.append(ServiceCore(config, clock=clock))
        return cores[-1]

    yield factory
    for core in cores:
        core.close()


@pytest.fixture
def core(make_core: Callable[..., ServiceCore]) -> ServiceCore:
    return make_core()
