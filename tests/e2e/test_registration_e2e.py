"""Registering with a real `kvalloc serve`: a retry of a registration whose reply came late is
answered with the session it opened (nothing orphaned, no `worker_id_in_use`), a retry of a
deregistration whose reply came late with the first attempt's reply (not `unknown_worker`), and
a service started with nothing compiled answers its first registration and steps within the
timeout a worker would use for any call."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.errors import NotRegistered
from kvalloc.server.devtools.launch import ServiceProcess

SMALL_POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4",
              "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
              "--max-batch-size", "8", "--max-seq-len", "64", "--max-step-tokens", "64")
REPLY_TIMEOUT_S = 4.0  # several hundred times what a register takes on a busy 2-core machine
# What a worker allows any call (the first H200 session was lost with 3 s): a warm service
# answers in milliseconds, a cold one used to compile for 12-15 s under its lock first.
FIRST_CALL_TIMEOUT_S = 3.0
T = TypeVar("T")
COMPILE_TIMEOUT_S = 300.0  # compiling every loop from nothing, at start, on a loaded machine


def while_stopped(svc: ServiceProcess, call: Callable[[], T]) -> T:
    """``call()``'s result, made while the service is stopped (SIGSTOP) for long enough that the
    call's first attempt times out and its retry is sent; resumed, the service answers both."""
    assert svc.proc is not None
    outcome: dict[str, Any] = {}

    def make_call() -> None:
        try:
            outcome["result"] = call()
        except Exception as exc:
            outcome["error"] = exc

    os.kill(svc.proc.pid, signal.SIGSTOP)
    try:
        calling = threading.Thread(target=make_call)
        calling.start()
        time.sleep(1.5 * REPLY_TIMEOUT_S)  # the first attempt timed out, the retry sent
    finally:
        os.kill(svc.proc.pid, signal.SIGCONT)
    calling.join()
    assert "error" not in outcome, outcome
    return outcome["result"]


def test_a_register_retried_after_a_late_reply_gets_the_session_it_opened(
        tmp_path: Path) -> None:
    """The service is stopped while a worker registers: the first attempt times out and the
    client sends it again; resumed, the service answers both in order. The retry gets the same
    session, which steps; the service holds one session for the id, and deregistering it leaves
    none."""
    with ServiceProcess(tmp_path, *SMALL_POOL, tcp=False) as svc:
        assert svc.proc is not None
        with Client(svc.ipc, worker_id="late-reply", timeout_s=REPLY_TIMEOUT_S,
                    retries=1) as client:
            client.get_pool()  # connected before the service stops: the retry queues on it
            while_stopped(svc, lambda: client.register(attach=False))
            assert client.step(new=(["a"], [4])).admitted[0] >= 0
            (held,) = client.get_pool().workers
            assert (held.worker_id, held.num_requests) == ("late-reply", 1)
            client.deregister()
            assert client.get_pool().workers == []


def test_a_deregister_retried_after_a_late_reply_gets_the_first_attempts_reply(
        tmp_path: Path) -> None:
    """The service is stopped while a worker deregisters: the first attempt times out and the
    client sends it again; resumed, the service ends the session on the first and answers the
    retry with the first one's reply (1 request freed), not `404 unknown_worker`. Another
    session's deregister is not taken for a retry of it."""
    with ServiceProcess(tmp_path, *SMALL_POOL, tcp=False) as svc:
        assert svc.proc is not None
        with Client(svc.ipc, worker_id="late-reply", timeout_s=REPLY_TIMEOUT_S,
                    retries=1) as client:
            reg = client.register(attach=False)
            assert client.step(new=(["a"], [4])).admitted[0] >= 0
            reply = while_stopped(svc, client.deregister)
            assert (reply.worker_id, reply.freed_requests) == ("late-reply", 1)
            pool = client.get_pool()
            assert pool.workers == [] and pool.num_requests == 0 and pool.used_blocks == 0
            again = client.call("deregister", wire.WorkerRef(worker_id="late-reply",
                                                             session=reg.session))
            assert again == reply  # as often as it comes
            with pytest.raises(NotRegistered):
                client.call("deregister", wire.WorkerRef(worker_id="late-reply",
                                                         session=reg.session + 1))


def test_a_service_that_compiled_nothing_yet_answers_its_first_calls_at_once(
        tmp_path: Path) -> None:
    """An empty numba cache, as on a fresh install: the service compiles at start, before it
    reports ready, and a worker's first registration and steps each answer within
    `FIRST_CALL_TIMEOUT_S`, without a retry."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    with ServiceProcess(tmp_path, *SMALL_POOL, env=env, ready_timeout_s=COMPILE_TIMEOUT_S,
                        tcp=False) as svc:
        assert "compiled the step" in svc.log()
        with Client(svc.stream, worker_id="first", timeout_s=FIRST_CALL_TIMEOUT_S,
                    retries=0) as client:
            client.register()
            (a,) = client.step(new=(["a"], [6])).admitted
            client.step(grants=([a], [3]))
            client.step(results=([a], [2]), grants=([a], [3]))
            client.step(results=([a], [0]), finished=[a])
            assert client.get_pool(verify=True).invariants == "ok"
