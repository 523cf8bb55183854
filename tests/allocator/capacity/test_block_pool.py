"""`BlockPool`: host-side ownership of block ids (docs/design.md "Words": the pool's free list
and reference counts).

Rules checked here:
- blocks are conserved: free + owned == total, after any sequence of operations;
- the free list is a LIFO stack: a freed block is the next one handed out (warm reuse), and a
  fresh pool hands out 0, 1, 2, ... in order;
- allocate, release and incref cost O(blocks touched), not O(pool size);
- reference counts: a shared block returns to the free list only when its last holder releases it;
- running out is a typed `OutOfBlocks` that takes nothing (never a partial allocation);
- bad ids (out of range, over-release, sharing a free block) raise `InvalidValue`, changing
  nothing.

The pool holds no device tensors (the KV storage and block table do), so there is no GPU variant.
"""

from __future__ import annotations

import copy
import statistics
import time

import numpy as np
import pytest
from kvalloc.allocator import BlockPool, InvalidValue, InvariantViolation, OutOfBlocks


def owned(pool: BlockPool) -> np.ndarray:
    return np.flatnonzero(pool.refcount(np.arange(pool.num_blocks)) > 0)


def assert_conserved(pool: BlockPool) -> None:
    assert pool.num_free + owned(pool).size == pool.num_blocks
    pool.check_invariants()


def state(pool: BlockPool) -> tuple[int, list[int], list[int]]:
    """Everything observable: free count, every refcount, and the order blocks would come out."""
    probe = copy.deepcopy(pool)
    return (pool.num_free, pool.refcount(np.arange(pool.num_blocks)).tolist(),
            probe.allocate(probe.num_free).tolist())


def test_fresh_pool_is_all_free_and_hands_out_blocks_in_id_order():
    """A new pool owns nothing; blocks come out as 0, 1, 2, ... so tables read naturally."""
    pool = BlockPool(10)
    assert pool.num_free == 10
    assert owned(pool).size == 0
    assert pool.allocate(3).tolist() == [0, 1, 2]
    assert pool.allocate(2).tolist() == [3, 4]
    assert_conserved(pool)


def test_allocate_gives_distinct_ids_with_refcount_one():
    """allocate(n) takes exactly n distinct in-range blocks, each now held once."""
    pool = BlockPool(16)
    ids = pool.allocate(7)
    assert ids.size == 7 and np.unique(ids).size == 7
    assert ((ids >= 0) & (ids < 16)).all()
    assert (pool.refcount(ids) == 1).all()
    assert pool.num_free == 9
    assert_conserved(pool)


def test_allocate_zero_is_a_no_op_and_negative_is_rejected():
    pool = BlockPool(4)
    before = state(pool)
    assert pool.allocate(0).size == 0
    assert state(pool) == before
    with pytest.raises(InvalidValue):
        pool.allocate(-1)
    assert state(pool) == before


def test_a_pool_needs_at_least_one_block():
    with pytest.raises(InvalidValue):
        BlockPool(0)


def test_freed_block_is_reused_first_lifo():
    """The block released last is the next one allocated (LIFO), immediately."""
    pool = BlockPool(32)
    ids = pool.allocate(20)
    victim = int(ids[13])
    pool.release_unique(np.array([victim]))
    assert pool.allocate(1).tolist() == [victim]

    a, b = int(ids[3]), int(ids[8])
    pool.release(np.array([a]))
    pool.release(np.array([b]))
    assert pool.allocate(1).tolist() == [b]
    assert pool.allocate(1).tolist() == [a]
    assert_conserved(pool)


def test_a_released_batch_is_exactly_what_comes_back_next():
    """Releasing a set S and allocating |S| returns S again: freed blocks are reusable at once."""
    rng = np.random.default_rng(0)
    pool = BlockPool(64)
    held = pool.allocate(40)
    s = rng.choice(held, size=11, replace=False)
    pool.release_unique(s)
    assert sorted(pool.allocate(11).tolist()) == sorted(s.tolist())
    assert_conserved(pool)


def test_out_of_blocks_takes_nothing():
    """Asking for more than is free raises OutOfBlocks with the pool exactly as it was."""
    pool = BlockPool(8)
    pool.allocate(5)
    before = state(pool)
    with pytest.raises(OutOfBlocks):
        pool.allocate(4)
    assert state(pool) == before
    assert pool.allocate(3).size == 3  # what was free is still all there
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    assert pool.num_free == 0
    assert_conserved(pool)


