"""`TierStore.copy`: what a call leaves in the pool and in the tier's memory.

- A copy leaves the pool and the memory as `copy_reference` does (onboards, then offloads, block
  by block), byte for byte, whatever the pool's dtype (float32, bfloat16, fp8): for scattered
  blocks, slots in runs of consecutive values and alone, both directions in one call, an offload
  rewriting a slot an onboard of the same call reads, and an offload of a block the same call
  onboards.
- On CUDA the copies need no host synchronisation by the caller: work enqueued on the current
  stream after the call sees the onboarded blocks, and may rewrite the offloaded blocks at once
  (the tier receives what they held at the call).
- On CUDA a copy of more blocks than the scratch holds (several rounds) equals the reference too.

Every test compares the integer views of the same size (`TierStore.kv`, ``memory``): a copy moves
bytes, and random bytes of a float type hold NaNs, which no float comparison equates.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from kvalloc.allocator import PoolConfig
from kvalloc.allocator.capacity.tier_copies import NO_COPIES, TierCopies
from kvalloc.server.service import tier_store
from kvalloc.server.service.tier_store import TierStore, copy_reference

on_each_device = pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])
on_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="needs CUDA")]
# The pool's names for its dtypes (PoolConfig.dtype): fp8 is float8_e4m3fn.
POOL_DTYPES = ["float32", "bfloat16", "fp8_e4m3"]
LAYERS, TPB, HEADS, DIM = 2, 4, 2, 8
# Large enough that the copies take milliseconds: work on the current stream that did not wait
# for them would run (and be seen to run) while they are still under way.
BIG = (4, 16, 8, 128)


def tier(device: str, dtype: torch.dtype, blocks: int, slots: int, seed: int,
         shape: tuple[int, int, int, int] = (LAYERS, TPB, HEADS, DIM),
         planes: int = 2) -> TierStore:
    """A store over a pool of ``blocks`` blocks (``planes``: 2 for K/V, 1 for a latent pool),
    pool and memory full of random bytes."""
    layers, tpb, heads, dim = shape
    store = TierStore(torch.empty((layers, planes, blocks, tpb, heads, dim), dtype=dtype,
                                  device=device), slots)
    gen = torch.Generator().manual_seed(seed)
    for target in (store.kv, store.memory):
        target.view(-1).view(torch.uint8).copy_(torch.randint(
            0, 256, (target.nbytes,), dtype=torch.uint8, generator=gen))
    return store


def slot_order(rng: np.random.Generator, num_slots: int) -> np.ndarray:
    """Every slot once: runs of 1 to 8 consecutive slots, the runs in random order."""
    cuts = np.cumsum(rng.integers(1, 9, num_slots))
    cuts = cuts[cuts < num_slots]
    runs = np.split(np.arange(num_slots), cuts)
    return np.concatenate([runs[i] for i in rng.permutation(len(runs))])


def random_copies(rng: np.random.Generator, num_blocks: int, num_slots: int, onboards: int,
                  offloads: int, shared_slots: int = 0) -> tuple[TierCopies, TierCopies]:
    """Distinct blocks throughout; distinct slots in each direction, the offloads' first
    ``shared_slots`` being the onboards' last."""
    blocks = rng.permutation(num_blocks)[: onboards + offloads]
    slots = slot_order(rng, num_slots)
    return (TierCopies(blocks[:onboards], slots[:onboards]),
            TierCopies(blocks[onboards:],
                       slots[onboards - shared_slots : onboards - shared_slots + offloads]))


def expected_after(store: TierStore, onboards: TierCopies,
                   offloads: TierCopies) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool and the memory `copy_reference` leaves, from the store's content now."""
    kv, memory = store.kv.cpu().clone(), store.memory.clone()
    copy_reference(kv, memory, onboards, offloads)
    return kv, memory


