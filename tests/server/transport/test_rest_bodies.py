"""Every malformed body the REST routes can be sent is a typed 422 ``invalid_body`` naming the
field (``body`` when it is not JSON at all), a status the OpenAPI document lists, and changes
nothing: bytes that are not UTF-8 included, which FastAPI itself answers with an undocumented
400 naming ``path``. Its message starts with that field and says what was wrong in its own words:
never behind the prefix pydantic puts before a validator's reason."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.commands.config_errors import LIBRARY_PREFIXES
from kvalloc.server.contract import wire
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from kvalloc.server.transport.rest import create_app
from pydantic import BaseModel, SecretStr, field_validator

TOKEN = "s3cret"

MALFORMED = {  # body -> the field its error must name
    b"\xff\xfe{}": "body",  # not UTF-8
    b'{"worker_id": "\xff"}': "body",  # JSON punctuation around a byte that is not UTF-8
    b"{": "body",
    b"[1]": "body",
    b'{"worker_id": "w", "attached": "yes"}': "attached",
}


@pytest.fixture
def core(make_config: Callable[..., PoolConfig]) -> Iterator[ServiceCore]:
    core = ServiceCore(ServiceConfig(pool=make_config()))
    yield core
    core.close()


def call(app: Any, method: str, path: str, body: bytes = b"") -> httpx.Response:
    headers = {"content-type": "application/json", "authorization": f"Bearer {TOKEN}"}

    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://kvalloc") as http:
            return await http.request(method, path, content=body, headers=headers)

    return asyncio.run(send())


def snapshot(core: ServiceCore) -> tuple[Any, ...]:
    pool = core.get_pool(wire.PoolQuery())
    return (pool.free_blocks, pool.num_requests, [w.worker_id for w in pool.workers],
            pool.counters)


@pytest.mark.parametrize("path", ["/v1/workers", "/v1/steps"])
@pytest.mark.parametrize(("body", "field"), MALFORMED.items())
def test_a_malformed_body_is_a_documented_typed_422_naming_the_field(
        core: ServiceCore, path: str, body: bytes, field: str) -> None:
    app = create_app(core, token=SecretStr(TOKEN))
    core.register(wire.RegisterRequest(worker_id="bystander", attached=False))
    before = snapshot(core)
    reply = call(app, "POST", path, body)
    assert reply.status_code == 422, reply.text
    error = reply.json()
    assert error["code"] == "invalid_body" and error["status"] == 422
    assert error["message"].startswith(f"{error['field']}: ")
    assert not error["message"].removeprefix(f"{error['field']}: ").startswith(LIBRARY_PREFIXES)
    if path == "/v1/workers":  # the step's body has other fields: only "not JSON" is shared
        assert error["field"] == field
    elif field == "body":
        assert error["field"] == "body"
    documented = call(app, "GET", "/openapi.json").json()["paths"][path]["post"]["responses"]
    assert str(reply.status_code) in documented
    assert snapshot(core) == before


class Probe(BaseModel):
    """A body whose validator raises, as a contract model's check would."""

    count: int

    @field_validator("count")
    @classmethod
    def _even(cls, count: int) -> int:
        if count < 0:  # raised, not asserted: pytest rewrites this module's asserts
            raise AssertionError("a negative count")
        if count % 2:
            raise ValueError("an odd count")
        return count


@pytest.mark.parametrize(("body", "message"), [(b'{"count": 3}', "count: an odd count"),
                                               (b'{"count": -2}', "count: a negative count")])
def test_a_validators_reason_is_the_message_without_pydantics_prefix(
        core: ServiceCore, body: bytes, message: str) -> None:
    """pydantic reports a validator's ValueError as "Value error, <reason>" (an assertion as
    "Assertion failed, <reason>"); the 422 names the field and gives the reason alone."""
    app = create_app(core, token=SecretStr(TOKEN))

    @app.app.post("/probe")  # on the FastAPI app, behind the transport's middleware
    async def probe(_: Probe) -> None:
        return None

    reply = call(app, "POST", "/probe", body)
    assert reply.status_code == 422, reply.text
    error = reply.json()
    assert (error["code"], error["field"], error["message"]) == ("invalid_body", "count", message)
    assert "Value error" not in reply.text and "Assertion failed" not in reply.text
