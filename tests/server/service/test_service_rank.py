"""A data-parallel deployment runs one service per rank, each the allocator of that rank's
engine: its KV events carry its ``data_parallel_rank`` (vLLM's ``KVEventBatch`` field, which
routers read to tell the ranks' caches apart), its layout states it, and a worker that registers
for another rank is refused, typed and naming the field, with nothing changed."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq
from kvalloc.allocator import PoolConfig
from kvalloc.server.client import Client
from kvalloc.server.contract.errors import RemoteError
from kvalloc.server.service.core import ServiceCore
from kvalloc.server.service.settings import ServiceConfig

REPLAY_WAIT_MS = 5000  # a replay answers in milliseconds; a loaded machine takes longer


def make_core(**service: object) -> ServiceCore:
    pool = PoolConfig(num_layers=1, num_kv_heads=2, head_dim=8, device="cpu", num_blocks=32,
                      tokens_per_block=4, max_seq_len=32, max_draft_len=2, max_batch_size=4)
    return ServiceCore(ServiceConfig(pool=pool, max_step_tokens=32, prefix_caching=True,
                                     **service))


def replayed_batches(core: ServiceCore, context: zmq.Context) -> list[list[object]]:
    """Every KV event batch the core published, as a router joining late reads them back."""
    assert core.kv_events is not None
    replay = context.socket(zmq.DEALER)
    try:
        replay.connect(core.kv_events.endpoints()[""].replay)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert replay.poll(REPLAY_WAIT_MS)
            _, seq, payload = replay.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return batches
            batches.append(msgspec.msgpack.decode(payload))
    finally:
        replay.close(linger=0)


@pytest.mark.parametrize("rank", [None, 3])
def test_kv_events_carry_the_services_rank(rank, zmq_context):
    core = make_core(kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*",
                     kv_events_plaintext=True, data_parallel_rank=rank)
    try:
        kv = Client.in_process(core, worker_id="w")
        reg = kv.register(data_parallel_rank=rank)
        assert reg.layout.data_parallel_rank == rank
        kv.step(new=(["a"], [12]), prompt_token_ids=np.arange(12))
        kv.step()  # the commit writes the prompt: its blocks are stored
        batches = replayed_batches(core, zmq_context)
    finally:
        core.close()
    assert len(batches) >= 2 and any(e["type"] == "BlockStored" for b in batches
                                   for e in b[1])
    # omit_defaults: a batch without a rank has two fields, as vLLM's without one
    assert all((b[2] if len(b) > 2 else None) == rank for b in batches)


@pytest.mark.parametrize("service_rank, worker_rank", [(1, 0), (None, 2), (0, 1)])
def test_a_worker_of_another_rank_is_refused_and_changes_nothing(service_rank, worker_rank):
    core = make_core(data_parallel_rank=service_rank)
    try:
        kv = Client.in_process(core, worker_id="w")
        with pytest.raises(RemoteError) as refused:
            kv.register(data_parallel_rank=worker_rank)
        assert (refused.value.status, refused.value.code, refused.value.field) == (
            409, "wrong_rank", "data_parallel_rank")
        assert f"the worker is of rank {worker_rank}" in str(refused.value)
        assert kv.get_pool(verify=True).workers == []
        kv.register(data_parallel_rank=service_rank or 0)  # its own rank is served
    finally:
        core.close()
