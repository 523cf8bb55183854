"""The service core, in process, through the same `Client` methods a worker uses over IPC or REST:
the per-step call's semantics, handles and sessions, NWOR commit, idempotent step ids, leases,
epochs, limits."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable

import numpy as np
import pytest
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.contract.columns import StepCall
from kvalloc.server.contract.errors import (
    NotRegistered,
    RemoteError,
    ServiceRestarted,
    SessionEnded,
)
from kvalloc.server.contract.sharing import SHM_DIR
from kvalloc.server.service import registry
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig
from named_worker import NamedWorker
from service_harness import (
    POISON,
    TTL,
    FakeClock,
    committed_slots,
    nwor_scenario,
    pool_mismatches,
    stage_pattern,
)


class Recorder:
    """A ServiceObserver that remembers what it was told."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float]] = []
        self.leases = 0
        self.violations = 0
        self.repaired: list[dict[str, int]] = []
        self.changes = 0

    def observe_step(self, transport: str, seconds: float) -> None:
        self.steps.append((transport, seconds))

    def lease_expired(self, n: int = 1) -> None:
        self.leases += n

    def invariant_violation(self, n: int = 1) -> None:
        self.violations += n

    def shared_state_repaired(self, repaired: dict[str, int]) -> None:
        self.repaired.append(repaired)

    def state_changed(self) -> None:
        self.changes += 1


def worker(core: ServiceCore, worker_id: str = "w", *, attach: bool = True) -> NamedWorker:
    client = Client.in_process(core, worker_id=worker_id)
    client.register(attach=attach)
    return NamedWorker(client)


def state_of(core: ServiceCore) -> tuple[object, ...]:
    """Everything a refused call must leave unchanged."""
    pool = core.get_pool(wire.PoolQuery(verify=True))
    requests = sorted((w.worker_id, r, core.get_request(wire.RequestRef(
        worker_id=w.worker_id, session=w.session, req_id=r))) for w in core.registry
        for r in w.req_ids)
    return (pool.free_blocks, pool.num_requests, pool.capacity_tokens, pool.history_tokens,
            pool.pending_slack_tokens, tuple(requests),
            core.manager.table.host.tobytes(), core.registry.owner.tobytes(),
            core.registry.handles.tobytes())


# ---------------------------------------------------------------- the step's tokens


