"""`kvalloc serve` as a real process: the bad-input table for every operation over both transports
(4xx naming the field, the same answer on REST and IPC, state unchanged), the OpenAPI document,
authentication, limits, socket permissions and the health and metrics endpoints."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from kvalloc.server.client import Client
from kvalloc.server.contract import protocol, wire
from kvalloc.server.contract.errors import RemoteError
from kvalloc.server.contract.operations import OK, OPERATIONS
from kvalloc.server.devtools.launch import ServiceProcess, free_port
from kvalloc.server.transport.token_files import discover_token

SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4", "--num-layers",
              "2", "--num-kv-heads", "1", "--head-dim", "8", "--max-batch-size", "8",
              "--max-seq-len", "64", "--max-step-tokens", "64")
TOKEN = "s3cret-token"


IPC_TCP = f"tcp://127.0.0.1:{free_port()}"  # ZeroMQ over TCP too, as containers need


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("svc"), *SMALL_POOL, "--lease-ttl-s", "300",
                        "--max-body-bytes", "4096", "--ipc", IPC_TCP) as svc:
        yield svc


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A service that requires KVALLOC_TOKEN."""
    with ServiceProcess(tmp_path_factory.mktemp("guarded"), *SMALL_POOL, tcp=False,
                        env={"KVALLOC_TOKEN": TOKEN}) as svc:
        yield svc


def raw_rest(svc: ServiceProcess, op: str, payload: Any, token: str | None = None
             ) -> httpx.Response:
    """One operation over REST, built from the same payload the IPC transport takes: path fields
    in the path, the rest in the query (GET/DELETE) or the JSON body (POST); bytes as is. No
    ``token``: the one the service generated, if it did."""
    operation = OPERATIONS[op]
    token = discover_token(svc.ipc) if token is None else token
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(svc.uds)), base_url="http://svc",
                      headers=headers, timeout=10) as http:
        if isinstance(payload, bytes):
            return http.request(operation.method, operation.path, content=payload)
        fields = dict(payload)
        path = operation.path.format(**{k: quote(str(fields.pop(k, "")), safe="")
                                        for k in operation.path_fields})
        if operation.method == "POST":
            return http.post(path, json=fields)
        params = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}
        return http.request(operation.method, path, params=params)


def packed(body: Any) -> Any:
    """A step body as IPC carries it: its columns packed into one int64 buffer with their
    lengths (in `wire.column_paths` order), its scalars and ``new.req_ids`` beside them."""
    if not isinstance(body, dict):
        return body
    arrays = [np.asarray(body.get(group, {}).get(name, []), dtype="<i8")
              for group, name in (path.split(".")
                                  for path in wire.column_paths(protocol.StepRequest))]
    return {**{k: v for k, v in body.items() if not isinstance(v, dict)},
            "req_ids": body.get("new", {}).get("req_ids", []),
            "lengths": [a.size for a in arrays], "columns": b"".join(a.tobytes() for a in arrays)}


def raw_ipc(svc: ServiceProcess, op: str, payload: Any, token: str | None = None
            ) -> tuple[int, dict]:
    """One operation over IPC: msgpack of ``payload`` (bytes as is) in the documented frames; a
    step packed (`packed`). No ``token``: the one the service generated, if it did."""
    token = (discover_token(svc.ipc) or "") if token is None else token
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(svc.ipc)
        if op == "step":
            payload = packed(payload)
        body = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
        sock.send_multipart([b"1", token.encode(), op.encode(), body])
        assert sock.poll(10_000), "no reply"
        seq, status, reply = sock.recv_multipart()
        assert seq == b"1"
        decoded = msgspec.msgpack.decode(reply)
        return (200 if status == OK else decoded["status"]), decoded
    finally:
        sock.close()
        ctx.term()


def send(svc: ServiceProcess, transport: str, op: str, payload: Any) -> tuple[int, dict]:
    if transport == "ipc":
        return raw_ipc(svc, op, payload)
    resp = raw_rest(svc, op, payload)
    return resp.status_code, resp.json()


# ---------------------------------------------------------------- the bad-input table


@dataclass
class Table:
    """A worker whose previous step granted request "a" (handle ``a``) 2 drafts; "b" is idle."""

    epoch: int
    session: int
    next_step: int
    a: int
    b: int


