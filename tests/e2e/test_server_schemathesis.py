"""schemathesis against the live OpenAPI document of a running ``kvalloc serve`` (with a token, so
authentication is fuzzed too): no 5xx, no status or body the document does not declare, and the
allocator's invariants hold afterwards."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
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


def test_invariants_hold_after_the_fuzzing(service: ServiceProcess) -> None:
    pool = httpx.get(f"{service.rest_tcp}/v1/pool", params={"verify": "true"},
                     headers=AUTH).json()
    assert pool["invariants"] == "ok"
    assert pool["free_blocks"] + pool["used_blocks"] == 64
