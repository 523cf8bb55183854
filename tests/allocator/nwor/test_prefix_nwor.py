"""NWOR over a pool with shared prefixes: rejected drafts, forced fallbacks and even a slot
mapping that points into a shared block (a bug upstream) leave every cached block bit-identical.

The manager shares a system prompt's blocks between requests; its prefix cache's write
protection goes to `DeferredWriteManager.protect`. Each window then stages tokens whose slots
mix a request's own tail blocks with the shared blocks: only the private slots change, the
shared blocks keep their bits through the masked commit, the fast path and the write-everything
fallback, and every refused token is counted. Runs on "cpu" and, marked ``gpu``, on "cuda".
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvalloc.allocator import KVCacheManager, StepPlan
from kvalloc.allocator.capacity.slots import slots_reference
from kvalloc.allocator.nwor.deferred_writes import DeferredWriteManager
from kvalloc.allocator.nwor.window import WindowLayout
from nwor_scenarios import bits, poisoned_storage, pool_config

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
TPB = 4
SYSTEM = np.arange(500, 516)  # four full blocks


def shared_setup(device: str):
    cfg = pool_config(device, num_blocks=32)
    storage = poisoned_storage(cfg)
    manager = KVCacheManager(cfg, prefix_caching=True, register_when_written=True)
    writes = DeferredWriteManager(storage, max_tokens=32, backend="torch")
    a = manager.add_request("a", 18, prompt_tokens=np.concatenate([SYSTEM, [1, 2]]))
    # "a"'s prefill is written (here by hand, in a service by the commit): its blocks are
    # shareable and write-protected from now on.
    rows = storage.rows()
    for block in manager.view(a).block_ids[:4].tolist():
        rows[:, :, block * TPB : (block + 1) * TPB].normal_()
    manager.mark_written(np.array([a]), np.array([18]))
    b = manager.add_request("b", 18, prompt_tokens=np.concatenate([SYSTEM, [3, 4]]))
    shared = manager.view(a).block_ids[:4]
    assert manager.view(b).block_ids[:4].tolist() == shared.tolist()
    protected = torch.from_numpy(manager.cache.protected).to(storage.kv.device)
    writes.protect(protected)
    assert protected[torch.from_numpy(shared).long()].all()
    return storage, manager, writes, shared, (a, b)


def slots_for(manager: KVCacheManager, row: int, positions: list[int]) -> torch.Tensor:
    return torch.from_numpy(slots_reference(manager.table.host, np.full(len(positions), row),
                                            np.array(positions), TPB))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ending", ["rejected", "accepted", "fallback", "cancel",
                                    "rejected, host slots", "accepted, host slots",
                                    "cancel, host slots"])
def test_shared_blocks_stay_bit_identical_whatever_the_window_does(device, ending):
    storage, manager, writes, shared, (a, b) = shared_setup(device)
    before = [bits(storage.rows()[:, :, blk * TPB : (blk + 1) * TPB]).clone()
              for blk in shared.tolist()]
    # "b" decodes 1 + 3 drafts at 18..21 (its own tail), but a buggy slot mapping also sends
    # two of "a"'s tokens into the shared prefix (positions 5 and 12).
    slots = torch.cat([slots_for(manager, b, [18, 19, 20, 21]),
                       slots_for(manager, a, [5, 12])]).to(storage.kv.device)
    writes.begin_window(WindowLayout((4, 2), (3, 1)))
    staged = torch.randn(storage.config.num_layers, 2, 6, 2 * 16,
                         device=storage.kv.device).to(storage.kv.dtype)
    if ending == "fallback":  # one layer staged only partly: the window writes everything
        writes.stage_layer(0, staged[0, 0], staged[0, 1], slots)
        writes.stage_layer(1, staged[1, 0, :3], staged[1, 1, :3], slots[:3])
    else:
        writes.stage_from(staged, slots.cpu().numpy() if "host slots" in ending else slots)
    if ending.startswith("cancel"):
        writes.cancel("engine gave up")
    else:
        writes.commit({"rejected": [0, 0], "accepted": [3, 1],
                       "fallback": [1, 0]}[ending.split(",")[0]])
    for blk, old in zip(shared.tolist(), before, strict=True):
        assert torch.equal(bits(storage.rows()[:, :, blk * TPB : (blk + 1) * TPB]), old)
    assert writes.metrics().protected_refusals == 2
    # "b"'s own last verified token always lands in its private tail.
    own = int(manager.table.host[b, 18 // TPB]) * TPB + 18 % TPB
    assert torch.equal(bits(storage.rows()[0, 0, own]), bits(staged[0, 0, 0]))
    manager.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_is_shared_and_protected_only_once_it_is_written(device):
    """Registered when written: the producer's own prefill write passes the guard, then its
    blocks are shared and the same write is refused. The device mask follows
    ``drain_protection``'s flips."""
    cfg = pool_config(device, num_blocks=32)
    storage = poisoned_storage(cfg)
    manager = KVCacheManager(cfg, prefix_caching=True, register_when_written=True)
    writes = DeferredWriteManager(storage, max_tokens=32, backend="torch")
    mask = torch.zeros(cfg.total_blocks, dtype=torch.bool, device=storage.kv.device)
    writes.protect(mask)

    def commit_prefill(row: int) -> torch.Tensor:
        blocks, flags = manager.cache.drain_protection()
        mask[torch.from_numpy(blocks).to(mask.device)] = torch.from_numpy(flags).to(mask.device)
        staged = torch.randn(cfg.num_layers, 2, 16, 2 * 16,
                             device=storage.kv.device).to(storage.kv.dtype)
        writes.begin_window(WindowLayout((16,), (0,)))
        writes.stage_from(staged, slots_for(manager, row, list(range(16))).to(mask.device))
        writes.commit([0])
        return staged

    a = manager.add_request("a", 16, prompt_tokens=SYSTEM)
    first = int(manager.view(a).block_ids[0]) * TPB
    # Scheduled, not yet written: nobody can share it.
    assert manager.step(StepPlan(prompt_lens=[16], prompt_tokens=[SYSTEM])).cached_tokens[0] == 0
    staged = commit_prefill(a)
    assert torch.equal(bits(storage.rows()[0, 0, first]), bits(staged[0, 0, 0]))
    manager.mark_written(np.array([a]), np.array([16]))
    assert manager.step(StepPlan(prompt_lens=[16], prompt_tokens=[SYSTEM])).cached_tokens[0] == 12
    commit_prefill(a)  # a second write of the same prefix: refused, the content stays
    assert torch.equal(bits(storage.rows()[0, 0, first]), bits(staged[0, 0, 0]))
    assert writes.metrics().protected_refusals == 16
    manager.check_invariants()
