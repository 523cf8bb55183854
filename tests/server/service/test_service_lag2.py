"""Overlap workers through the service, in process: ``register(overlap=True)`` runs a worker's
steps at lag 2 (a grant may find the request's previous step unsettled, results come one call
late and settle the oldest step, a revert undoes the newest), the service writes nothing for it,
and a worker registered without it keeps today's contract."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from kvalloc.server.client import Client, step_slots
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.contract.errors import RemoteError
from kvalloc.server.service.core import ServiceCore
from lag2_worker import Lag2Worker
from named_worker import NamedWorker
from service_harness import POISON, TTL, FakeClock, stage_pattern


def overlap_worker(core: ServiceCore, worker_id: str = "w", *, attach: bool = True,
                   overlap: bool = True) -> NamedWorker:
    client = Client.in_process(core, worker_id=worker_id)
    client.register(attach=attach, overlap=overlap)
    return NamedWorker(client)


def account(w: NamedWorker, name: str) -> tuple[int, int]:
    state = w.client.get_request(name)
    return state.capacity, state.history


def starts(reply: object) -> list[int]:
    return reply.scheduled.start_positions.tolist()  # type: ignore[attr-defined]


def test_the_lag_2_reference_values_through_the_service(core: ServiceCore) -> None:
    """docs/design.md's lag-2 table (D = 3), from history 20."""
    w = overlap_worker(core)
    w.step(new={"a": 20})
    assert starts(w.step(grants={"a": 3})) == [20]  # step 1: nothing unsettled
    assert account(w, "a") == (24, 20)
    # Step 2 is granted behind step 1: it starts at history + 1, the device adds what 1 accepted.
    assert starts(w.step(grants={"a": 3})) == [21]
    assert account(w, "a") == (28, 20)
    reply = w.step(results={"a": 2}, grants={"a": 3})  # step 1's results; step 3 behind step 2
    assert starts(reply) == [24] and account(w, "a") == (31, 23)
    # Step 2's results and step 3's revert in one call: capacity is history again.
    w.step(results={"a": 3}, reverts=["a"])
    assert account(w, "a") == (27, 27)
    core.check_invariants()


def test_random_lag_2_schedules_keep_every_request_exact(core: ServiceCore) -> None:
    """Six schedules of 40 calls, `Lag2Worker` checking each request after every call and the
    core its invariants; together they meet every case of the timeline."""
    totals = np.zeros(3, dtype=np.int64)
    for seed in range(6):
        client = Client.in_process(core, worker_id=f"w{seed}")
        client.register(overlap=True)
        worker = Lag2Worker(client, seed, after_call=core.check_invariants)
        done = worker.run(40)
        totals += (done.behind, done.revert_with_result, done.finished_in_flight)
        worker.finish_all()
        assert core.manager.used_blocks == 0, seed
        client.deregister()
    assert (totals > [60, 0, 0]).all(), totals


def test_the_older_step_must_be_settled_and_nothing_changes_when_it_is_not(
        core: ServiceCore) -> None:
    w = overlap_worker(core)
    w.step(new={"a": 8, "b": 8})
    w.step(grants={"a": 2, "b": 2})
    w.step(grants={"a": 2, "b": 2})  # both behind their first step
    before = core.get_pool(wire.PoolQuery(verify=True))
    # b's first step ran two calls ago: its results are due now; a revert would undo its newer.
    for settle in ({"results": {"a": 1}}, {"results": {"a": 1}, "reverts": ["b"]}):
        with pytest.raises(RemoteError) as err:
            w.step(**settle)  # type: ignore[arg-type]
        assert (err.value.status, err.value.code, err.value.field) == (
            422, "unsettled_requests", "results")
        assert f"handle {w.handle('b')} ran in step 1" in err.value.message
    assert core.get_pool(wire.PoolQuery(verify=True)) == before
    # A third unsettled step is refused the same way: its older step's results are missing.
    with pytest.raises(RemoteError, match="unsettled_requests"):
        w.step(results={"a": 1}, grants={"b": 2})
    w.step(results={"a": 1, "b": 0})
    # Those results settled the older steps: the newer ones are due next, and still asked for.
    with pytest.raises(RemoteError, match="ran in step 2"):
        w.step()
    core.check_invariants()


def test_a_revert_without_a_newer_step_undoes_the_older_one(core: ServiceCore) -> None:
    w = overlap_worker(core)
    w.step(new={"a": 8})
    w.step(grants={"a": 2})
    w.step()  # nothing granted now: the step of the call before stays the newest
    w.step(reverts=["a"])  # its forward never ran
    assert account(w, "a") == (8, 8)
    core.check_invariants()


def test_early_results_settle_the_newest_step_and_are_not_asked_for_again(
        core: ServiceCore) -> None:
    w = overlap_worker(core)
    w.step(new={"a": 8})
    w.step(grants={"a": 2})
    w.step(results={"a": 1}, grants={"a": 2})  # step 1 done early: step 2 has nothing behind
    assert account(w, "a") == (13, 10)
    w.step(grants={"a": 2})  # step 1 is not due again
    w.step(results={"a": 2})  # step 2; step 3 stays unsettled
    assert account(w, "a") == (16, 13)
    core.check_invariants()