def test_a_step_lays_out_every_scheduled_token_on_its_requests_blocks(core: ServiceCore) -> None:
    w = worker(core)
    assert w.pool is not None
    reply = w.step(new={"a": 5, "b": (9, 3)})
    assert w.scheduled(reply) == [("a", 0, 5, 0, 0), ("b", 5, 3, 0, 0)]
    reply = w.step(results={}, grants={"a": 3}, prefill={"b": 6})
    # Decode grants first, then prefill chunks; a chunk starts where the prompt left off.
    assert w.scheduled(reply) == [("a", 0, 4, 3, 5), ("b", 4, 6, 0, 3)]
    reply = w.step(results={"a": 1}, grants={"a": 2, "b": 3})

    # Tokens: decode grants first, in request order, each a contiguous run at consecutive
    # positions starting at the request's history; the last num_drafts of each are drafts.
    assert w.scheduled(reply) == [("a", 0, 3, 2, 7), ("b", 3, 4, 3, 9)]
    tpb = core.config.pool.tokens_per_block
    table = w.pool.block_table
    slots = w.pool.slot_mapping(reply).numpy()
    s = reply.scheduled
    for row, offset, n, start in zip(s.rows, s.token_offsets, s.num_tokens, s.start_positions,
                                     strict=True):
        for i in range(n):
            pos = start + i
            block = int(table[row, pos // tpb])
            assert slots[offset + i] == block * tpb + pos % tpb >= 0
    # The shared block table is the service's, row for row, and the batch the service will
    # commit uses the same slots as the worker's forward.
    assert (table.numpy() == core.manager.table.host).all()
    assert (core.registry.get("w").batch.slots == slots).all()


def test_a_worker_that_did_not_attach_keeps_its_table_from_the_replies(
        core: ServiceCore) -> None:
    """Table deltas and slot mappings travel only to a worker without the shared table; replayed
    on a mirror they give the service's table, and the slots are the table's."""
    w = worker(core, attach=False)
    assert w.pool is None
    mirror = np.full(core.manager.table.host.shape, -1, dtype=np.int64)
    tpb = core.config.pool.tokens_per_block
    rng = np.random.default_rng(0)
    born: dict[str, int] = {}  # live request -> step admitted (requests live <= 8 steps)
    ran: set[str] = set()  # decode requests of the previous step
    for step in range(40):
        done = [r for r, t in born.items() if rng.random() < 0.2 or step - t > 8]
        keep = [r for r in born if r not in done]
        new = {f"r{step}": int(rng.integers(1, 12))} if len(keep) < 6 else {}
        reply = w.step(results={r: int(rng.integers(0, 4)) for r in ran if r in keep},
                       finished=done, grants={r: 3 for r in keep}, new=new)
        assert reply.tables is not None and reply.slot_mapping is not None
        reply.tables.apply(mirror)
        assert (mirror == core.manager.table.host).all(), step
        request, positions = reply.scheduled.positions()
        blocks = mirror[reply.scheduled.rows[request], positions // tpb]
        assert (reply.slot_mapping == blocks * tpb + positions % tpb).all()
        ran = {name for name, *_ in w.scheduled(reply)} & set(keep)  # the granted ones
        admitted = {w.name(h) for h in reply.admitted.tolist() if h >= 0}
        born = {r: born[r] for r in keep} | {r: step for r in new if r in admitted}


def test_padding_runs_the_grant_with_the_padded_draft_length(core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4})
    reply = w.step(grants={"a": 1}, padding={"a": 3})
    ((_, _, n, drafts, _),) = w.scheduled(reply)
    assert (n, drafts) == (4, 3)
    assert w.client.get_request("a").pending_draft_len == 3


# ---------------------------------------------------------------- NWOR through the core


@pytest.mark.parametrize("nwor", [True, False])
def test_a_rejected_draft_reaches_the_pool_only_without_nwor(
        make_config: Callable[..., object], clock: FakeClock, nwor: bool) -> None:
    """The reference NWOR is measured against: a service run with nwor=False writes a rejected
    draft that lies in a block its request keeps; with NWOR it stays poison."""
    core = ServiceCore(ServiceConfig(pool=make_config(num_layers=2), lease_ttl_s=TTL,
                                     max_step_tokens=64, nwor=nwor), clock=clock)
    try:
        w = worker(core)
        w.pool.kv.fill_(POISON)
        first = w.step(new={"a": 6})  # positions 0-5 in blocks 0-1 (4 tokens each)
        stage_pattern(w.pool.staging, first.scheduled.total_tokens, tag=1)
        second = w.step(grants={"a": 1})  # position 6 and the draft at 7, still in block 1
        slots = w.pool.slot_mapping(second).numpy()
        stage_pattern(w.pool.staging, second.scheduled.total_tokens, tag=2)
        third = w.step(results={"a": 0})  # the draft is rejected; block 1 stays a's
        kept = {int(slots[0]): (2, 0)} | ({int(slots[1]): (2, 1)} if not nwor else {})
        expected = committed_slots(first, w.pool.slot_mapping(first).numpy(), 1, {}) | kept
        assert not pool_mismatches(w.pool.kv, expected, POISON)
        assert third.committed == wire.CommitSummary(tokens=2, written=1 if nwor else 2)
    finally:
        core.close()


def test_the_next_step_commits_exactly_the_accepted_tokens(core: ServiceCore) -> None:
    outcome = nwor_scenario(worker(core).client)  # see its docstring: 4 requests, 3 steps
    assert not outcome.mismatches, outcome.mismatches
    # Step 2 staged a 4 + b 3 + d 2 + c 4 tokens; a's 2 and b's 3 were written.
    assert outcome.commit == wire.CommitSummary(tokens=13, written=5)


def test_the_pool_check_sees_a_single_wrong_value(core: ServiceCore) -> None:
    """The NWOR tests above are only as strong as pool_mismatches: it must notice one bad byte."""
    w = worker(core)
    assert w.pool is not None
    w.pool.kv.fill_(POISON)
    assert pool_mismatches(w.pool.kv, {}, POISON) == []
    w.pool.kv[1, 1, 5, 2, 0, 7] = 0.0  # layer 1, V, block 5, offset 2, last element
    (where,) = pool_mismatches(w.pool.kv, {}, POISON)
    assert where.startswith(f"layer 1 V slot {5 * core.config.pool.tokens_per_block + 2}:")


def test_a_failed_call_commits_nothing_and_its_retry_commits_once(core: ServiceCore) -> None:
    w = worker(core)
    assert w.pool is not None
    w.pool.kv.fill_(POISON)
    first = w.step(new={"a": 4})
    slots = w.pool.slot_mapping(first).numpy()
    stage_pattern(w.pool.staging, first.scheduled.total_tokens, tag=1)
    with pytest.raises(RemoteError) as refused:
        w.step(grants={"a": 9})  # above max_draft_len
    assert refused.value.field == "draft_len"
    assert not pool_mismatches(w.pool.kv, {}, POISON)
    w.step(grants={"a": 3})
    assert not pool_mismatches(w.pool.kv, committed_slots(first, slots, 1, {}), POISON)


# ---------------------------------------------------------------- step ids


def test_a_retried_step_returns_the_same_reply_without_granting_twice(core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4})
    call = _call(w, grant_handles=[w.handle("a")], draft_lens=[3])
    reply = w.client.send_step(call)
    capacity = w.client.get_request("a").capacity
    assert w.client.call("step", call) is reply
    assert w.client.get_request("a").capacity == capacity


def test_a_step_id_reused_with_another_body_is_refused(core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4})
    again = _call(w, step_id=w.client.next_step_id - 1, new_req_ids=["b"], prompt_lens=[1])
    with pytest.raises(RemoteError) as err:
        w.client.call("step", again)
    assert (err.value.status, err.value.code, err.value.field) == (409, "step_id_reused",
                                                                   "step_id")