def test_shared_block_is_freed_only_by_its_last_holder():
    """incref adds a holder; a block goes back to the free list when its count reaches 0."""
    pool = BlockPool(8)
    ids = pool.allocate(3)
    shared = ids[:2]
    pool.incref(shared)
    assert pool.refcount(shared).tolist() == [2, 2]
    pool.release(ids)  # the first holder lets go of all three
    assert pool.refcount(ids).tolist() == [1, 1, 0]
    assert pool.num_free == 6
    assert_conserved(pool)
    pool.release(shared)
    assert pool.refcount(ids).tolist() == [0, 0, 0]
    assert pool.num_free == 8
    assert_conserved(pool)


def test_release_of_the_same_id_twice_in_one_call_drops_two_references():
    pool = BlockPool(4)
    ids = pool.allocate(1)
    pool.incref(ids)
    pool.release(np.array([ids[0], ids[0]]))
    assert pool.refcount(ids).tolist() == [0]
    assert pool.num_free == 4
    assert_conserved(pool)


@pytest.mark.parametrize(
    ("op", "make_ids"),
    [
        ("release", lambda held: np.array([held[0], held[0]])),  # held once, released twice
        ("release", lambda held: np.array([7])),                 # never allocated
        ("release", lambda held: np.array([-1])),
        ("release", lambda held: np.array([8])),
        ("incref", lambda held: np.array([7])),                  # sharing a free block
        ("incref", lambda held: np.array([-1])),
        ("incref", lambda held: np.array([8])),
    ],
)
def test_bad_ids_raise_and_change_nothing(op, make_ids):
    """Out-of-range ids, over-release and sharing a free block are rejected before any change."""
    pool = BlockPool(8)
    held = pool.allocate(3)
    before = state(pool)
    with pytest.raises(InvalidValue):
        getattr(pool, op)(make_ids(held))
    assert state(pool) == before
    assert_conserved(pool)


def test_check_invariants_catches_a_double_release_on_the_unchecked_fast_path():
    """release_unique trusts its caller; check_invariants is what catches a broken caller."""
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.release_unique(ids[:1])
    pool.release_unique(ids[:1])
    with pytest.raises(InvariantViolation):
        pool.check_invariants()


def test_conservation_under_random_operations_against_a_reference_model():
    """Random allocate / incref / release / release_unique: refcounts match a dict model and
    free + owned == total after every operation."""
    rng = np.random.default_rng(1234)
    n = 48
    pool = BlockPool(n)
    model = np.zeros(n, dtype=np.int64)  # reference counts
    for _ in range(3000):
        op = rng.integers(4)
        held = np.flatnonzero(model > 0)
        if op == 0:
            k = int(rng.integers(0, 8))
            if k > n - held.size:
                with pytest.raises(OutOfBlocks):
                    pool.allocate(k)
            else:
                ids = pool.allocate(k)
                assert (model[ids] == 0).all() and np.unique(ids).size == k
                model[ids] = 1
        elif op == 1 and held.size:
            ids = rng.choice(held, size=int(rng.integers(1, held.size + 1)), replace=True)
            pool.incref(ids)
            np.add.at(model, ids, 1)
        elif op == 2 and held.size:
            ids = rng.choice(held, size=int(rng.integers(1, held.size + 1)), replace=False)
            pool.release(ids)
            model[ids] -= 1
        elif op == 3:
            once = np.flatnonzero(model == 1)
            if once.size:
                ids = rng.choice(once, size=int(rng.integers(1, once.size + 1)), replace=False)
                pool.release_unique(ids)
                model[ids] -= 1
        assert pool.refcount(np.arange(n)).tolist() == model.tolist()
        assert pool.num_free == int((model == 0).sum())
        assert_conserved(pool)


def _median_op_seconds(num_blocks: int, op: str) -> float:
    pool = BlockPool(num_blocks)
    pool.allocate(num_blocks // 2)
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        ids = pool.allocate(2)
        if op == "incref":
            pool.incref(ids)
            pool.release(ids)
            pool.release(ids)
        elif op == "release":
            pool.release(ids)
        else:
            pool.release_unique(ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@pytest.mark.parametrize("op", ["release_unique", "release", "incref"])
def test_operations_cost_does_not_grow_with_the_pool(op):
    """O(1) free list: taking and returning a block costs the same in a 1k-block pool and a
    4M-block pool (an O(pool) scan would be ~1000x slower; 20x leaves room for a noisy box)."""
    small = _median_op_seconds(1_000, op)
    large = _median_op_seconds(4_000_000, op)
    assert large < 20 * small + 20e-6, (small, large)
