"""Another process of the service's user tampers with what workers map read-only, against a real
`kvalloc serve`: it opens a segment from the shared-memory directory by name and writes it. A
block id written on a free row of the block table, and the protection of cached blocks zeroed,
are each put back from the service's own state and counted in
``kvalloc_shared_state_repairs_total{what}``: by a verify query (which answers
``invariants: "repaired"``), and by the service's own check every ``--verify-interval-s`` without
any call. The calls after it succeed."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from kvalloc.server.client import Client
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.devtools.launch import ServiceProcess
from prometheus_client.parser import text_string_to_metric_families

SUPPORT = Path(__file__).resolve().parents[1] / "support"
POOL = ("--device", "cpu", "--num-blocks", "64", "--tokens-per-block", "4", "--num-layers", "2",
        "--num-kv-heads", "2", "--head-dim", "8", "--max-batch-size", "8", "--max-seq-len", "64",
        "--max-draft-len", "2", "--max-step-tokens", "64", "--prefix-caching")
SYSTEM = np.arange(700, 716)  # four full blocks of 4 tokens; the prompt fills five
FREE_ROW = 7  # the worker's one request takes row 0
# The periodic check runs every 0.2 s; a loaded two-core machine may hold the service's thread
# back for seconds, never for this long.
REPAIR_DEADLINE_S = 60.0


def write_segment(name: str, offset: int, data: bytes) -> None:
    """``data`` written at ``offset`` of the segment ``name`` by a process of its own."""
    subprocess.run([sys.executable, str(SUPPORT / "shm_writer.py"), str(SHM_DIR / name),
                    str(offset), data.hex()], check=True, timeout=60)


def repairs(svc: ServiceProcess, what: str) -> float:
    with urllib.request.urlopen(f"{svc.rest_tcp}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return next((s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                 if s.name == "kvalloc_shared_state_repairs_total"
                 and s.labels == {"what": what}), 0.0)


def cached_prompt(svc: ServiceProcess) -> tuple[Client, int]:
    """A worker whose prompt's five full blocks are written, and so protected."""
    kv = Client(svc.stream, worker_id="w")
    kv.register()
    first = kv.step(new=(["a"], [20]), prompt_token_ids=np.concatenate([SYSTEM, [1] * 4]))
    handle = int(first.admitted[0])
    kv.step(grants=([handle], [2]))  # commits the prompt
    assert int(kv.pool.protected.sum()) == 5
    return kv, handle


def tamper(kv: Client) -> None:
    """A block id on a free row of the table, and the protection mask zeroed."""
    attachment = kv.registration.attachment
    cols = kv.pool.block_table.shape[1]
    write_segment(attachment.block_table.shm.name, 4 * FREE_ROW * cols,
                  (3).to_bytes(4, "little"))
    write_segment(attachment.protected.shm.name, 0, bytes(attachment.protected.shm.nbytes))


def assert_put_back_and_counted(svc: ServiceProcess, kv: Client, handle: int) -> None:
    assert (kv.pool.block_table[FREE_ROW] == -1).all() and int(kv.pool.protected.sum()) == 5
    assert repairs(svc, "block_table") == 1 and repairs(svc, "protected") == 5
    kv.step(results=([handle], [1]), grants=([handle], [2]))
    assert kv.get_pool(verify=True).invariants == "ok"
    assert repairs(svc, "block_table") == 1  # nothing more to put back


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "svc").mkdir()
    return tmp_path / "svc"


def test_a_verify_puts_back_what_another_process_wrote(workdir: Path) -> None:
    with ServiceProcess(workdir, *POOL, "--verify-interval-s", "3600") as svc:
        kv, handle = cached_prompt(svc)
        tamper(kv)
        assert int(kv.pool.block_table[FREE_ROW, 0]) == 3 and not kv.pool.protected.any()
        assert kv.get_pool(verify=True).invariants == "repaired"
        assert_put_back_and_counted(svc, kv, handle)
        kv.deregister()


def test_the_service_puts_it_back_by_itself_without_any_call(workdir: Path) -> None:
    with ServiceProcess(workdir, *POOL, "--verify-interval-s", "0.2") as svc:
        kv, handle = cached_prompt(svc)
        tamper(kv)  # the check may put it back before the second write even starts
        deadline = time.monotonic() + REPAIR_DEADLINE_S
        while repairs(svc, "block_table") < 1 or repairs(svc, "protected") < 5:
            assert time.monotonic() < deadline, "the periodic check never repaired the pool"
            time.sleep(0.05)  # a scrape, no call of the protocol
        assert_put_back_and_counted(svc, kv, handle)
        kv.deregister()