def test_an_older_step_id_is_refused(core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4})
    w.step(grants={"a": 1})
    before = state_of(core)
    with pytest.raises(RemoteError) as err:
        w.client.call("step", _call(w, step_id=0))
    assert (err.value.status, err.value.code) == (409, "step_out_of_order")
    assert state_of(core) == before


def test_step_ids_may_skip_but_never_go_back(core: ServiceCore) -> None:
    w = worker(core)
    w.client.next_step_id = 10
    w.step(new={"a": 4})
    assert core.get_pool(wire.PoolQuery()).workers[0].last_step_id == 10


# ---------------------------------------------------------------- protocol and refusals


def test_every_request_of_the_previous_step_must_be_settled(core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4, "b": 4})
    w.step(grants={"a": 2, "b": 2})
    before = state_of(core)
    with pytest.raises(RemoteError) as err:
        w.step(results={"a": 1}, grants={"a": 2})
    assert (err.value.status, err.value.code, err.value.field) == (422, "unsettled_requests",
                                                                   "results")
    assert f"handle {w.handle('b')}" in err.value.message
    assert state_of(core) == before


def test_out_of_blocks_refuses_per_request_and_leaves_them_untouched(
        make_core: Callable[..., ServiceCore]) -> None:
    core = make_core(num_blocks=24, max_seq_len=32)
    w = worker(core)
    w.step(new={"a": 30, "b": 30})  # 8 + 8 blocks of 4 tokens
    w.step(new={"c": 28})  # 7 blocks; 1 left
    untouched = {r: w.client.get_request(r) for r in ("b", "c")}
    reply = w.step(grants={"a": 1, "b": 3, "c": 3}, new={"d": 8})
    # a fits (1 block); b, c and the new d do not: refused, scheduler may preempt.
    assert [name for name, *_ in w.scheduled(reply)] == ["a"]
    assert w.refused(reply, {"grant": ["a", "b", "c"], "new": ["d"]}) == [
        ("b", "grant", "out_of_blocks"), ("c", "grant", "out_of_blocks"),
        ("d", "new", "out_of_blocks")]
    assert reply.admitted.tolist() == [-1]
    assert {r: w.client.get_request(r) for r in ("b", "c")} == untouched
    assert reply.free_blocks == 0
    core.check_invariants()


