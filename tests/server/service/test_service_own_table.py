"""Workers that keep their own block table.

A worker registered with ``own_table`` (an overlap worker does by default) keeps its own device
copy of the block table from every reply's table changes, applied in stream order behind its
forward; the service then uploads none of its rows (they stay as they were on the shared copies,
which nobody reads there, and a repair leaves them alone) and, for an overlap worker of a pool
without prefix caching, does no device work on its calls at all: no step fence. It is granted
for a pool of one block table on one device; a worker that did not attach always keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from kvalloc.server.client import Client, step_slots
from kvalloc.server.service.core import ServiceCore
from named_worker import NamedWorker


def registered(core: ServiceCore, worker_id: str = "w", **register: object) -> NamedWorker:
    client = Client.in_process(core, worker_id=worker_id)
    client.register(**register)
    return NamedWorker(client)


def shared(core: ServiceCore) -> np.ndarray:
    return core.manager.table.device_table.cpu().numpy()


def own(worker: NamedWorker) -> np.ndarray:
    return worker.pool.block_table.cpu().numpy()


def test_an_overlap_worker_keeps_its_own_table_and_the_service_uploads_none_of_it(
        core: ServiceCore) -> None:
    w = registered(core, overlap=True)
    assert w.client.registration.own_table
    assert w.pool.block_table.data_ptr() != core.manager.table.device_table.data_ptr()
    replies = [w.step(new={"a": 20, "b": 9}), w.step(grants={"a": 3, "b": 3}),
               w.step(grants={"a": 3, "b": 3}), w.step(results={"a": 3, "b": 1}, grants={"a": 3},
                                                      finished=["b"])]
    assert all(r.tables is not None and r.tables.rows.size for r in replies)
    np.testing.assert_array_equal(own(w), core.manager.table.host)
    assert (core.manager.table.host != -1).any()
    assert (shared(core) == -1).all()  # nothing of it was uploaded
    core.check_invariants()
    assert w.client.get_pool(verify=True).invariants == "ok"  # nothing to put back


def test_a_kept_row_goes_back_to_the_shared_table_whole_when_another_worker_takes_it(
        core: ServiceCore) -> None:
    """Tampering with a kept row on the shared table hurts nobody and is not repaired; the
    change that hands the row to a worker reading the shared table uploads all of it."""
    w = registered(core, overlap=True)
    w.step(new={"a": 20})
    row = int(np.flatnonzero(core.manager.table.worker_kept)[0])
    core.manager.table.device_table[row, 10] = 5
    assert w.client.get_pool(verify=True).invariants == "ok"
    w.step(finished=["a"])
    s = registered(core, "s")
    reply = s.step(new={"c": 6})
    assert int(reply.scheduled.rows[0]) == row  # the freed row, handed out again
    np.testing.assert_array_equal(shared(core), core.manager.table.host)
    core.check_invariants()


def test_a_worker_that_keeps_its_own_table_gets_each_step_s_slots(core: ServiceCore) -> None:
    """A synchronous worker may keep its own table too (the service still fences and commits
    for it): its replies carry the slots its own table gives."""
    w = registered(core, own_table=True)
    assert w.client.registration.own_table
    for reply in (w.step(new={"a": 20}), w.step(grants={"a": 3})):
        assert reply.slot_mapping is not None
        np.testing.assert_array_equal(
            step_slots(w.pool.block_table, core.config.pool.tokens_per_block, reply).numpy(),
            reply.slot_mapping)
    assert (shared(core) == -1).all()


def test_a_worker_that_did_not_attach_keeps_its_own(core: ServiceCore) -> None:
    w = registered(core, attach=False)
    assert w.client.registration.own_table and w.pool is None
    assert w.step(new={"a": 20}).tables is not None
    assert core.manager.table.worker_kept.any() and (shared(core) == -1).all()


@pytest.mark.parametrize("register", [{"own_table": False, "overlap": True}, {}],
                         ids=["declined", "synchronous_default"])
def test_a_worker_that_does_not_ask_reads_the_shared_table(core: ServiceCore,
                                                          register: dict) -> None:
    w = registered(core, **register)
    reply = w.step(new={"a": 20})
    assert not w.client.registration.own_table and reply.tables is None
    np.testing.assert_array_equal(own(w), core.manager.table.host)
    np.testing.assert_array_equal(shared(core), core.manager.table.host)


def test_a_tensor_parallel_pool_does_not_grant_it(make_core: Callable[..., ServiceCore]) -> None:
    """Each shard's worker rank reads its own shard's table: one copy per worker would not
    do, so the shards' tables stay the service's to upload."""
    core = make_core(num_kv_heads=2, service={"devices": ["cpu", "cpu"], "tensor_parallel": 2})
    w = registered(core, overlap=True)
    assert not w.client.registration.own_table
    w.step(new={"a": 20})
    for table in core.manager.table.device_tables:
        np.testing.assert_array_equal(table.cpu().numpy(), core.manager.table.host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("register", "caching", "fenced"), [
    ({"overlap": True}, False, False),
    ({"overlap": True}, True, True),  # the service protects cached blocks on the device
    ({"overlap": True, "own_table": False}, False, True),  # it uploads the worker's rows
    ({"own_table": True}, False, True),  # it commits for a synchronous worker
], ids=["overlap", "overlap_caching", "overlap_shared_table", "synchronous"])
def test_only_an_overlap_worker_that_keeps_its_table_goes_unfenced(
        make_core: Callable[..., ServiceCore], register: dict, caching: bool,
        fenced: bool) -> None:
    core = make_core(device="cuda", service={"prefix_caching": caching})
    w = registered(core, **register)
    attachment = w.client.registration.attachment
    assert (attachment.forward_done is not None) is fenced
    assert (w.pool.fence is not None) is fenced
    for reply in (w.step(new={"a": 20, "b": 9}), w.step(grants={"a": 3, "b": 3})):
        assert reply.epoch == core.epoch
    torch.cuda.synchronize()
    np.testing.assert_array_equal(own(w), core.manager.table.host)
    core.check_invariants()
