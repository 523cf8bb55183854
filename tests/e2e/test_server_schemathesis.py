"""schemathesis against the live OpenAPI document of a running ``kvalloc serve`` (with a token, so
authentication is fuzzed too): no 5xx, no status or body the document does not declare, and the
allocator's invariants hold afterwards. A number without a fractional part is an integer, as the
document's JSON Schema says; and the schemathesis command itself, every phase and check under the
repository's schemathesis.toml, runs clean."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from kvalloc.server.client import Client
from kvalloc.server.contract.operations import OPERATIONS
from kvalloc.server.devtools.launch import ServiceProcess
from schemathesis.config import SchemathesisConfig

ROOT = Path(__file__).resolve().parents[2]
SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4", "--num-layers",
              "1", "--num-kv-heads", "1", "--head-dim", "8", "--max-batch-size", "8",
              "--max-seq-len", "64", "--max-step-tokens", "64", "--lease-ttl-s", "300")
TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Every check, "valid data must be accepted" (ST202) included, under the repository's
# schemathesis.toml: it lets a step alone answer a schema-valid body 422, for the rules between
# its columns that StepRequest's description states and JSON Schema cannot.
CONFIG = SchemathesisConfig.from_path(ROOT / "schemathesis.toml")
CHECKS = {"headers": AUTH}
# Bounded and derandomised: the same examples every run, well inside the suite's time budget.
QUICK = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck),
                 database=None, derandomize=True)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("fuzz"), *SMALL_POOL,
                        env={"KVALLOC_TOKEN": TOKEN}) as svc:
        yield svc


@pytest.fixture(scope="module")
def fuzz_worker(service: ServiceProcess) -> Iterator[Client]:
    """Registered before any fuzzing, so the generated registrations (which may fill every
    worker slot: 409 too_many_workers, as documented) leave it its session."""
    with Client(service.rest_tcp, worker_id="fuzz", token=TOKEN) as client:
        client.register(attach=False)
        yield client


@pytest.fixture(scope="module")
def api_schema(service: ServiceProcess, fuzz_worker: Client) -> Any:
    return schemathesis.openapi.from_url(f"{service.rest_tcp}/openapi.json", config=CONFIG)


ENDPOINTS = [(op.method, op.path) for op in OPERATIONS.values()] + [
    ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")]


def test_the_document_lists_exactly_these_endpoints(api_schema: Any) -> None:
    listed = {(method.upper(), path) for path, item in api_schema.raw_schema["paths"].items()
              for method in item}
    assert listed == set(ENDPOINTS)


# ------------------------------------- integers as JSON Schema has them (before the fuzzing, which
# may fill every worker slot)


def body_schema(api_schema: Any, name: str) -> jsonschema.protocols.Validator:
    """A validator of the live document's ``name`` component (its references resolved)."""
    doc = api_schema.raw_schema
    return jsonschema.Draft202012Validator({**doc["components"]["schemas"][name],
                                            "components": doc["components"]})


def post(service: ServiceProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{service.rest_tcp}{path}", json=body, headers=AUTH, timeout=30)


@pytest.mark.parametrize(("field", "value"), [("nonce", 733), ("data_parallel_rank", 460),
                                              ("data_parallel_rank", 0)])
def test_an_integral_number_is_an_integer_as_json_schema_says(
        service: ServiceProcess, api_schema: Any, field: str, value: int) -> None:
    """JSON Schema counts 733.0 as an integer: a registration that writes an integer field so
    is answered as the one that writes 733, as the document declares."""
    body = {"worker_id": f"whole-{field}-{value}", field: float(value)}
    assert body_schema(api_schema, "RegisterRequest").is_valid(body)
    case = api_schema["/v1/workers"]["POST"].Case(body=body)
    as_float = case.call_and_validate(**CHECKS)
    as_int = post(service, "/v1/workers", {**body, field: value, "replace": True})
    assert (as_float.status_code, as_float.json().get("code")) == (
        as_int.status_code, as_int.json().get("code"))
    if as_int.status_code == 200:
        session = as_int.json()["session"]
        httpx.delete(f"{service.rest_tcp}/v1/workers/{body['worker_id']}",
                     params={"session": session}, headers=AUTH, timeout=30).raise_for_status()


def test_an_integral_number_in_a_step_is_an_integer_too(service: ServiceProcess,
                                                         api_schema: Any) -> None:
    with Client(service.rest_tcp, worker_id="whole-steps", token=TOKEN) as client:
        reg = client.register(attach=False)
        body = {"worker_id": "whole-steps", "session": float(reg.session),
                "epoch": float(reg.epoch), "step_id": 1.0,
                "new": {"req_ids": ["a"], "prompt_lens": [12.0]}}
        assert body_schema(api_schema, "StepRequest").is_valid(body)
        as_float = post(service, "/v1/steps", body)
        assert as_float.status_code == 200, as_float.text
        retried = post(service, "/v1/steps", {**body, "session": reg.session, "epoch": reg.epoch,
                                              "step_id": 1, "new": {"req_ids": ["a"],
                                                                    "prompt_lens": [12]}})
        assert retried.json() == as_float.json()  # the same step: its reply again
        assert client.get_pool().num_requests >= 1
        client.deregister()


def nested(depth: int) -> Any:
    value: Any = 1.0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("value", "refusal"), [("7", "valid integer"), (7.5, "valid integer"),
                                                (True, "valid integer"),
                                                (nested(900), "valid integer")],
                         ids=["string", "fraction", "bool", "deep"])