def test_batch_full_is_its_own_refusal(make_core: Callable[..., ServiceCore]) -> None:
    core = make_core(max_batch_size=2)
    w = worker(core)
    w.step(new={"a": 1, "b": 1})
    reply = w.step(new={"c": 1})
    assert w.refused(reply, {"new": ["c"]}) == [("c", "new", "batch_full")]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"finished": [f"r{i}" for i in range(9)]}, "finished"),
    ({"grants": {f"r{i}": 1 for i in range(9)}}, "grants"),
    ({"new": {f"r{i}": 1 for i in range(9)}}, "new"),
    ({"new": {"a": 40, "b": 30}}, "new"),  # 70 tokens > max_step_tokens = 64
])
def test_limits_refuse_with_the_list_at_fault(core: ServiceCore, kwargs: dict[str, object],
                                              field: str) -> None:
    w = worker(core)
    before = state_of(core)
    with pytest.raises(RemoteError) as err:
        w.step(**kwargs)  # type: ignore[arg-type]
    assert (err.value.status, err.value.code, err.value.field) == (422, "limit_exceeded", field)
    assert state_of(core) == before


def test_workers_cannot_touch_each_others_requests(core: ServiceCore) -> None:
    a, b = worker(core, "wa"), worker(core, "wb")
    a.step(new={"r1": 4})
    b.step(new={"r1": 8})  # the same id, another worker: another request
    assert a.client.get_request("r1").history == 4 and b.client.get_request("r1").history == 8
    before = state_of(core)
    # a's handle in b's call names none of b's requests, whatever the row holds.
    with pytest.raises(RemoteError) as err:
        b.client.step(finished=[a.handle("r1")])
    assert (err.value.status, err.value.code, err.value.field) == (422, "unknown_handle",
                                                                   "finished.handles[0]")
    assert state_of(core) == before
    a.step(finished=["r1"])
    assert b.client.get_request("r1").history == 8


def test_the_handle_of_a_freed_request_never_names_its_rows_next_request(
        core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4})
    old = w.handle("a")
    w.step(finished=["a"])
    w.step(new={"b": 4})
    assert core.registry.get("w").req_ids["b"] == old & ((1 << 20) - 1)  # the same row
    before = state_of(core)
    with pytest.raises(RemoteError) as err:
        w.client.step(grants=([old], [1]))
    assert (err.value.code, err.value.field) == ("unknown_handle", "grants.handles[0]")
    assert state_of(core) == before


@pytest.mark.parametrize("forged", ["row_past_the_table", "never_admitted", "next_generation",
                                    "huge_generation"])
def test_a_handle_never_handed_out_is_refused_naming_its_list_and_index(
        core: ServiceCore, forged: str) -> None:
    w = worker(core)
    w.step(new={"a": 4, "b": 4})
    w.step(grants={"a": 1})
    a = w.handle("a")
    handle = {"row_past_the_table": (1 << 20) - 1, "never_admitted": 1 << 20 | 7,
              "next_generation": a + (1 << 20), "huge_generation": 1 << 62 | (a & 0xFFFFF)}[forged]
    before = state_of(core)
    with pytest.raises(RemoteError) as err:
        # Valid handles in the lists before it: the index counts within its own list.
        w.client.step(results=([a], [0]), finished=[w.handle("b"), handle])
    assert (err.value.code, err.value.field) == ("unknown_handle", "finished.handles[1]")
    assert state_of(core) == before