@pytest.fixture(scope="module")
def table(service: ServiceProcess) -> Table:
    client = Client(service.ipc, worker_id="table")
    reg = client.register(attach=False)
    a, b = client.step(new=(["a", "b"], [4, 4])).admitted.tolist()
    client.step(grants=([a], [2]))
    return Table(reg.epoch, reg.session, client.next_step_id, a, b)


def step(t: Table, **fields: Any) -> dict[str, Any]:
    """A step body for the "table" worker that settles "a" unless ``fields`` say otherwise."""
    return {"worker_id": "table", "session": t.session, "epoch": t.epoch, "step_id": t.next_step,
            "results": {"handles": [t.a], "num_accepted": [1]}, **fields}


def grants(handles: list[int], drafts: list[int]) -> dict[str, list[int]]:
    return {"handles": handles, "draft_lens": drafts}


def new(req_ids: list[str], prompts: list[int], chunks: list[int] | None = None
        ) -> dict[str, list[Any]]:
    return {"req_ids": req_ids, "prompt_lens": prompts, "first_chunks": chunks or []}


NOT_DECODABLE = object()  # "{not json" on REST, an invalid msgpack byte on IPC

BAD_INPUT: list[tuple[str, str, Callable[[Table], Any], int, str]] = [
    # name, operation, payload, status, field
    ("register: no worker_id", "register", lambda t: {}, 422, "worker_id"),
    ("register: id with a slash", "register", lambda t: {"worker_id": "a/b"}, 422, "worker_id"),
    ("register: id too long", "register", lambda t: {"worker_id": "w" * 65}, 422, "worker_id"),
    ("register: id not a string", "register", lambda t: {"worker_id": 5}, 422, "worker_id"),
    ("register: unknown field", "register", lambda t: {"worker_id": "x", "x": 1}, 422, "x"),
    ("register: not decodable", "register", lambda t: NOT_DECODABLE, 422, "body"),
    ("deregister: unknown worker", "deregister", lambda t: {"worker_id": "nobody", "session": 1},
     404, "worker_id"),
    ("deregister: stale session", "deregister",
     lambda t: {"worker_id": "table", "session": t.session ^ 1}, 409, "session"),
    ("deregister: no session", "deregister", lambda t: {"worker_id": "table"}, 422, "session"),
    ("register: id held by a live session", "register", lambda t: {"worker_id": "table"}, 409,
     "worker_id"),
    ("register: id ending in a newline", "register", lambda t: {"worker_id": "x\n"}, 422,
     "worker_id"),
    ("deregister: bad id", "deregister", lambda t: {"worker_id": "bad!id"}, 422, "worker_id"),
    ("step: unknown worker", "step", lambda t: {**step(t), "worker_id": "nobody"}, 404,
     "worker_id"),
    ("step: stale epoch", "step", lambda t: step(t, epoch=t.epoch ^ 1), 409, "epoch"),
    ("step: stale session", "step", lambda t: step(t, session=t.session ^ 1), 409, "session"),
    ("step: older step id", "step", lambda t: step(t, step_id=0), 409, "step_id"),
    ("step: missing epoch", "step", lambda t: {k: v for k, v in step(t).items() if k != "epoch"},
     422, "epoch"),
    ("step: previous step unsettled", "step",
     lambda t: step(t, results={"handles": [], "num_accepted": []}), 422, "results"),
    ("step: more accepted than drafts", "step",
     lambda t: step(t, results={"handles": [t.a], "num_accepted": [3]}), 422, "num_accepted"),
    ("step: unknown handle", "step",
     lambda t: step(t, results={"handles": [t.a, t.b + (1 << 20)], "num_accepted": [1, 0]}), 422,
     "results.handles[1]"),
    ("step: a row, not a handle", "step",
     lambda t: step(t, grants=grants([t.b & ((1 << 20) - 1)], [1])), 422, "grants.handles[0]"),
    ("step: negative draft_len", "step",
     lambda t: step(t, grants=grants([t.b], [-1])), 422, "grants.draft_lens[0]"),
    ("step: columns of different lengths", "step",
     lambda t: step(t, grants=grants([t.b], [])), 422, "grants.draft_lens"),
    ("step: draft_len above max", "step",
     lambda t: step(t, grants=grants([t.b], [4])), 422, "draft_len"),
    ("step: padding below the grant", "step",
     lambda t: step(t, grants=grants([t.b], [3]),
                    padding={"handles": [t.b], "padded_draft_lens": [1]}), 422,
     "padded_draft_len"),
    ("step: new id already used", "step", lambda t: step(t, new=new(["b"], [3])), 422,
     "new.req_ids[0]"),
    ("step: prompt above max_seq_len", "step", lambda t: step(t, new=new(["c"], [65], [4])),
     422, "prompt_len"),
    ("step: first chunk past the prompt", "step", lambda t: step(t, new=new(["c"], [3], [4])),
     422, "first_chunk"),
    ("step: finished and granted", "step",
     lambda t: step(t, finished={"handles": [t.b]}, grants=grants([t.b], [1])), 422,
     "finished"),
    ("step: more entries than max_batch_size", "step",
     lambda t: step(t, reverts={"handles": [t.b] * 9}), 422, "reverts"),
    ("step: more tokens than max_step_tokens", "step",
     lambda t: step(t, new=new(["c", "d"], [60, 9])), 422, "new"),
    ("step: body too large", "step",
     lambda t: step(t, finished={"handles": [t.b] * 1000}), 413, "body"),
    ("get_request: unknown request", "get_request",
     lambda t: {"worker_id": "table", "session": t.session, "req_id": "zz"}, 404, "req_id"),
    ("get_request: unknown worker", "get_request",
     lambda t: {"worker_id": "nobody", "session": t.session, "req_id": "a"}, 404, "worker_id"),
    ("get_request: no worker_id", "get_request", lambda t: {"session": t.session, "req_id": "a"},
     422, "worker_id"),
    ("get_request: another worker's session", "get_request",
     lambda t: {"worker_id": "table", "session": t.session ^ 1, "req_id": "a"}, 409, "session"),
    ("get_request: no session", "get_request", lambda t: {"worker_id": "table", "req_id": "a"},
     422, "session"),
    ("get_pool: verify not a bool", "get_pool", lambda t: {"verify": "maybe"}, 422, "verify"),
]


