"""Writer fences: a write whose writer's session has ended writes nothing, read by the write itself
(every backend: the CPU copy, the torch path, the Triton kernel in the interpreter and on a GPU,
and a captured CUDA graph whose word is closed after the capture), and the owner's table of
words hands out, closes and checks its slots."""

from __future__ import annotations

import pytest
import torch
from kvalloc.allocator import (
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
from kvalloc.allocator.common.placement import plain_tensor
from triton_interpreter import needs_triton_interpreter

LAYERS, SLOTS, ROWS, ROW = 2, 32, 8, 16


def _inputs(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """A pool (NaN-filled, or fp8 0x7F), ``ROWS`` staged rows, their slots and row counts."""
    fp8 = dtype == torch.float8_e4m3fn
    pool = torch.empty(LAYERS, 2, SLOTS, ROW, dtype=dtype, device=device)
    pool.view(torch.uint8).fill_(0x7F) if fp8 else pool.fill_(float("nan"))
    staged = torch.randn(LAYERS, 2, ROWS, ROW, generator=torch.Generator().manual_seed(0)).to(
        device=device, dtype=torch.bfloat16 if fp8 else dtype)
    slots = torch.arange(ROWS, dtype=torch.int64, device=device).expand(LAYERS, ROWS) * 3
    return pool, staged, slots.contiguous(), torch.full((LAYERS,), ROWS, device=device)


def _write(backend: str, dtype: torch.dtype, fence: WriterFence | None,
           device: str = "cpu") -> torch.Tensor:
    """The pool after one write of ``ROWS`` staged rows."""
    pool, staged, slots, layer_rows = _inputs(dtype, device)
    inv = torch.ones(LAYERS, 2, device=device) if dtype == torch.float8_e4m3fn else None
    write_staged(pool, staged, slots, layer_rows, ROWS, inv, backend=backend, fence=fence)
    return pool


def _words(slots: int = 4, device: str = "cpu") -> FenceWords:
    return FenceWords(slots, torch.device(device), plain_tensor)


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BACKENDS = [pytest.param("torch", torch.float32, "cpu", id="cpu-copy"),
            pytest.param("torch", torch.float8_e4m3fn, "cpu", id="torch-fp8"),
            pytest.param("triton", torch.float32, "cpu", id="triton-interpreter",
                         marks=needs_triton_interpreter),
            pytest.param("triton", torch.bfloat16, "cuda", id="triton-gpu", marks=GPU),
            pytest.param("triton", torch.float8_e4m3fn, "cuda", id="triton-gpu-fp8", marks=GPU),
            pytest.param("torch", torch.bfloat16, "cuda", id="torch-gpu", marks=GPU)]


@pytest.mark.parametrize(("backend", "dtype", "device"), BACKENDS)
def test_an_open_fence_writes_and_a_closed_one_writes_nothing(backend: str, dtype: torch.dtype,
                                                              device: str) -> None:
    words = _words(device=device)
    slot = words.open(session=12345)
    fence = words.fence(slot)
    unfenced = _write(backend, dtype, None, device).view(torch.uint8)
    assert torch.equal(_write(backend, dtype, fence, device).view(torch.uint8), unfenced)
    words.close(slot)
    untouched = _write(backend, dtype, fence, device).view(torch.uint8)
    assert torch.equal(untouched, _write(backend, dtype, _never_open(device), device).view(
        torch.uint8))
    assert not torch.equal(untouched, unfenced)


def _never_open(device: str = "cpu") -> WriterFence:
    """A fence whose word never held its session: nothing it guards is written."""
    return WriterFence.of(torch.full((1,), CLOSED, dtype=torch.int64, device=device), 7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_captured_write_reads_the_word_at_each_replay() -> None:
    """A CUDA graph captured while the word was open writes nothing once it is closed: the
    word is read when the kernel runs, not baked in at capture (an overlap worker's steps are
    graph replays)."""
    words = _words(device="cuda")
    fence = words.fence(words.open(session=3))
    pool, staged, slots, layer_rows = _inputs(torch.bfloat16, "cuda")
    write_staged(pool, staged, slots, layer_rows, ROWS, backend="triton", fence=fence)  # compile
    pool.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_staged(pool, staged, slots, layer_rows, ROWS, backend="triton", fence=fence)
    pool.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not pool.isnan().all()  # open: the replay writes
    pool.fill_(float("nan"))
    words.close(0)
    graph.replay()
    torch.cuda.synchronize()
    assert pool.isnan().all()


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