def test_new_ids_must_be_unique_within_the_call_and_the_workers_requests(
        core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4})
    before = state_of(core)
    for ids in (["a"], ["b", "b"]):
        with pytest.raises(RemoteError) as err:
            w.client.step(new=(ids, [1] * len(ids)))
        assert (err.value.code, err.value.field) == ("duplicate_request",
                                                     f"new.req_ids[{len(ids) - 1}]")
    assert state_of(core) == before


# ---------------------------------------------------------------- registration, leases, epochs


def test_a_silent_worker_loses_its_requests_and_blocks(core: ServiceCore,
                                                       clock: FakeClock) -> None:
    recorder = Recorder()
    core.add_observer(recorder)
    quiet, busy = worker(core, "quiet"), worker(core, "busy")
    quiet.step(new={"a": 20})
    free = core.manager.free_blocks
    clock.now += TTL / 2
    busy.step(new={"b": 4})  # a call renews only the caller's lease
    clock.now += TTL / 2 + 0.1
    assert core.expire_leases() == 1
    assert core.manager.free_blocks == free + 5 - 1
    assert recorder.leases == 1 and core.get_pool(wire.PoolQuery()).leases_expired == 1
    with pytest.raises(NotRegistered):
        quiet.step(results={})
    quiet.client.register()  # and it may come back
    assert quiet.step(new={"a": 1}).admitted[0] >= 0
    core.check_invariants()
    # Each lease runs out TTL after its own worker's last call, whoever expired before.
    clock.now = 1000.0 + TTL / 2 + TTL  # busy's last call was at 1000 + TTL / 2
    assert core.expire_leases() == 0
    clock.now += 0.1
    assert core.expire_leases() == 1 and core.registry.get("busy") is None
    clock.now = 1000.0 + 2 * TTL + 0.05  # quiet came back at 1000 + TTL + 0.1
    assert core.expire_leases() == 0
    clock.now += 0.1
    assert core.expire_leases() == 1 and len(core.registry) == 0


def test_a_call_after_the_ttl_finds_the_lease_gone_even_before_the_reaper(
        core: ServiceCore, clock: FakeClock) -> None:
    w = worker(core)
    w.step(new={"a": 4})
    clock.now += TTL + 1
    with pytest.raises(NotRegistered):
        w.step()
    assert core.manager.num_requests == 0


def test_a_step_the_service_is_slow_to_answer_starts_the_silence_at_its_reply(
        core: ServiceCore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first step that compiles the step's loops may take longer than the TTL: the worker
    waited on the service, it was not silent, so its lease runs TTL from the reply."""
    w = worker(core)
    execute = core.pipeline.execute

    def slow(*args: object) -> object:
        clock.now += 2 * TTL
        return execute(*args)

    monkeypatch.setattr(core.pipeline, "execute", slow)
    w.step(new={"a": 4})
    monkeypatch.setattr(core.pipeline, "execute", execute)
    clock.now += TTL - 0.1
    assert core.expire_leases() == 0
    w.step()
    clock.now += TTL + 0.1
    assert core.expire_leases() == 1


def test_a_watched_gap_extends_every_lease_and_silence_still_ends_one(
        core: ServiceCore, clock: FakeClock) -> None:
    """Under watch_pauses (what the reaper sets), a gap longer than the watch between two looks
    is time the service did not run: no lease runs out for it, the workers' blocks stay. Looks
    as often as the watch asks still see a silent worker's lease end, TTL after its last call."""
    core.watch_pauses(TTL / 4)
    w = worker(core)
    w.step(new={"a": 20})
    used = core.manager.used_blocks
    clock.now += 10 * TTL  # one gap: the service was stopped
    assert core.expire_leases() == 0 and core.manager.used_blocks == used
    w.step()  # the worker carries on in its session
    resumed = clock.now
    while clock.now <= resumed + TTL:
        assert core.expire_leases() == 0
        clock.now += TTL / 8
    assert core.expire_leases() == 1 and core.manager.used_blocks == 0


def test_a_stale_epoch_is_reported_as_a_restart(make_core: Callable[..., ServiceCore]) -> None:
    old, new = make_core(), make_core()
    w = worker(old).client
    w._transport = Client.in_process(new)._transport  # the service restarted underneath
    with pytest.raises(ServiceRestarted) as err:
        w.step(new=(["a"], [1]))
    assert (err.value.status, err.value.field) == (409, "epoch")
    assert w.register().epoch == new.epoch != old.epoch
    w.step(new=(["a"], [1]))


def test_a_live_session_keeps_its_id_unless_replaced_explicitly(core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 4, "b": 4})
    before = state_of(core)
    with pytest.raises(RemoteError) as err:
        w.client.register()  # a second process with the same id: refused, nothing dropped
    assert (err.value.status, err.value.code) == (409, "worker_id_in_use")
    assert state_of(core) == before
    reg = w.client.register(replace=True)
    assert reg.next_step_id == 0 and core.manager.num_requests == 0
    NamedWorker(w.client).step(new={"a": 4})