def observable_state(svc: ServiceProcess, session: int) -> tuple[Any, ...]:
    pool = raw_rest(svc, "get_pool", {"verify": True}).json()
    assert pool["invariants"] == "ok"
    requests = [raw_rest(svc, "get_request", {"worker_id": "table", "session": session,
                                              "req_id": r}).json() for r in ("a", "b")]
    workers = sorted((w["worker_id"], w["num_requests"], w["last_step_id"])
                     for w in pool.pop("workers"))
    return pool, workers, requests


@pytest.mark.parametrize("transport", ["rest", "ipc"])
@pytest.mark.parametrize(("name", "op", "payload", "status", "field"), BAD_INPUT,
                         ids=[row[0] for row in BAD_INPUT])
def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
        service: ServiceProcess, table: Table, transport: str, name: str, op: str,
        payload: Callable[[Table], Any], status: int, field: str) -> None:
    body = payload(table)
    if body is NOT_DECODABLE:
        body = b"{not json" if transport == "rest" else b"\xc1"
    before = observable_state(service, table.session)
    got_status, error = send(service, transport, op, body)
    assert (got_status, error["status"], error["field"]) == (status, status, field), error
    assert error["code"] and error["message"].startswith(f"{field}:"), error
    assert observable_state(service, table.session) == before


def openapi(svc: ServiceProcess) -> dict[str, Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(svc.uds)),
                      base_url="http://svc") as http:
        return http.get("/openapi.json").json()