def assert_as_expected(store: TierStore, expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    if store.cuda:
        torch.cuda.synchronize()
    assert torch.equal(store.kv.cpu(), expected[0])
    assert torch.equal(store.memory, expected[1])


@pytest.fixture
def torch_dtype(make_config: Callable[..., PoolConfig],
                request: pytest.FixtureRequest) -> torch.dtype:
    return make_config(dtype=request.param).torch_dtype


def copy_and_compare(store: TierStore, onboards: TierCopies, offloads: TierCopies) -> None:
    expected = expected_after(store, onboards, offloads)
    store.copy(onboards, offloads)
    assert_as_expected(store, expected)


@on_each_device
@pytest.mark.parametrize("torch_dtype", POOL_DTYPES, indirect=True)
def test_random_copies_in_both_directions_equal_the_reference(device: str,
                                                              torch_dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    store = tier(device, torch_dtype, blocks=96, slots=80, seed=1)
    for onboards, offloads, shared in [(0, 17, 0), (23, 0, 0), (20, 25, 0), (20, 25, 7),
                                       (1, 1, 1), (40, 40, 40)]:
        copy_and_compare(store, *random_copies(rng, 96, 80, onboards, offloads, shared))


@on_each_device
@pytest.mark.parametrize("torch_dtype", POOL_DTYPES, indirect=True)
def test_a_latent_pools_blocks_are_copied_whole(device: str, torch_dtype: torch.dtype) -> None:
    """A latent pool (MLA: one plane, one head of the latent's width) is one piece a layer: a
    slot of its tier is ``[L, 1, T, 1, D]``, and its copies equal the reference too."""
    rng = np.random.default_rng(3)
    store = tier(device, torch_dtype, blocks=48, slots=40, seed=4, shape=(LAYERS, TPB, 1, 72),
                 planes=1)
    assert store.memory.shape == (40, LAYERS, 1, TPB, 1, 72)
    assert store.slot_bytes == LAYERS * TPB * 72 * store.kv.element_size()
    for onboards, offloads, shared in [(0, 11, 0), (9, 0, 0), (15, 12, 5)]:
        copy_and_compare(store, *random_copies(rng, 48, 40, onboards, offloads, shared))


@on_each_device
@pytest.mark.parametrize("torch_dtype", POOL_DTYPES, indirect=True)
def test_back_to_back_calls_each_see_the_last_ones_copies(device: str,
                                                          torch_dtype: torch.dtype) -> None:
    """No synchronisation between the calls: an onboard reads what an earlier call offloaded
    into its slots, an offload rewrites slots an earlier call's onboard reads."""
    rng = np.random.default_rng(1)
    store = tier(device, torch_dtype, blocks=64, slots=48, seed=2)
    kv, memory = store.kv.cpu().clone(), store.memory.clone()
    for _ in range(8):
        onboards, offloads = random_copies(rng, 64, 48, *rng.integers(0, 20, 2),
                                           shared_slots=0)
        copy_reference(kv, memory, onboards, offloads)
        store.copy(onboards, offloads)
    assert_as_expected(store, (kv, memory))


@on_each_device
@pytest.mark.parametrize("torch_dtype", POOL_DTYPES, indirect=True)
def test_a_block_onboarded_and_offloaded_in_one_call_carries_the_onboarded_content(
        device: str, torch_dtype: torch.dtype) -> None:
    """Its slots apart: only the block orders the offload after the onboard (which takes a
    while, so an offload that did not wait would read the block's old content)."""
    store = tier(device, torch_dtype, blocks=160, slots=160, seed=3, shape=BIG)
    last = 127
    onboards = TierCopies(np.arange(128), np.arange(128))
    offloads = TierCopies(np.array([last, 150]), np.array([140, 141]))
    copy_and_compare(store, onboards, offloads)
    assert torch.equal(store.memory[140], store.memory[last])


@on_each_device
def test_no_copies_change_nothing(device: str) -> None:
    store = tier(device, torch.bfloat16, blocks=8, slots=8, seed=4)
    copy_and_compare(store, NO_COPIES, NO_COPIES)
    assert store.copy_seconds == 0


@pytest.mark.parametrize("torch_dtype", POOL_DTYPES, indirect=True)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=on_cuda)])
def test_copies_of_more_blocks_than_the_scratch_holds_equal_the_reference(
        device: str, torch_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    slot_bytes = 2 * LAYERS * TPB * HEADS * DIM * torch_dtype.itemsize
    monkeypatch.setattr(tier_store, "SCRATCH_BYTES", 3 * slot_bytes)
    rng = np.random.default_rng(5)
    store = tier(device, torch_dtype, blocks=96, slots=80, seed=6)
    assert store._cuda.scratch_slots == 3
    for onboards, offloads, shared in [(20, 0, 0), (0, 19, 0), (25, 26, 9), (40, 40, 40)]:
        copy_and_compare(store, *random_copies(rng, 96, 80, onboards, offloads, shared))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=on_cuda)])
def test_the_current_stream_sees_onboarded_blocks_without_synchronisation(device: str) -> None:
    rng = np.random.default_rng(7)
    store = tier(device, torch.float32, blocks=512, slots=384, seed=8, shape=BIG)
    onboards, _ = random_copies(rng, 512, 384, 256, 0)
    expected = expected_after(store, onboards, NO_COPIES)
    torch.cuda.synchronize()
    store.copy(onboards, NO_COPIES)
    seen = store.kv.clone()  # the current stream, right after the call
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), expected[0])


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=on_cuda)])
def test_the_current_stream_may_rewrite_offloaded_blocks_right_after_the_call(
        device: str) -> None:
    rng = np.random.default_rng(9)
    store = tier(device, torch.float32, blocks=512, slots=384, seed=10, shape=BIG)
    onboards, offloads = random_copies(rng, 512, 384, 64, 256, shared_slots=16)
    expected = expected_after(store, onboards, offloads)
    torch.cuda.synchronize()
    store.copy(onboards, offloads)
    store.kv.zero_()  # the current stream, right after the call
    torch.cuda.synchronize()
    assert torch.equal(store.memory, expected[1])