def test_a_zombie_of_a_replaced_worker_can_never_act_in_the_new_session(
        core: ServiceCore) -> None:
    zombie = worker(core)
    zombie.step(new={"a": 4})
    replacement = Client.in_process(core, worker_id="w")
    replacement.register(replace=True)
    fresh = NamedWorker(replacement)
    fresh.step(new={"b": 4})
    before = state_of(core)
    for call in (lambda: zombie.step(grants={"a": 1}), zombie.client.deregister,
                 lambda: zombie.step(new={"c": 1})):
        with pytest.raises(SessionEnded) as err:
            call()
        assert (err.value.status, err.value.field) == (409, "session")
    assert state_of(core) == before
    fresh.step(grants={"b": 1})


def test_too_many_workers_is_refused(make_config: Callable[..., object]) -> None:
    core = ServiceCore(ServiceConfig(pool=make_config(), max_workers=1))
    try:
        worker(core, "one")
        with pytest.raises(RemoteError) as err:
            worker(core, "two")
        assert (err.value.status, err.value.code) == (409, "too_many_workers")
    finally:
        core.close()


# ---------------------------------------------------------------- sharing and concurrency


def test_shared_memory_is_private_to_the_user_and_removed_on_close(
        make_core: Callable[..., ServiceCore]) -> None:
    core = make_core()
    worker(core)
    segments = sorted(SHM_DIR.glob(f"kvalloc-{core.epoch:016x}-*"))
    assert [p.name.split("-", 2)[2] for p in segments] == ["block_table", "fence_words", "kv",
                                                           "staging-w"]
    for path in segments:
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    core.close()
    assert not any(p.exists() for p in segments)


def test_concurrent_callers_never_interleave_half_a_step(
        make_core: Callable[..., ServiceCore]) -> None:
    core = make_core(num_blocks=128)
    tpb = core.config.pool.tokens_per_block
    errors: list[BaseException] = []

    def run(worker_id: str) -> None:
        try:
            w = worker(core, worker_id)
            assert w.pool is not None
            rng = np.random.default_rng(len(worker_id))
            reply = w.step(new={"a": 3, "b": 5})
            ran: list[str] = []  # the previous step's decodes
            for _ in range(15):
                # my rows, read while other threads change theirs
                slots = w.pool.slot_mapping(reply).numpy()
                request, _ = reply.scheduled.positions()
                for token, row in enumerate(reply.scheduled.rows[request].tolist()):
                    assert slots[token] // tpb in set(w.pool.block_table[row].tolist())
                reply = w.step(results={r: int(rng.integers(0, 2)) for r in ran},
                               grants={"a": 1, "b": 1})
                ran = [name for name, *_ in w.scheduled(reply)]
            w.client.deregister()
        except BaseException as exc:  # reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    core.check_invariants()
    assert core.manager.free_blocks == core.config.pool.total_blocks


