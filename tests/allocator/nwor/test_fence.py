"""Writer fences: a write whose writer's session has ended writes nothing, read by the write itself
(every backend: the CPU copy, the torch path, the Triton kernel in the interpreter), and the
owner's table of words hands out, closes and checks its slots."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import needs_triton_interpreter

from allocator import (
    CLOSED,
    DeferredWriteManager,
    FenceWords,
    InvariantViolation,
    KVStorage,
    NworInputError,
    PoolConfig,
    WindowLayout,
    WriterFence,
    write_staged,
)
from allocator.common.placement import plain_tensor

LAYERS, SLOTS, ROWS, ROW = 2, 32, 8, 16


def _write(backend: str, dtype: torch.dtype, fence: WriterFence | None) -> torch.Tensor:
    """The pool (NaN-filled, or fp8 0x7F) after one write of ``ROWS`` staged rows."""
    fp8 = dtype == torch.float8_e4m3fn
    pool = torch.empty(LAYERS, 2, SLOTS, ROW, dtype=dtype)
    pool.view(torch.uint8).fill_(0x7F) if fp8 else pool.fill_(float("nan"))
    staged = torch.randn(LAYERS, 2, ROWS, ROW, generator=torch.Generator().manual_seed(0)).to(
        torch.bfloat16 if fp8 else dtype)
    slots = torch.arange(ROWS, dtype=torch.int64).expand(LAYERS, ROWS).contiguous() * 3
    inv = torch.ones(LAYERS, 2) if fp8 else None
    write_staged(pool, staged, slots, torch.full((LAYERS,), ROWS), ROWS, inv, backend=backend,
                 fence=fence)
    return pool


def _words(slots: int = 4) -> FenceWords:
    return FenceWords(slots, torch.device("cpu"), plain_tensor)


BACKENDS = [pytest.param("torch", torch.float32, id="cpu-copy"),
            pytest.param("torch", torch.float8_e4m3fn, id="torch-fp8"),
            pytest.param("triton", torch.float32, id="triton-interpreter",
                         marks=needs_triton_interpreter)]


@pytest.mark.parametrize(("backend", "dtype"), BACKENDS)
def test_an_open_fence_writes_and_a_closed_one_writes_nothing(backend: str,
                                                              dtype: torch.dtype) -> None:
    words = _words()
    slot = words.open(session=12345)
    fence = words.fence(slot)
    unfenced = _write(backend, dtype, None)
    assert torch.equal(_write(backend, dtype, fence).view(torch.uint8),
                       unfenced.view(torch.uint8))
    words.close(slot)
    untouched = _write(backend, dtype, fence).view(torch.uint8)
    assert torch.equal(untouched, _write(backend, dtype, _never_open()).view(torch.uint8))
    assert not torch.equal(untouched, unfenced.view(torch.uint8))


def _never_open() -> WriterFence:
    """A fence whose word never held its session: nothing it guards is written."""
    return WriterFence.of(torch.full((1,), CLOSED, dtype=torch.int64), 7)


def test_a_new_session_in_the_same_slot_does_not_reopen_an_old_fence() -> None:
    words = _words(slots=1)
    old = words.fence(words.open(session=1))
    words.close(0)
    new = words.fence(words.open(session=2))
    assert not old.is_open() and new.is_open()


def test_the_words_refuse_what_they_cannot_hold_with_typed_errors() -> None:
    words = _words(slots=2)
    words.open(1)
    words.open(2)
    with pytest.raises(NworInputError, match="all 2 words are open"):
        words.open(3)
    with pytest.raises(NworInputError, match="negative"):
        _words().open(-5)
    with pytest.raises(NworInputError, match="one int64 element"):
        WriterFence.of(torch.zeros(2, dtype=torch.int64), 1)
    words.check_invariants()


def test_check_invariants_sees_a_word_changed_behind_the_owner() -> None:
    words = _words()
    slot = words.open(99)
    words.words[slot] = 100  # another process of the same user wrote it
    with pytest.raises(InvariantViolation, match=f"slot {slot} holds 100"):
        words.check_invariants()


def test_a_closed_fence_stops_every_write_of_a_window_fallback_included() -> None:
    """The manager's window commits nothing for an ended writer: not the kept tokens, and not
    the write-everything fallback of a cancelled window."""
    cfg = PoolConfig(num_blocks=16, tokens_per_block=4, num_layers=LAYERS, num_kv_heads=1,
                     head_dim=ROW, max_seq_len=32, dtype="float32", device="cpu")
    storage = KVStorage(cfg)
    storage.kv.fill_(float("nan"))
    mgr = DeferredWriteManager(storage, max_tokens=16)
    words = _words()
    fence = words.fence(words.open(5))
    words.close(0)
    staged = torch.randn(LAYERS, 2, 16, 1, ROW)
    for finish in (lambda: mgr.commit([1]), lambda: mgr.cancel("test")):
        mgr.begin_window(WindowLayout.decode([2]), fence=fence)
        mgr.stage_from(staged, torch.arange(3, dtype=torch.int64))
        finish()
        assert storage.kv.isnan().all()
    mgr.check_invariants()