def test_a_request_finished_with_two_steps_in_flight_gives_back_every_block(
        core: ServiceCore) -> None:
    w = overlap_worker(core)
    w.step(new={"a": 8, "b": 5})
    w.step(grants={"a": 3, "b": 3})
    w.step(grants={"a": 3, "b": 3})
    reply = w.step(results={"b": 1}, finished=["a"], grants={"b": 3})
    assert core.registry.get("w").req_ids.keys() == {"b"}
    core.check_invariants()
    # a's row may go to a new request at once; nothing of a's steps is asked for again.
    w.step(results={"b": 2}, finished=["b"], new={"c": 4})
    assert reply.committed == wire.CommitSummary(tokens=0, written=0)
    w.step(finished=["c"])
    assert core.manager.used_blocks == 0
    core.check_invariants()


def test_a_worker_without_overlap_still_settles_every_step_by_the_next(
        core: ServiceCore) -> None:
    w = overlap_worker(core, overlap=False)
    w.step(new={"a": 8})
    w.step(grants={"a": 2})
    with pytest.raises(RemoteError) as err:
        w.step(grants={"a": 2})
    assert (err.value.status, err.value.code) == (422, "unsettled_requests")


def test_a_retried_lag_2_call_is_answered_again_not_applied_again(core: ServiceCore) -> None:
    w = overlap_worker(core)
    client = w.client
    w.step(new={"a": 8})
    w.step(grants={"a": 3})
    reg = client.registration
    assert reg is not None
    call = StepCall.build(client.worker_id, reg.session, reg.epoch, client.next_step_id,
                          grant_handles=[w.handle("a")], draft_lens=[3])  # behind step 1
    first = client.call("step", call)
    state = core.get_pool(wire.PoolQuery(verify=True)), account(w, "a")
    assert client.call("step", call) == first
    assert (core.get_pool(wire.PoolQuery(verify=True)), account(w, "a")) == state
    client.next_step_id = call.step_id + 1
    w.step(results={"a": 3})  # the retry did not grant twice: one step settles, one waits
    assert account(w, "a") == (16, 12)
    core.check_invariants()


def test_the_service_writes_nothing_for_an_overlap_worker(core: ServiceCore) -> None:
    w = overlap_worker(core)
    assert w.pool is not None
    kv = w.pool.kv
    kv.fill_(POISON)
    for step in ({"new": {"a": 6}}, {"grants": {"a": 2}}, {"grants": {"a": 2}},
                 {"results": {"a": 2}, "finished": ["a"]}):
        stage_pattern(w.pool.staging, 8, tag=1)  # were the service to read staging
        reply = w.step(**step)  # type: ignore[arg-type]
        assert reply.committed == wire.CommitSummary(tokens=0, written=0, fallback=None)
    assert bool((kv == POISON).all())


def test_an_unattached_overlap_worker_gets_tables_and_computes_its_slots(
        core: ServiceCore) -> None:
    w = overlap_worker(core, attach=False)
    layout = w.client.registration.layout  # type: ignore[union-attr]
    replica = np.full((layout.max_batch_size, layout.max_blocks_per_seq), -1, dtype=np.int32)
    for step in ({"new": {"a": 6}}, {"grants": {"a": 3}}, {"grants": {"a": 3}}):
        reply = w.step(**step)  # type: ignore[arg-type]
        assert reply.tables is not None and reply.slot_mapping is not None
        assert reply.slot_mapping.size == 0  # its grants' true starts are on its device
        reply.tables.apply(replica)
    assert np.array_equal(replica, core.manager.table.host)
    # Step 1 accepted 2 drafts: step 2 runs from 6 + 1 + 2 = 9, the reply's start being 7.
    assert starts(reply) == [7]
    slots = step_slots(torch.from_numpy(replica), layout.tokens_per_block, reply,
                       torch.tensor([2]))
    row = int(reply.scheduled.rows[0])
    want = [int(replica[row, p // 4]) * 4 + p % 4 for p in range(9, 13)]
    assert slots.tolist() == want


def test_a_lease_ends_with_two_steps_in_flight_and_everything_comes_back(
        core: ServiceCore, clock: FakeClock) -> None:
    w = overlap_worker(core, "doomed")
    w.step(new={"a": 8, "b": 12})
    w.step(grants={"a": 3, "b": 3})
    w.step(grants={"a": 3, "b": 3})
    assert core.manager.used_blocks > 0
    clock.now += TTL + 1
    assert core.expire_leases() == 1
    assert (core.manager.used_blocks, core.manager.num_requests, len(core.registry)) == (0, 0, 0)
    core.check_invariants()
    # The id registers afresh: a new session, nothing in flight.
    fresh = overlap_worker(core, "doomed")
    fresh.step(new={"a": 4})
    fresh.step(grants={"a": 1})
    core.check_invariants()


def test_deregistering_with_two_steps_in_flight_frees_them(core: ServiceCore) -> None:
    w = overlap_worker(core)
    w.step(new={"a": 8})
    w.step(grants={"a": 3})
    w.step(grants={"a": 3})
    assert w.client.deregister().freed_requests == 1
    assert core.manager.used_blocks == 0
    core.check_invariants()


def test_prefix_caching_shares_its_protection_with_an_overlap_worker(
        make_core: Callable[..., ServiceCore]) -> None:
    """An overlap worker commits its own tokens, so it maps the mask of cached prefix blocks
    that the service keeps current, and its commit refuses them as the service's does."""
    core = make_core(service={"prefix_caching": True})
    w = overlap_worker(core)
    protected = w.client.pool.protected
    assert protected is not None and protected.dtype == torch.bool
    assert protected.shape == (core.config.pool.total_blocks,) and not protected.any()
    core.pool.committer.protect(np.array([3, 5]), np.array([True, True]))
    assert protected.nonzero().flatten().tolist() == [3, 5]
