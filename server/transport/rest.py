"""The REST transport: FastAPI routes that validate with the pydantic contract and call the core.

Routes are one line each: validate (FastAPI + `server.contract.protocol`), convert to the wire
struct, call the `ServiceCore` method of the same name, encode the reply. Every error, whatever
raised it, leaves as an `ErrorBody` with the status from `server.contract.errors`; every status a
route can answer is listed in the OpenAPI document.

Replies are encoded by msgspec straight from the core's structs (the OpenAPI schema still comes
from the pydantic reply models, and the tests check replies against it), which keeps FastAPI's
per-object serialisation off the per-step path. Handlers are ``async`` and call the core directly:
its work is short and serialised by its lock anyway, so a thread hop per call would only add
latency. The step, the one call per scheduler step, is answered by `TransportMiddleware` in front
of FastAPI through its route's endpoint, so it pays for none of FastAPI's per-call layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from kvalloc.allocator import KVAllocError
from kvalloc.allocator.commands.config_errors import reason
from kvalloc.server.contract import protocol, wire
from kvalloc.server.contract.errors import (
    INTERNAL,
    BodyTooLarge,
    MalformedBody,
    NotReady,
    Unauthorized,
    describe,
    field_path,
)
from kvalloc.server.contract.operations import OPERATIONS
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.transport.network import DEFAULT_LIMITS, OVERLOADED_RETRY_AFTER_S, RestLimits
from pydantic import SecretStr
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvalloc.rest")

JSON = "application/json"
T = TypeVar("T")
Responses = dict[int | str, dict[str, Any]]  # FastAPI's ``responses``: status -> its document

_STATUS_TEXT = {
    401: "Missing or wrong bearer token (KVALLOC_TOKEN).",
    404: "Unknown worker (never registered, or its lease expired) or unknown request.",
    409: "Conflicts with the service's state: stale epoch (restart), stale session, worker id "
         "in use, step id out of order or reused with another body, grant pending, too many "
         "workers.",
    408: "The body did not arrive within the service's body timeout.",
    413: "Body larger than the service's max_body_bytes.",
    422: "Invalid input; `field` names it. Nothing changed.",
    500: "Internal error (a bug, never expected): logged and counted.",
    503: "Shutting down, or overloaded (too many calls in flight): retry after Retry-After.",
    507: "The shared memory a registration needs cannot be backed: fewer bytes are free where "
         "the service's segments live than it needs. Nothing changed.",
}


def _errors(*statuses: int) -> Responses:
    return {s: {"model": protocol.ErrorBody, "description": _STATUS_TEXT[s]} for s in statuses}


def _json(struct: Any, status: int = 200) -> Response:
    return Response(wire.encode_json(struct), status_code=status, media_type=JSON)


def create_app(core: ServiceCore, *, token: SecretStr | None = None,
               metrics: Callable[[], tuple[bytes, str]] | None = None,
               limits: RestLimits = DEFAULT_LIMITS) -> ASGIApp:
    """The REST app over ``core``: `TransportMiddleware` in front of the FastAPI app (outside
    all of FastAPI's own layers, which the step then never enters). ``metrics`` renders the
    Prometheus exposition (body, type)."""
    app = FastAPI(
        title="kvalloc", version="0.1.0",
        description="KV-cache block allocator service: one batched call per scheduler step.",
    )
    _install_error_handlers(app)
    # The document describes this service: bearer auth and its 401 appear only when it has a token.
    auth = [Depends(_Authorize(token))] if token is not None else []
    errors = _operation_errors(token is not None)
    # Added in the order the document lists them.
    _add_worker_routes(app, core, auth, errors)
    step = _add_step_route(app, core, auth, errors)
    _add_inspection_routes(app, core, auth, errors)
    _add_health_routes(app, core, metrics)
    return TransportMiddleware(app, core, core.config.max_body_bytes, step=step, token=token,
                               limits=limits)


def _operation_errors(token_required: bool) -> Callable[..., Responses]:
    def errors(*statuses: int) -> Responses:
        """The statuses of a /v1 operation: its own, plus what the transport may answer before
        the route runs (a slow body, overload; a missing token where one is required)."""
        return _errors(*sorted({*statuses, 408, 503, *((401,) if token_required else ())}))

    return errors


def _add_worker_routes(app: FastAPI, core: ServiceCore, auth: list[Any],
                       errors: Callable[..., Responses]) -> None:
    ops = OPERATIONS

    @app.post(ops["register"].path, response_model=protocol.Registration, dependencies=auth,
              responses=errors(409, 413, 422, 500, 503, 507), tags=["workers"])
    async def register(body: protocol.RegisterRequest) -> Response:
        """Register a worker (or start it afresh) and get the handles to attach the pool."""
        return _json(core.register(wire.from_model(body, wire.RegisterRequest)))

    @app.delete(ops["deregister"].path, response_model=protocol.Deregistered, dependencies=auth,
                responses=errors(404, 409, 413, 422, 500, 503), tags=["workers"])
    async def deregister(
        worker_id: Annotated[str, Path(**protocol.WORKER_ID_LIMITS)],
        session: Annotated[int, Query(ge=0, le=protocol.INT63_MAX)],
    ) -> Response:
        """End the worker's session: free every request of it and forget it."""
        return _json(core.deregister(wire.WorkerRef(worker_id=worker_id, session=session)))


def _add_step_route(app: FastAPI, core: ServiceCore, auth: list[Any],
                    errors: Callable[..., Responses]) -> Callable[[Request], Awaitable[Response]]:
    """The step's route, for the document; returns its endpoint, which `TransportMiddleware`
    calls itself for every POST, before FastAPI's routing and dependencies."""
    step_op = OPERATIONS["step"]

    async def step(request: Request) -> Response:
        """Apply one scheduler step atomically; a retried step id returns the same reply."""
        # msgspec validates the columns in C against the same bounds the document states;
        # pydantic would build a Python object per element first.
        struct = _decode_json(await request.body(), step_op.request)
        return _json(step_op.from_core(core.step(step_op.to_core(struct)), binary=False))

    # The route is what the document lists (and what answers other methods on the path).
    app.post(step_op.path, response_model=protocol.StepReply, dependencies=auth,
             responses=errors(404, 409, 413, 422, 500, 503), tags=["steps"],
             openapi_extra={"requestBody": _body_schema(protocol.StepRequest)})(step)
    _document_models(app, protocol.StepRequest)
    return step


def _add_inspection_routes(app: FastAPI, core: ServiceCore, auth: list[Any],
                           errors: Callable[..., Responses]) -> None:
    ops = OPERATIONS

    @app.get(ops["get_request"].path, response_model=protocol.RequestState, dependencies=auth,
             responses=errors(404, 409, 413, 422, 500, 503), tags=["inspection"])
    async def get_request(
        req_id: Annotated[str, Path(**protocol.REQ_ID_LIMITS)],
        worker_id: Annotated[str, Query(**protocol.WORKER_ID_LIMITS)],
        session: Annotated[int, Query(ge=0, le=protocol.INT63_MAX)],
    ) -> Response:
        """One request of the worker's session: capacity, history, pending grant and blocks."""
        return _json(core.get_request(wire.RequestRef(worker_id=worker_id, session=session,
                                                      req_id=req_id)))

    @app.get(ops["get_pool"].path, response_model=protocol.PoolState, dependencies=auth,
             responses=errors(413, 422, 500, 503), tags=["inspection"])
    async def get_pool(verify: bool = False) -> Response:
        """Pool occupancy, workers and their leases; ``verify`` also runs check_invariants."""
        return _json(core.get_pool(wire.PoolQuery(verify=verify)))


def _add_health_routes(app: FastAPI, core: ServiceCore,
                       metrics: Callable[[], tuple[bytes, str]] | None) -> None:
    @app.get("/healthz", response_model=protocol.Health, responses=_errors(413, 500),
             tags=["health"])
    async def healthz() -> Response:
        """The process answers."""
        return _json(wire.Health(status="ok"))

    @app.get("/readyz", response_model=protocol.Readiness, responses=_errors(413, 500, 503),
             tags=["health"])
    async def readyz() -> Response:
        """The service takes calls."""
        if not core.ready:
            raise NotReady("service: shutting down")
        return _json(wire.Readiness(status="ready", epoch=core.epoch))

    if metrics is not None:
        render = metrics  # narrowed to non-None for the closure

        @app.get("/metrics", responses={200: {"content": {"text/plain": {}}},
                                         **_errors(413, 500)}, tags=["health"])
        async def prometheus() -> Response:
            """Prometheus exposition of the allocator's metrics."""
            body, content_type = render()
            return Response(body, media_type=content_type)


def _body_schema(model: type[protocol.Contract]) -> dict[str, Any]:
    return {"required": True, "content": {JSON: {"schema": {
        "$ref": f"#/components/schemas/{model.__name__}"}}}}


def _document_models(app: FastAPI, *models: type[protocol.Contract]) -> None:
    """Add ``models`` (and the models they nest) to the OpenAPI components: routes that decode
    their body themselves do not declare it as a parameter, so FastAPI would not list it. Also
    write every integer bound exactly (see `_exact_bounds`)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(doc.pop("$defs", {}))
                components[model.__name__] = doc
            app.openapi_schema = _exact_bounds(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# FastAPI's document model types bounds as floats: 2**63 - 1 would read 9.223372036854776e+18,
# i.e. 2**63, and a client that trusts the document sends values the service refuses.
_BOUNDS = {float(b): b for b in (protocol.INT63_MAX, protocol.INT32_MAX)}


def _exact_bounds(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (_BOUNDS.get(v, int(v)) if k in ("minimum", "maximum") and isinstance(v, float)
                    and v.is_integer() else _exact_bounds(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_exact_bounds(v) for v in node]
    return node


def _decode_json(body: bytes, struct: type[wire.S]) -> wire.S:
    try:
        return wire.decode(body, struct, "json")
    except msgspec.ValidationError as exc:
        # msgspec's int takes integer literals only, JSON Schema's integer any number without a
        # fractional part: a refused body is read again with those numbers as ints. Only
        # refused bodies pay it, and any other fault still gets the first reading's refusal.
        # (ValidationError is a DecodeError; too deep a body is refused as the first reading)
        with contextlib.suppress(msgspec.DecodeError, RecursionError):
            whole = protocol.integral_as_int(msgspec.json.decode(body))
            return wire.decode(msgspec.json.encode(whole), struct, "json")
        where = wire.error_field(exc)
        raise MalformedBody(f"{where}: {exc}", field=where) from None
    except msgspec.DecodeError as exc:
        raise MalformedBody(f"body: not JSON ({exc})", field="body") from None


_bearer = HTTPBearer(auto_error=False, description="The service's KVALLOC_TOKEN.")


class _Authorize:
    """Dependency: the bearer token must equal the service's."""

    def __init__(self, token: SecretStr) -> None:
        self.expected = token.get_secret_value().encode()

    async def __call__(
        self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, self.expected):
            raise Unauthorized("authorization: missing or wrong bearer token")


def _error(exc: BaseException) -> Response:
    """Any exception as its `ErrorBody`; an internal error is logged."""
    body = describe(exc)
    if body.status == INTERNAL:  # a typed refusal (503, 507) is no bug
        log.error("internal error: %s", body.message, exc_info=exc)
    return _json(body, body.status)


def _install_error_handlers(app: FastAPI) -> None:
    async def typed(_: Request, exc: Exception) -> Response:
        return _error(exc)

    async def invalid(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0]
        where = "body" if first["type"] == "json_invalid" else field_path(tuple(first["loc"]))
        return _error(MalformedBody(f"{where}: {reason(first)}", field=where))

    async def http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 400:
            # FastAPI's "error parsing the body": bytes that are not text (not UTF-8) before any
            # JSON is parsed. Still a body that does not match the schema, so its typed 422.
            return _error(MalformedBody(f"body: not JSON ({exc.detail})", field="body"))
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        body = wire.ErrorBody(status=exc.status_code, code=code, field="path",
                              message=str(exc.detail))
        return Response(wire.encode_json(body), status_code=exc.status_code, media_type=JSON,
                        headers=exc.headers)

    app.add_exception_handler(KVAllocError, typed)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(Exception, typed)


class TransportMiddleware:
    """Pure ASGI, in front of every route; each guard answers before the next costs anything:

    1. more than ``limits.max_in_flight`` ``/v1`` calls at once: 503 ``overloaded`` with
       Retry-After (a bounded queue instead of an unbounded one; probes and scrapes are cheap
       and never refused, so an overloaded service is not mistaken for a dead one);
    2. a ``/v1`` call without the bearer token: 401 before a byte of its body is read;
    3. a body over ``max_body_bytes`` (declared or streamed): 413 as soon as the limit is
       crossed; a body not complete within ``limits.body_timeout_s``: 408.

    An early answer closes the connection, so an unread body is never drained. A POST of the
    step then goes to ``step`` (its route's endpoint) directly: the per-step call skips
    FastAPI's routing and dependency solving, and its errors get the same bodies as the
    exception handlers give. Each step's service time is reported to the core (transport
    "rest")."""

    def __init__(self, app: ASGIApp, core: ServiceCore, max_body_bytes: int, *,
                 step: Callable[[Request], Awaitable[Response]],
                 token: SecretStr | None = None, limits: RestLimits = DEFAULT_LIMITS) -> None:
        self.app = app
        self.core = core
        self.step = step
        self.limit = max_body_bytes
        self.limits = limits
        self.expected = token.get_secret_value().encode() if token is not None else None
        self.step_path = OPERATIONS["step"].path
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not _is_operation(scope):  # probes, scrapes, the document: no token, no bound
            await self._serve(scope, receive, send)
            return
        if self.in_flight >= self.limits.max_in_flight:
            await _send(send, wire.ErrorBody(
                status=503, code="overloaded", field="service",
                message=f"service: {self.in_flight} calls in flight; retry after "
                        f"{OVERLOADED_RETRY_AFTER_S} s"),
                retry_after=OVERLOADED_RETRY_AFTER_S)
            return
        self.in_flight += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        if not self._authorized(scope):
            await _send(send, describe(Unauthorized("authorization: missing or wrong bearer "
                                                    "token")))
            return
        try:
            body = await _within(self.limits.body_timeout_s, self._read_body(scope, receive))
        except asyncio.TimeoutError:  # not the builtin before Python 3.11
            await _send(send, wire.ErrorBody(
                status=408, code="body_timeout", field="body",
                message=f"body: not complete within {self.limits.body_timeout_s:g}s"))
            return
        if body is None:
            too_big = BodyTooLarge(f"body: larger than max_body_bytes={self.limit}")
            await _send(send, describe(too_big))
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: waits for the disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        if scope["path"] != self.step_path or scope["method"] != "POST":
            await self.app(scope, replay, send)
            return
        try:
            response = await self.step(Request(scope, replay))
        except Exception as exc:
            response = _error(exc)
        await response(scope, replay, send)
        self.core.observe_step("rest", time.perf_counter() - start)

    def _authorized(self, scope: Scope) -> bool:
        """A ``/v1`` call carries the bearer token (the scheme's case does not matter)."""
        if self.expected is None or not _is_operation(scope):
            return True
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, credentials = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(),
                                                                   self.expected)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it (or its declared length) exceeds the limit."""
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return None
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.limit:
                return None
            if not message.get("more_body", False):
                break
        return bytes(body)


async def _within(seconds: float, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result, or `asyncio.TimeoutError` after ``seconds``. `asyncio.timeout`
    (Python 3.11+) runs it in this task; `asyncio.wait_for` wraps it in a task of its own, which
    costs loop turns on every call."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def _is_operation(scope: Scope) -> bool:
    return bool(scope["path"].startswith("/v1/"))


async def _send(send: Send, body: wire.ErrorBody, retry_after: int | None = None) -> None:
    """An answer before the route ran; the connection closes after it (its request may still
    be sending a body nobody will read)."""
    payload = wire.encode_json(body)
    headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": body.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
