"""Workers that keep their own block table.

A worker that keeps its own table (``Registration.own_table``) brings its own copy up to date
from every reply's table changes; the service then uploads none of its rows: they stay as they
were on the shared copies, which nobody reads there, a repair leaves them alone, and the change
that hands such a row to another worker uploads all of it. A worker that did not attach always
keeps its own. An attached worker asks with ``own_table`` (an overlap worker does by default) and
is granted it for a pool of one block table on one CUDA device: it applies the changes on its
stream behind its forward, and for the overlap worker of a service of one worker without prefix
caching the service then does no device work on its calls at all (no step fence). A CPU pool's
table is shared memory, which costs a worker nothing to read: it is not granted there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from kvalloc.server.client import Client, OwnTable, step_slots
from kvalloc.server.service.core import ServiceCore
from named_worker import NamedWorker


def registered(core: ServiceCore, worker_id: str = "w", **register: object) -> NamedWorker:
    client = Client.in_process(core, worker_id=worker_id)
    client.register(**register)
    return NamedWorker(client)


def shared(core: ServiceCore) -> np.ndarray:
    return core.manager.table.device_table.cpu().numpy()


class KeptTable:
    """A detached worker's own copy of the table, brought up to date from its replies as an
    attached worker's client does (`OwnTable`, here over a CPU tensor)."""

    def __init__(self, core: ServiceCore) -> None:
        self.own = OwnTable.like(core.manager.table.device_table)

    def step(self, worker: NamedWorker, **columns: object) -> None:
        reply = worker.step(**columns)  # type: ignore[arg-type]
        assert reply.tables is not None
        self.own.apply(reply.tables)


def test_the_rows_of_a_worker_that_keeps_its_own_table_are_never_uploaded(
        core: ServiceCore) -> None:
    w = registered(core, attach=False)
    assert w.client.registration.own_table and w.pool is None
    kept = KeptTable(core)
    kept.step(w, new={"a": 20, "b": 9})
    kept.step(w, grants={"a": 3, "b": 3})
    kept.step(w, results={"a": 3, "b": 1}, grants={"a": 3}, finished=["b"])
    np.testing.assert_array_equal(kept.own.host, core.manager.table.host)
    np.testing.assert_array_equal(kept.own.device.tensor.numpy(), core.manager.table.host)
    assert (core.manager.table.host != -1).any()
    assert (shared(core) == -1).all()  # nothing of it was uploaded
    core.check_invariants()
    assert w.client.get_pool(verify=True).invariants == "ok"  # nothing to put back


def test_a_kept_row_goes_back_to_the_shared_table_whole_when_another_worker_takes_it(
        core: ServiceCore) -> None:
    """Tampering with a kept row on the shared table hurts nobody and is not repaired; the
    change that hands the row to a worker reading the shared table uploads all of it."""
    w = registered(core, attach=False)
    w.step(new={"a": 20})
    row = int(np.flatnonzero(core.manager.table.worker_kept)[0])
    core.manager.table.device_table[row, 10] = 5
    assert w.client.get_pool(verify=True).invariants == "ok"
    w.step(finished=["a"])
    s = registered(core, "s")
    assert not s.client.registration.own_table
    reply = s.step(new={"c": 6})
    assert int(reply.scheduled.rows[0]) == row  # the freed row, handed out again
    np.testing.assert_array_equal(shared(core), core.manager.table.host)
    core.check_invariants()


def test_a_session_that_ends_gives_its_kept_rows_back_uploaded(core: ServiceCore) -> None:
    w = registered(core, attach=False)
    w.step(new={"a": 20, "b": 30})
    core.manager.table.device_table[core.manager.table.worker_kept, 0] = 7  # unread, unrepaired
    w.client.deregister()
    assert not core.manager.table.worker_kept.any()
    np.testing.assert_array_equal(shared(core), core.manager.table.host)
    core.check_invariants()


@pytest.mark.parametrize("register", [{"overlap": True}, {"own_table": True}],
                         ids=["overlap", "asked"])
