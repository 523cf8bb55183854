"""The REST step in front of FastAPI, on the app itself (httpx's ASGI transport, in process): the
transport middleware answers every POST of the step through the route's endpoint, with the bodies
FastAPI's error handlers give and its service time reported; the route still answers the
path's other methods, and the token still guards the step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from kvalloc.allocator import PoolConfig
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.transport.rest import create_app
from pydantic import SecretStr

TOKEN = "s3cret"


@pytest.fixture
def core(make_config: Callable[..., PoolConfig]) -> Iterator[ServiceCore]:
    core = ServiceCore(ServiceConfig(pool=make_config()))
    yield core
    core.close()


class Steps:
    """Records the service times the transport reports."""

    def __init__(self) -> None:
        self.reported: list[tuple[str, float]] = []

    def observe_step(self, transport: str, seconds: float) -> None:
        self.reported.append((transport, seconds))

    def lease_expired(self, n: int = 1) -> None:
        pass

    def invariant_violation(self, n: int = 1) -> None:
        pass

    def shared_state_repaired(self, repaired: dict[str, int]) -> None:
        pass

    def state_changed(self) -> None:
        pass


def request(app: Any, method: str, path: str, body: bytes = b"",
            token: str | None = TOKEN) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://kvalloc") as http:
            return await http.request(method, path, content=body, headers=headers)

    return asyncio.run(send())


def step_body(core: ServiceCore, **new: list[Any]) -> bytes:
    """A step of a newly registered worker admitting ``new`` (unchecked: it may be bad)."""
    reg = core.register(wire.RegisterRequest(worker_id="w", attached=False))
    return msgspec.json.encode({"worker_id": "w", "session": reg.session, "epoch": reg.epoch,
                                "step_id": reg.next_step_id, "new": new})


def test_a_step_is_answered_and_its_service_time_reported(core: ServiceCore) -> None:
    steps = Steps()
    core.add_observer(steps)
    app = create_app(core, token=SecretStr(TOKEN))
    reply = request(app, "POST", "/v1/steps", step_body(core, req_ids=["a"], prompt_lens=[4]))
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/json"
    decoded = wire.decode(reply.content, wire.StepReply, "json")
    assert decoded.admitted[0] >= 0 and decoded.scheduled.num_tokens == [4]
    assert [transport for transport, _ in steps.reported] == ["rest"]
    assert steps.reported[0][1] > 0


def test_a_refused_step_gets_the_typed_error_and_changes_nothing(core: ServiceCore) -> None:
    app = create_app(core)
    body = step_body(core, req_ids=["a", "b"], prompt_lens=[4, 0])
    reply = request(app, "POST", "/v1/steps", body)
    assert reply.status_code == 422
    error = reply.json()
    assert (error["code"], error["field"]) == ("invalid_body", "new.prompt_lens[1]")
    assert core.get_pool(wire.PoolQuery()).num_requests == 0


def test_an_internal_error_in_the_step_is_a_500_body_and_logged(
        core: ServiceCore, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(call: StepCall) -> None:
        raise RuntimeError("broken on purpose")

    body = step_body(core, req_ids=["a"], prompt_lens=[4])
    monkeypatch.setattr(core, "step", broken)
    app = create_app(core)
    with caplog.at_level(logging.ERROR, logger="kvalloc.rest"):
        reply = request(app, "POST", "/v1/steps", body)
    assert reply.status_code == 500
    assert reply.json() == {"status": 500, "code": "internal", "field": "",
                            "message": "RuntimeError: broken on purpose"}
    assert "internal error: RuntimeError: broken on purpose" in caplog.text


def test_the_step_needs_the_token_and_other_methods_reach_the_route(core: ServiceCore) -> None:
    app = create_app(core, token=SecretStr(TOKEN))
    body = step_body(core, req_ids=["a"], prompt_lens=[4])
    refused = request(app, "POST", "/v1/steps", body, token="wrong")
    assert (refused.status_code, refused.json()["code"]) == (401, "unauthorized")
    assert core.get_pool(wire.PoolQuery()).num_requests == 0
    other = request(app, "GET", "/v1/steps")
    assert other.status_code == 405
    assert (other.json()["code"], other.json()["field"]) == ("method_not_allowed", "path")