def test_a_string_or_a_fraction_is_still_no_integer(service: ServiceProcess, value: Any,
                                                    refusal: str) -> None:
    """Only a number without a fractional part is an integer: "7", 7.5 (or an array nested
    deeper than any message) are refused 422, naming the field, and nothing is registered."""
    answer = post(service, "/v1/workers", {"worker_id": "not-whole", "nonce": value})
    assert answer.status_code == 422
    assert answer.json()["field"] == "nonce" and refusal in answer.json()["message"]
    step = post(service, "/v1/steps", {"worker_id": "not-whole", "session": 1, "epoch": 1,
                                       "step_id": value})
    assert (step.status_code, step.json()["field"]) == (422, "step_id")
    pool = httpx.get(f"{service.rest_tcp}/v1/pool", headers=AUTH, timeout=30).json()
    assert "not-whole" not in [w["worker_id"] for w in pool["workers"]]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS, ids=[f"{m} {p}" for m, p in ENDPOINTS])
def test_every_operation_answers_as_documented(api_schema: Any, method: str, path: str) -> None:
    @given(case=api_schema[path][method].as_strategy())
    @QUICK
    def run(case: Any) -> None:
        case.call_and_validate(**CHECKS)

    run()


def test_random_steps_of_a_registered_worker_answer_as_documented(fuzz_worker: Client,
                                                                  api_schema: Any) -> None:
    """Generated step bodies, aimed at a live worker so they reach the allocator itself."""
    reg = fuzz_worker.registration
    assert reg is not None
    step_ids = itertools.count(1)
    accepted = 0

    @given(case=api_schema["/v1/steps"]["POST"].as_strategy())
    @settings(QUICK, max_examples=150)
    def run(case: Any) -> None:
        nonlocal accepted
        if isinstance(case.body, dict):
            case.body = {**case.body, "worker_id": "fuzz", "session": reg.session,
                         "epoch": reg.epoch, "step_id": next(step_ids)}
        response = case.call_and_validate(**CHECKS)
        accepted += response.status_code == 200

    run()
    assert accepted > 0, "no generated step reached the allocator"


def test_the_schemathesis_command_runs_every_check_clean(service: ServiceProcess,
                                                         tmp_path: Path) -> None:
    """The run that the repository's schemathesis.toml describes, as a person would start it:
    every phase (coverage, fuzzing, stateful) and every check, bounded and seeded. It runs in a
    directory of its own: schemathesis writes its crash cache (``.schemathesis/``) there."""
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file",
         str(ROOT / "schemathesis.toml"), "run", "--checks", "all", "--max-examples", "50",
         "--seed", "1", "-H", f"Authorization: Bearer {TOKEN}",
         f"{service.rest_tcp}/openapi.json"],
        capture_output=True, text=True, timeout=900, check=False, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]


def test_invariants_hold_after_the_fuzzing(service: ServiceProcess) -> None:
    pool = httpx.get(f"{service.rest_tcp}/v1/pool", params={"verify": "true"},
                     headers=AUTH).json()
    assert pool["invariants"] == "ok"
    assert pool["free_blocks"] + pool["used_blocks"] == 64