def test_pool_and_request_inspection_report_the_managers_state(core: ServiceCore) -> None:
    w = worker(core)
    w.step(new={"a": 5})
    w.step(grants={"a": 3})
    state = w.client.get_request("a")
    mgr = core.manager
    view = mgr.view(state.row)
    assert state.handle == w.handle("a")
    assert (state.capacity, state.history, state.pending_overlap_slack, state.pending_draft_len,
            state.block_ids) == (view.capacity, view.history, view.pending_overlap_slack, 3,
                                 view.block_ids.tolist())
    # 5 prompt tokens + 1 + 3 drafts + 3 slack, in 4-token blocks.
    assert (state.capacity, state.history, len(state.block_ids)) == (12, 5, 3)
    pool = w.client.get_pool(verify=True)
    assert pool.invariants == "ok"
    assert pool.used_blocks == mgr.pool.num_blocks - mgr.free_blocks == len(state.block_ids)
    assert pool.workers[0].num_requests == 1 and pool.counters["grants"] == 1
    with pytest.raises(RemoteError) as err:
        w.client.get_request("nope")
    assert (err.value.status, err.value.field) == (404, "req_id")


def _call(w: NamedWorker, *, step_id: int | None = None, new_req_ids: list[str] | None = None,
          **columns: list[int]) -> StepCall:
    """A raw `StepCall` of ``w``'s session (for tests that resend or forge step ids)."""
    reg = w.client.registration
    assert reg is not None
    return StepCall.build("w", reg.session, reg.epoch,
                          w.client.next_step_id if step_id is None else step_id,
                          new_req_ids=new_req_ids or [], **columns)


def test_a_deregistration_sent_again_is_answered_again_for_the_latest_ids(
        core: ServiceCore) -> None:
    """A deregister resent with its session gets the first reply, and nothing changes; the
    service keeps the latest `registry.ENDED_KEPT` ids' replies, so the oldest id's retry is
    then `unknown_worker` as before."""
    ref = wire.WorkerRef(worker_id="w0", session=core.register(
        wire.RegisterRequest(worker_id="w0", attached=False)).session)
    reply = core.deregister(ref)
    pool = core.get_pool(wire.PoolQuery())
    assert core.deregister(ref) == reply and core.get_pool(wire.PoolQuery()) == pool
    for i in range(1, registry.ENDED_KEPT + 1):
        other = core.register(wire.RegisterRequest(worker_id=f"w{i}", attached=False))
        core.deregister(wire.WorkerRef(worker_id=f"w{i}", session=other.session))
    with pytest.raises(RemoteError, match="unknown_worker"):
        Client.in_process(core).call("deregister", ref)
    latest = f"w{registry.ENDED_KEPT}"
    assert core.deregister(wire.WorkerRef(worker_id=latest, session=other.session)).worker_id \
        == latest


def test_a_registration_sent_again_with_its_nonce_is_answered_again_and_changes_nothing(
        core: ServiceCore) -> None:
    """A client that timed out on ``register`` resends the same request, nonce and all: it gets
    the session the first attempt opened, not `worker_id_in_use` and an orphaned session. Any
    other request for the id (another nonce, none, another body) is refused as before, and so is
    the same one once the session has stepped."""
    first = wire.RegisterRequest(worker_id="w", attached=False, nonce=7)
    registration = core.register(first)
    pool = core.get_pool(wire.PoolQuery())
    assert core.register(first) == registration
    assert core.get_pool(wire.PoolQuery()) == pool
    for other in (wire.RegisterRequest(worker_id="w", attached=False, nonce=8),
                  wire.RegisterRequest(worker_id="w", attached=False),
                  wire.RegisterRequest(worker_id="w", attached=True, nonce=7)):
        with pytest.raises(RemoteError, match="worker_id_in_use"):
            Client.in_process(core).call("register", other)
    core.step(StepCall.build("w", registration.session, registration.epoch, 0))
    with pytest.raises(RemoteError, match="worker_id_in_use"):
        Client.in_process(core).call("register", first)
    assert [w.worker_id for w in core.get_pool(wire.PoolQuery()).workers] == ["w"]
