"""What workers map read-only is a copy of the service's own state, and a verify puts it back.

Any process of the service's user can open the block table's, the protection mask's and the
fence words' segments read-write. A verify (and the service's own periodic check, the same
`ServiceCore.repair_shared_state`) compares every shard's copy with the host state (the manager's
table, the prefix cache's protection flags, the sessions open), rewrites what differs, counts it
in ``kvalloc_shared_state_repairs_total{what}`` and answers ``invariants: "repaired"``; the calls
after it succeed. Here the tampering is a write through the service's own tensors (the same
memory); `tests/e2e/test_shared_state_e2e.py` does it from another process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator import CLOSED, AllocatorMetrics, PoolConfig
from kvalloc.server.client import Client
from kvalloc.server.contract import wire
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.metrics import ServiceMetrics
from kvalloc.server.service.settings import ServiceConfig
from prometheus_client import CollectorRegistry

SYSTEM = np.arange(700, 716)  # four full blocks of 4 tokens
SHARDS = [pytest.param(["cpu"], id="one_pool"), pytest.param(["cpu", "cpu"], id="two_shards")]
FREE_ROW = 7  # the worker's one request takes row 0


class Service:
    """A core with prefix caching, its metrics, and a worker whose prompt's five full blocks
    are written and therefore protected."""

    def __init__(self, devices: list[str]) -> None:
        pool = PoolConfig(num_layers=2, num_kv_heads=2, head_dim=8, device="cpu", num_blocks=64,
                          tokens_per_block=4, max_seq_len=64, max_draft_len=2, max_batch_size=8)
        self.core = ServiceCore(ServiceConfig(pool=pool, max_step_tokens=64, prefix_caching=True,
                                              max_workers=4, devices=devices,
                                              tensor_parallel=len(devices)))
        self.registry = CollectorRegistry()
        metrics = ServiceMetrics(self.registry, AllocatorMetrics(
            self.registry, self.core.manager, self.core.pool.committer.writes))
        self.core.add_observer(metrics)
        self.kv = Client.in_process(self.core, worker_id="w")
        self.kv.register()
        first = self.kv.step(new=(["a"], [20]),
                             prompt_token_ids=np.concatenate([SYSTEM, [1] * 4]))
        self.handle = int(first.admitted[0])
        self.kv.step(grants=([self.handle], [2]))  # commits the prompt: its blocks are cached
        assert int(self.core.manager.cache.protected.sum()) == 5

    def repairs(self, what: str) -> float:
        return self.registry.get_sample_value("kvalloc_shared_state_repairs_total",
                                              {"what": what}) or 0.0

    def verify(self) -> str:
        return self.kv.get_pool(verify=True).invariants

    def close(self) -> None:
        self.core.close()


@pytest.fixture(params=SHARDS)
def service(request: pytest.FixtureRequest):
    svc = Service(request.param)
    yield svc
    svc.close()


def test_a_block_id_written_on_a_free_row_is_put_back_and_counted(service: Service) -> None:
    table = service.core.manager.table
    for copy in table.device_tables:  # every shard's copy
        copy[FREE_ROW, 0] = 3
    assert service.verify() == "repaired"
    assert service.repairs("block_table") == len(table.device_tables)
    assert all(np.array_equal(copy.numpy(), table.host) for copy in table.device_tables)
    service.kv.step(results=([service.handle], [1]), grants=([service.handle], [2]))
    assert service.verify() == "ok"  # nothing left to put back, nothing counted again
    assert service.repairs("block_table") == len(table.device_tables)


def test_a_zeroed_protection_mask_is_noticed_put_back_and_counted(service: Service) -> None:
    shards = service.core.pool.shards
    for shard in shards:
        shard.committer.protected.zero_()
    assert service.verify() == "repaired"
    assert service.repairs("protected") == 5 * len(shards)
    expected = torch.from_numpy(service.core.manager.cache.protected)
    assert all(torch.equal(shard.committer.protected, expected) for shard in shards)
    service.kv.step(results=([service.handle], [1]), grants=([service.handle], [2]))
    assert service.verify() == "ok"


def test_fence_words_hold_the_open_sessions_again(service: Service) -> None:
    """The worker's word closed (its commits would write nothing) and a free slot's word opened
    (a stale writer of that number would write): both put back."""
    words = service.core.pool.words
    slot = service.core.registry.get("w").fence_slot
    for table in words:
        table.words[slot] = CLOSED
        table.words[slot + 1] = 12345
    assert service.verify() == "repaired"
    assert service.repairs("fence_words") == 2 * len(words)
    session = service.core.registry.get("w").session
    assert all(table.words.tolist() == [CLOSED] * slot + [session] + [CLOSED] * (3 - slot)
               for table in words)
    service.kv.step(results=([service.handle], [1]), grants=([service.handle], [2]))
    assert service.verify() == "ok"


def test_the_periodic_check_repairs_without_a_query_and_is_quiet_when_nothing_changed(
        service: Service) -> None:
    core = service.core
    assert core.repair_shared_state() == {"block_table": 0, "protected": 0, "fence_words": 0}
    core.manager.table.device_tables[-1][FREE_ROW, 1] = 5
    core.pool.shards[-1].committer.protected.zero_()
    assert core.repair_shared_state() == {"block_table": 1, "protected": 5, "fence_words": 0}
    assert service.repairs("block_table") == 1 and service.repairs("protected") == 5
    assert service.verify() == "ok"
    core.check_invariants()


def test_a_closed_service_repairs_nothing(service: Service) -> None:
    service.core.close()
    assert service.core.repair_shared_state() == {}


def test_a_ranked_service_repairs_every_rank_and_says_so() -> None:
    from kvalloc.server.service.ranks import RankedService
    pool = PoolConfig(num_layers=2, num_kv_heads=2, head_dim=8, device="cpu", num_blocks=64,
                      tokens_per_block=4, max_seq_len=64, max_draft_len=2, max_batch_size=8)
    ranked = RankedService(ServiceConfig(pool=pool, max_step_tokens=64, devices=["cpu", "cpu"]))
    try:
        for rank in ranked.ranks:
            rank.manager.table.device_table[FREE_ROW, 0] = 1
        assert ranked.get_pool(wire.PoolQuery(verify=True)).invariants == "repaired"
        assert ranked.repair_shared_state() == {"block_table": 0, "protected": 0,
                                                "fence_words": 0}
        assert ranked.get_pool(wire.PoolQuery(verify=True)).invariants == "ok"
    finally:
        ranked.close()