def test_an_attached_worker_on_a_cpu_pool_reads_the_shared_table(core: ServiceCore,
                                                                 register: dict) -> None:
    w = registered(core, **register)
    reply = w.step(new={"a": 20})
    assert not w.client.registration.own_table and reply.tables is None
    np.testing.assert_array_equal(w.pool.block_table.numpy(), core.manager.table.host)
    np.testing.assert_array_equal(shared(core), core.manager.table.host)


@pytest.fixture
def cuda_core(make_core: Callable[..., ServiceCore]) -> Callable[..., ServiceCore]:
    return lambda **service: make_core(device="cuda", service=service)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "synchronous"])
@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")  # skips without CUDA
def test_a_cuda_worker_keeps_its_own_table_and_the_service_uploads_none_of_it(
        cuda_core: Callable[..., ServiceCore], overlap: bool) -> None:
    """A synchronous worker may keep its own table too (the service still fences and commits
    for it): its replies carry the slots its own table gives."""
    core = cuda_core()
    w = registered(core, overlap=overlap, own_table=True)
    assert w.client.registration.own_table
    assert w.pool.block_table.data_ptr() != core.manager.table.device_table.data_ptr()
    for columns in ({"new": {"a": 20, "b": 9}}, {"grants": {"a": 3, "b": 3}},
                    {"results": {"a": 3, "b": 1}, "grants": {"a": 3}, "finished": ["b"]}):
        reply = w.step(**columns)
        if not overlap:  # the slots of the step's forward, which reads the table as it is now
            np.testing.assert_array_equal(step_slots(
                w.pool.block_table, core.config.pool.tokens_per_block, reply).cpu().numpy(),
                reply.slot_mapping)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(w.pool.block_table.cpu().numpy(), core.manager.table.host)
    assert (shared(core) == -1).all()
    core.check_invariants()
    assert w.client.get_pool(verify=True).invariants == "ok"


@pytest.mark.parametrize(("register", "service", "fenced"), [
    ({"overlap": True}, {}, False),
    # Another worker could be handed a block this one's forward, launched ahead, still writes.
    ({"overlap": True}, {"max_workers": 2}, True),
    ({"overlap": True}, {"prefix_caching": True}, True),  # it protects cached blocks on the GPU
    ({"overlap": True, "own_table": False}, {}, True),  # it uploads the worker's rows
    ({"own_table": True}, {}, True),  # it commits for a synchronous worker
], ids=["overlap", "overlap_two_workers", "overlap_caching", "overlap_shared_table",
        "synchronous"])
@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")  # skips without CUDA
def test_only_the_one_overlap_worker_that_keeps_its_table_goes_unfenced(
        cuda_core: Callable[..., ServiceCore], register: dict, service: dict,
        fenced: bool) -> None:
    core = cuda_core(**{"max_workers": 1, **service})
    w = registered(core, **register)
    assert (w.client.registration.attachment.forward_done is not None) is fenced
    assert (w.pool.fence is not None) is fenced
    w.step(new={"a": 20, "b": 9})
    w.step(grants={"a": 3, "b": 3})
    torch.cuda.synchronize()
    np.testing.assert_array_equal(w.pool.block_table.cpu().numpy(), core.manager.table.host)
    core.check_invariants()


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_device")  # skips without CUDA
def test_a_tensor_parallel_pool_does_not_grant_it(make_core: Callable[..., ServiceCore]) -> None:
    """Each rank reads its own shard's table: the shards' tables stay the service's."""
    core = make_core(device="cuda", num_kv_heads=2,
                     service={"devices": ["cuda:0", "cuda:0"], "tensor_parallel": 2})
    w = registered(core, overlap=True)
    assert not w.client.registration.own_table
    w.step(new={"a": 20})
    torch.cuda.synchronize()
    for table in core.manager.table.device_tables:
        np.testing.assert_array_equal(table.cpu().numpy(), core.manager.table.host)