def test_openapi_documents_every_status_each_operation_answers(service: ServiceProcess) -> None:
    spec = openapi(service)
    for op_name, op in OPERATIONS.items():
        responses = spec["paths"][op.path][op.method.lower()]["responses"]
        seen = {str(status) for _, name, _, status, _ in BAD_INPUT if name == op_name}
        # No KVALLOC_TOKEN: the service generated a token, which the document states too.
        assert {"200", "401", "422", "500", "503"} | seen <= set(responses), op_name
        for status, response in responses.items():
            if status != "200":
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (op_name, status)
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_openapi_writes_integer_bounds_exactly(service: ServiceProcess) -> None:
    """2**63 - 1 as an integer: a float rounds it to 2**63, which the service refuses."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(service.uds)),
                      base_url="http://svc") as http:
        text = http.get("/openapi.json").text
    assert "9223372036854775807" in text and "e+18" not in text
    schemas = openapi(service)["components"]["schemas"]
    handles = schemas["GrantColumns"]["properties"]["handles"]["items"]
    assert (handles["minimum"], handles["maximum"]) == (0, 2**63 - 1)
    body = openapi(service)["paths"]["/v1/steps"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/StepRequest")


def test_openapi_of_a_guarded_service_documents_the_token(guarded: ServiceProcess) -> None:
    spec = openapi(guarded)
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for op in OPERATIONS.values():
        operation = spec["paths"][op.path][op.method.lower()]
        assert "401" in operation["responses"] and operation["security"] == [{"HTTPBearer": []}]


# ---------------------------------------------------------------- access


def test_the_token_is_required_on_both_transports(guarded: ServiceProcess) -> None:
    payload = {"worker_id": "intruder"}
    for token in (None, "wrong"):
        resp = raw_rest(guarded, "register", payload, token=token)
        assert (resp.status_code, resp.json()["field"]) == (401, "authorization")
        status, error = raw_ipc(guarded, "register", payload, token=token or "")
        assert (status, error["field"]) == (401, "authorization")
    assert raw_rest(guarded, "get_pool", {"verify": True}, token=TOKEN).json()["workers"] == []
    for address in (guarded.ipc, guarded.rest_unix):
        with Client(address, worker_id="friend", token=TOKEN) as client:
            assert client.register(attach=False).worker_id == "friend"
            client.deregister()
    # Probes stay open: an orchestrator has no token.
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(guarded.uds)),
                      base_url="http://svc") as http:
        assert http.get("/healthz").status_code == http.get("/readyz").status_code == 200


def test_socket_files_are_private_to_the_user(service: ServiceProcess) -> None:
    for path in (service.uds, Path(service.ipc.removeprefix("ipc://"))):
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, path
        assert info.st_uid == os.getuid()


def test_tcp_binds_loopback_only_on_both_transports(service: ServiceProcess) -> None:
    assert service.rest_tcp.startswith("http://127.0.0.1:")
    for address in (service.rest_tcp, IPC_TCP):
        with Client(address, worker_id="tcp") as client:
            assert client.get_pool().layout.num_blocks == 64
    log = service.log()
    assert "serving REST on http://127.0.0.1:" in log and f"IPC on {service.ipc}, {IPC_TCP}" in log


# ---------------------------------------------------------------- health and metrics


def test_health_readiness_and_metrics(service: ServiceProcess) -> None:
    for address in (service.ipc, service.rest_unix):
        with Client(address, worker_id="metrics-" + address[:3]) as client:
            client.register(attach=False)
            handles = client.step(new=(["m"], [4])).admitted
            client.step(grants=(handles, [1]))  # commits the first step: one NWOR window
            client.deregister()
    series = ('kvalloc_step_latency_seconds_count{transport="ipc"}',
              'kvalloc_step_latency_seconds_count{transport="rest"}',
              "kvalloc_nwor_windows_total", "kvalloc_nwor_committed_tokens_total")
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(service.uds)),
                      base_url="http://svc") as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        ready = http.get("/readyz").json()
        assert ready["status"] == "ready" and ready["epoch"] == service.epoch
        # /metrics serves the state the service last published: within about a second.
        deadline = time.monotonic() + 10
        while True:
            values = dict(line.rsplit(" ", 1) for line in http.get("/metrics").text.splitlines()
                          if line and not line.startswith("#"))
            if all(float(values[s]) >= 2 for s in series) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    for name in series:
        assert float(values[name]) >= 2, name
    assert int(float(values["kvalloc_pool_blocks"])) == 64


def test_a_refused_call_raises_the_same_error_from_every_client(service: ServiceProcess) -> None:
    errors = []
    for address in (service.ipc, service.rest_unix, service.rest_tcp):
        with Client(address, worker_id="same") as client:
            client.register(attach=False)
            handles = client.step(new=(["a"], [4])).admitted
            with pytest.raises(RemoteError) as err:
                client.step(grants=(handles, [9]))
            errors.append((err.value.status, err.value.code, err.value.field))
            client.deregister()
    assert errors == [(422, "draft_len_exceeded", "draft_len")] * 3
