"""Data-parallel ranks in one service: ``--devices`` of R tensor-parallel groups make R ranks,
each an allocator of its own (rows, pool shards, prefix cache, KV events tagged with its rank),
behind one set of methods: a worker registers with its rank and every later call goes there; a
worker id lives on one rank; the pool view sums the ranks and the metrics label them."""

from __future__ import annotations

import numpy as np
import pytest
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import RemoteError, ShardingInvalid
from kvalloc.server.service.metrics import rank_metrics
from kvalloc.server.service.ranks import RankedService, offset_endpoint, rank_configs
from kvalloc.server.service.settings import ServiceConfig
from prometheus_client import CollectorRegistry, generate_latest
from service_harness import nwor_scenario

HEADS = 4


@pytest.fixture
def make_service(make_config):
    made: list[RankedService] = []

    def factory(ranks: int = 2, tp: int = 2, **service: object) -> RankedService:
        config = ServiceConfig(pool=make_config(num_kv_heads=HEADS, num_layers=2),
                               max_step_tokens=64, devices=["cpu"] * (ranks * tp),
                               tensor_parallel=tp, **service)
        made.append(RankedService(config))
        return made[-1]

    yield factory
    for service in made:
        service.close()


def worker(service: RankedService, worker_id: str, rank: int) -> Client:
    client = Client.in_process(service, worker_id=worker_id)
    client.register(data_parallel_rank=rank)
    return client


def test_each_rank_commits_its_own_workers_tokens_into_its_own_shards(make_service):
    service = make_service()
    first, second = worker(service, "a", 0), worker(service, "b", 1)
    assert first.pool is not None and second.pool is not None
    assert first.pool.shards[0].kv.data_ptr() != second.pool.shards[0].kv.data_ptr()
    assert nwor_scenario(first).mismatches == []
    free = [rank.manager.free_blocks for rank in service.ranks]
    assert nwor_scenario(second).mismatches == []
    assert service.ranks[0].manager.free_blocks == free[0]  # rank 1's steps took none of it
    pool = first.get_pool(verify=True)
    assert sorted(w.worker_id for w in pool.workers) == ["a", "b"]
    assert pool.free_blocks == sum(rank.manager.free_blocks for rank in service.ranks)
    service.check_invariants()


def test_the_prefix_cache_is_per_rank(make_service):
    service = make_service(prefix_caching=True)
    prompt = np.arange(12)
    one, other = worker(service, "a", 0), worker(service, "b", 1)
    one.step(new=(["p"], [12]), prompt_token_ids=prompt)
    one.step()  # its commit makes the prompt's blocks shareable
    again = one.step(new=(["q"], [12]), prompt_token_ids=prompt)
    elsewhere = other.step(new=(["q"], [12]), prompt_token_ids=prompt)
    assert int(again.cached_tokens[0]) > 0 and int(elsewhere.cached_tokens[0]) == 0


@pytest.mark.parametrize("rank, code", [(None, "unknown_rank"), (2, "unknown_rank")])
def test_a_registration_must_name_a_rank_of_the_service(make_service, rank, code):
    service = make_service()
    with pytest.raises(RemoteError) as refused:
        Client.in_process(service, worker_id="w").register(data_parallel_rank=rank)
    assert (refused.value.code, refused.value.field) == (code, "data_parallel_rank")
    assert Client.in_process(service).get_pool().workers == []


def test_a_worker_id_lives_on_one_rank_until_replaced(make_service):
    service = make_service()
    kept = worker(service, "w", 0)
    kept.step(new=(["r"], [9]))
    with pytest.raises(RemoteError) as refused:
        worker(service, "w", 1)
    assert refused.value.code == "worker_id_in_use"
    moved = Client.in_process(service, worker_id="w")
    moved.register(data_parallel_rank=1, replace=True)
    assert service.ranks[0].manager.num_requests == 0  # its old session ended with its requests
    assert [w.worker_id for w in moved.get_pool().workers] == ["w"]
    moved.step(new=(["r"], [9]))
    assert service.ranks[1].manager.num_requests == 1


def test_metrics_label_every_rank(make_service):
    service = make_service()
    worker(service, "a", 1).step(new=(["r"], [9]))
    registry = CollectorRegistry()
    rank_metrics(service, registry)
    text = generate_latest(registry).decode()
    lines = [line for line in text.splitlines() if line.startswith("kvalloc_live_requests")]
    assert lines == ['kvalloc_live_requests{data_parallel_rank="0"} 0.0',
                     'kvalloc_live_requests{data_parallel_rank="1"} 1.0'], lines
    assert 'kvalloc_invariant_violations_total{data_parallel_rank="1"} 0.0' in text
    assert text.count("# TYPE kvalloc_live_requests ") == 1  # one family, both ranks


def test_ranks_that_do_not_fit_are_refused_before_anything_is_made(make_config, monkeypatch):
    made: list[object] = []
    monkeypatch.setattr("kvalloc.server.service.ranks.ServiceCore", lambda *a, **k: made.append(a))
    base = {"pool": make_config(num_kv_heads=HEADS), "tensor_parallel": 2}
    with pytest.raises(ShardingInvalid, match="not a multiple of the tensor-parallel degree"):
        RankedService(ServiceConfig(devices=["cpu"] * 3, **base))
    with pytest.raises(ShardingInvalid, match="data_parallel_rank: names the one rank"):
        RankedService(ServiceConfig(devices=["cpu"] * 4, data_parallel_rank=1, **base))
    with pytest.raises(ShardingInvalid, match="num_kv_heads: 3 KV heads do not split evenly"):
        RankedService(ServiceConfig(devices=["cpu"] * 4, tensor_parallel=2,
                                    pool=make_config(num_kv_heads=3)))
    assert made == []  # no rank was made: every rank is checked first


def test_each_rank_publishes_its_events_on_its_own_endpoints(make_config):
    config = ServiceConfig(pool=make_config(num_kv_heads=HEADS), devices=["cpu"] * 4,
                           tensor_parallel=2, prefix_caching=True,
                           kv_events="tcp://127.0.0.1:5560", kv_events_replay="ipc:///tmp/r")
    ranks = rank_configs(config)
    assert [(c.kv_events, c.kv_events_replay, c.data_parallel_rank, c.devices) for c in ranks] == [
        ("tcp://127.0.0.1:5560", "ipc:///tmp/r", 0, ["cpu", "cpu"]),
        ("tcp://127.0.0.1:5561", "ipc:///tmp/r-dp1", 1, ["cpu", "cpu"])]
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"


@pytest.mark.parametrize("events, replay, ranks", [
    ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 2),  # rank 1's events: rank 0's replay
    ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559", 3),
    ("ipc:///tmp/kv", "ipc:///tmp/kv", 1)])
def test_event_endpoints_that_ranks_would_share_are_refused_before_anything_is_made(
        make_config, events, replay, ranks):
    config = ServiceConfig(pool=make_config(num_kv_heads=HEADS), devices=["cpu"] * ranks,
                           prefix_caching=True, kv_events=events, kv_events_replay=replay)
    with pytest.raises(ShardingInvalid, match=r"rank \d's kv_events(_replay)? and rank \d's "
                                              r"kv_events(_replay)? are both .*at least "
                                              f"{ranks} apart"):
        rank_configs(config)
    apart = config.model_copy(update={"kv_events_replay": "tcp://127.0.0.1:6557"})
    if ranks > 1:
        assert len(rank_configs(apart)) == ranks
