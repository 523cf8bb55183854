"""The paged two-source attention kernel (`worker.attention.pool_attention_triton`) against the
torch reference (`worker.attention.pool_attention.pool_attention`) on random steps
(`pool_steps`): ragged histories crossing blocks, empty entries, rows whose history runs past
their blocks (-1 table entries, invisible to both), device-only leads, sliding windows, GQA
ratios 1 / 4 / 8, and NaN in every pool slot and staging row the step does not own, so a read
outside an entry's blocks shows in the output. CPU cases run the kernel in Triton's interpreter
on small shapes; GPU cases run it compiled on larger ones, and once captured in a CUDA graph and
replayed.

Tolerances. float32: 1e-5 (both sum the same products in float32, in another order). 16-bit
dtypes: outputs are convex combinations of N(0, 1) values, below ~4 in size; the reference
rounds the output once, the kernel also rounds the probabilities to the value dtype before its
P x V product (relative 2^-9 in bf16, 2^-12 in fp16, each weight), so the two differ by a few
units of the output's last place: atol = rtol = 2e-2 in bf16 and 4e-3 in fp16. fp8 pools: the
kernel converts the stored values to the query's dtype exactly and scales the scores, the
reference attends in float32 on the dequantised values, so neither rounds them and the
tolerance is that of the query's dtype. (A reference rounding its dequantised keys to bf16 was
measured 0.022 away from the kernel on the GPU, and 0.026 from a float64 truth on the CPU.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cuda_checks import no_host_sync
from kvalloc.worker.attention import hook
from kvalloc.worker.attention.pool_attention import PagedLayout, pool_attention
from kvalloc.worker.attention.pool_attention_triton import (
    MAX_DECODE_QUERY,
    LaunchConfig,
    PrefillConfig,
    kernel_takes,
    pool_attention_triton,
    prefill_tiles,
)
from kvalloc.worker.errors import PoolAttentionInputError
from pool_steps import RandomStep, assert_attention_matches, random_step
from triton_interpreter import needs_triton_interpreter_with_loaded_bounds as needs_interpreter

FP8 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _both(step: RandomStep, *, window: int | None, scale: float = 0.3,
          launch: LaunchConfig | None = None,
          prefill: PrefillConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) on one step; the kernel writes into a NaN-filled ``out`` so a row it
    skipped shows."""
    args = (step.query, step.staged_k, step.staged_v, step.pool_k, step.pool_v, step.layout)
    kw = {"scale": scale, "window": window, "k_scale": step.k_scale, "v_scale": step.v_scale}
    out = torch.full_like(step.query, float("nan"))
    got = pool_attention_triton(*args, **kw, out=out, launch=launch, prefill=prefill)
    assert got is out
    return got, pool_attention(*args, **kw)


CPU_CASES = [  # (dtype, fp8 pool, GQA ratio, window, device-only leads)
    (torch.float32, False, 4, None, True), (torch.float32, False, 4, 5, False),
    (torch.float32, False, 1, None, False), (torch.float32, False, 1, 3, True),
    (torch.float32, False, 8, None, True), (torch.float32, False, 8, 6, False),
    (torch.bfloat16, False, 4, None, True), (torch.bfloat16, False, 8, 5, False),
    (torch.float16, False, 4, None, False), (torch.float16, False, 1, 5, True),
    (torch.bfloat16, True, 4, None, True), (torch.bfloat16, True, 8, 4, False),
]


@needs_interpreter
@pytest.mark.parametrize(("dtype", "fp8", "group", "window", "lead"), CPU_CASES)
def test_kernel_equals_reference_in_the_interpreter(dtype: torch.dtype, fp8: bool, group: int,
                                                    window: int | None, lead: bool) -> None:
    step = random_step(group * 31 + (window or 0) + 7 * fp8, entries=5, kv_heads=2, group=group,
                       dim=16, tokens_per_block=4, max_history=30, max_query=4, dtype=dtype,
                       device="cpu", fp8=fp8, lead=lead)
    assert_attention_matches(*_both(step, window=window, launch=LaunchConfig(block_n=16)))


@needs_interpreter
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_chunks_split_into_query_tiles(window: int | None) -> None:
    """GQA 8 with 12-token entries: two query tiles a head (8 queries x 8 heads a program)."""
    step = random_step(5, entries=3, kv_heads=1, group=8, dim=16, tokens_per_block=4,
                       max_history=20, max_query=12, dtype=torch.float32, device="cpu",
                       lead=True)
    assert_attention_matches(*_both(step, window=window, launch=LaunchConfig(block_n=16)))


@needs_interpreter
@pytest.mark.parametrize("window", [None, 6])
def test_an_odd_group_and_odd_entry_lengths_equal_the_reference(window: int | None) -> None:
    """GQA 7 (28 query heads over 4 KV heads) and entries of up to 11 tokens: a program holds a
    power-of-two tile of queries (8: 56 rows), the last tile only partly used."""
    step = random_step(11, entries=4, kv_heads=1, group=7, dim=16, tokens_per_block=4,
                       max_history=20, max_query=11, dtype=torch.float32, device="cpu",
                       lead=True)
    assert_attention_matches(*_both(step, window=window, launch=LaunchConfig(block_n=16)))


@needs_interpreter
@pytest.mark.parametrize(("dtype", "fp8", "group", "window", "splits"), [
    (torch.float32, False, 4, None, 2), (torch.float32, False, 1, 3, 4),
    (torch.bfloat16, True, 8, 9, 8)])
def test_split_histories_merge_to_the_reference(dtype: torch.dtype, fp8: bool, group: int,
                                                window: int | None, splits: int) -> None:
    """Histories up to 60 keys in 16-key steps: 2 to 4 steps an entry, so with 4 or 8 splits
    some splits hold no key (their partial softmax must weigh nothing)."""
    step = random_step(splits + group, entries=4, kv_heads=2, group=group, dim=16,
                       tokens_per_block=4, max_history=60, max_query=4, dtype=dtype,
                       device="cpu", fp8=fp8, lead=True)
    launch = LaunchConfig(block_n=16, splits=splits)
    assert_attention_matches(*_both(step, window=window, launch=launch))


@needs_interpreter
@pytest.mark.parametrize(("window", "max_query", "splits"), [(5, 4, 1), (7, 12, 1), (9, 4, 4)])
def test_a_windowed_pools_released_columns_are_never_read(window: int, max_query: int,
                                                          splits: int) -> None:
    """Every row's columns behind its window hold RELEASED (-2) and their blocks NaN, as a
    windowed pool's do once another request holds them: decodes, prefill chunks and split
    histories all equal the reference (whose table reading skips negative entries too)."""
    step = random_step(window + max_query + splits, entries=5, kv_heads=2, group=4, dim=16,
                       tokens_per_block=4, max_history=50, max_query=max_query,
                       dtype=torch.float32, device="cpu", lead=True, released=window)
    assert (step.layout.block_table == -2).any()
    launch = LaunchConfig(block_n=16, splits=splits)
    assert_attention_matches(*_both(step, window=window, launch=launch))


@needs_interpreter
def test_an_empty_step_writes_nothing() -> None:
    step = random_step(1, entries=2, kv_heads=1, group=2, dim=16, tokens_per_block=4,
                       max_history=8, max_query=0, dtype=torch.float32, device="cpu")
    got, want = _both(step, window=None)
    assert got.shape == want.shape == (0, 2, 16)


def test_bad_input_is_a_typed_error_naming_it_and_writes_nothing() -> None:
    step = random_step(2, entries=3, kv_heads=2, group=2, dim=16, tokens_per_block=4,
                       max_history=8, max_query=3, dtype=torch.float32, device="cpu")
    args = (step.query, step.staged_k, step.staged_v, step.pool_k, step.pool_v, step.layout)
    out = torch.full_like(step.query, float("nan"))
    fp8_pool = step.pool_k.to(FP8)
    cases = [
        ({"window": 0}, "window"),
        ({"out": out[:, :1]}, "out"),
        ({"out": out.half()}, "out"),
        ({"k_scale": torch.ones(1)}, "k_scale"),
    ]
    for kwargs, field in cases:
        with pytest.raises(PoolAttentionInputError, match=rf"^{field}:") as err:
            pool_attention_triton(*args, **{"out": out, **kwargs})
        assert err.value.field == field
    with pytest.raises(PoolAttentionInputError, match=r"^k_scale: an fp8 pool needs"):
        pool_attention_triton(*args[:3], fp8_pool, fp8_pool, step.layout, out=out)
    with pytest.raises(PoolAttentionInputError, match=r"^query:"):
        pool_attention_triton(step.query[:-1], *args[1:], out=out)
    with pytest.raises(PoolAttentionInputError, match=r"^pool_k:"):
        pool_attention_triton(*args[:3], step.pool_k.half(), step.pool_v.half(), step.layout)
    with pytest.raises(PoolAttentionInputError, match=r"^pool_v:"):
        pool_attention_triton(*args[:4], step.pool_v.half(), step.layout, out=out)
    wide_table = dataclasses.replace(step.layout, block_table=step.layout.block_table.long())
    with pytest.raises(PoolAttentionInputError, match=r"^block_table:"):
        pool_attention_triton(*args[:5], wide_table, out=out)
    with pytest.raises(PoolAttentionInputError, match=r"^launch:"):
        LaunchConfig(splits=3)
    with pytest.raises(PoolAttentionInputError, match=r"^staged_k:"):
        pool_attention(step.query, step.staged_k[:, :1], *args[2:])
    assert out.isnan().all()


# Long chunks (past MAX_DECODE_QUERY: the prefill launch) beside decodes of 4 and empty
# entries, at history 0 and after a long one, crossing 4-token blocks, under windows shorter
# than the chunk: (dtype, fp8 pool, GQA ratio, window, query lengths, histories).
PREFILL_CPU_CASES = [
    (torch.float32, False, 4, None, [300, 4, 4, 0, 4], [0, 30, 9, 5, 17]),
    (torch.float32, False, 1, 37, [4, 200, 130], [3, 150, 0]),
    (torch.float32, False, 8, 70, [65, 4, 257], [211, 40, 0]),
    (torch.bfloat16, False, 8, None, [257, 4, 0, 4], [0, 20, 1, 45]),
    (torch.float16, False, 2, None, [4, 190], [12, 260]),
    (torch.bfloat16, True, 4, 50, [180, 4, 0, 65], [211, 12, 3, 0]),
    (torch.bfloat16, True, 1, None, [4, 4, 150], [33, 0, 120]),
]
PREFILL_CUTS = [PrefillConfig(), PrefillConfig(block_m=32, block_n=16)]


@needs_interpreter
@pytest.mark.parametrize(("dtype", "fp8", "group", "window", "lens", "hist"), PREFILL_CPU_CASES)
def test_long_chunks_with_decodes_equal_the_reference(dtype: torch.dtype, fp8: bool, group: int,
                                                      window: int | None, lens: list[int],
                                                      hist: list[int]) -> None:
    """Both prefill cuts: 128 x 64 tiles (the default) and 32 x 16 ones (many tiles, each
    ending inside a block and a chunk)."""
    step = random_step(sum(lens) + group, entries=len(lens), kv_heads=2, group=group, dim=16,
                       tokens_per_block=4, max_history=max(hist), max_query=max(lens),
                       dtype=dtype, device="cpu", fp8=fp8, lead=True, query_lens=lens,
                       histories=hist)
    for prefill in PREFILL_CUTS:
        assert_attention_matches(*_both(step, window=window, launch=LaunchConfig(block_n=16),
                               prefill=prefill))


def test_prefill_tiles_cover_each_long_chunk_once_most_keys_first() -> None:
    step = random_step(4, entries=4, kv_heads=1, group=2, dim=16, tokens_per_block=4,
                       max_history=500, max_query=300, dtype=torch.float32, device="cpu",
                       query_lens=[300, 4, 70, 65], histories=[0, 9, 500, 10])
    tiles = prefill_tiles(step.layout.bounds, 32).reshape(2, -1)
    covered = sorted((int(e), int(f) + i) for e, f in tiles.T for i in range(32))
    want = sorted((e, q) for e, n in ((0, 300), (2, 70), (3, 65)) for q in range(0, n))
    assert [c for c in covered if c[1] < [300, 4, 70, 65][c[0]]] == want
    assert len(covered) == 32 * tiles.shape[1] == 32 * (10 + 3 + 3)
    bounds = step.layout.bounds
    keys = (bounds.reach - bounds.query_lens)[tiles[0]] + tiles[1]  # before each tile's queries
    assert keys.tolist()[:5] == [564, 532, 500, 288, 256]
    assert (keys[:-1] >= keys[1:]).all()


def test_a_bad_prefill_cut_is_a_typed_error() -> None:
    with pytest.raises(PoolAttentionInputError, match=r"^prefill: block_m and block_n") as err:
        PrefillConfig(block_m=96)
    assert err.value.field == "prefill"


def test_dispatch_rule_keeps_cpu_on_the_reference() -> None:
    step = random_step(3, entries=2, kv_heads=1, group=2, dim=16, tokens_per_block=4,
                       max_history=8, max_query=3, dtype=torch.float32, device="cpu")
    assert not kernel_takes(step.query, step.pool_k, step.layout)


GPU_SHAPES = [(1, 64), (4, 64), (4, 128), (8, 128)]  # (GQA ratio, head size)
GPU_DTYPES = [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True),
              (torch.float16, True)]  # (query dtype, fp8 pool)
# Every shape meets every dtype; windows and entry lengths (decode, the longest the kernel
# takes) rotate across them, so each compiled variant is checked without the full product.
GPU_CASES = [(dtype, fp8, group, dim, (None, 100)[(i + i // 4) % 2],
              (4, MAX_DECODE_QUERY)[(i // 2 + i // 4) % 2])
             for i, ((dtype, fp8), (group, dim)) in enumerate(
                 (d, s) for d in GPU_DTYPES for s in GPU_SHAPES)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("dtype", "fp8", "group", "dim", "window", "max_query"), GPU_CASES)
def test_kernel_equals_reference_on_gpu(dtype: torch.dtype, fp8: bool, group: int, dim: int,
                                        window: int | None, max_query: int) -> None:
    step = _gpu_step(group + dim + (window or 0) + max_query, group=group, dim=dim,
                     max_query=max_query, dtype=dtype, fp8=fp8)
    assert kernel_takes(step.query, step.pool_k, step.layout)
    assert_attention_matches(*_both(step, window=window))


# (dtype, fp8 pool, GQA ratio, head size, window, the long chunk, its history), each beside
# decodes of 4 at random histories, and a second chunk of 300 in the 8192 one.
BF16, FP16 = torch.bfloat16, torch.float16
PREFILL_GPU_CASES = [
    (BF16, False, 4, 64, None, 2048, 0), (BF16, False, 4, 128, None, 2048, 4096),
    (BF16, False, 8, 128, 1000, 3000, 2500), (FP16, False, 1, 64, None, 2049, 700),
    (BF16, True, 4, 128, None, 2048, 4096), (FP16, True, 8, 64, 512, 2500, 0),
    (BF16, False, 4, 64, None, 8192, 0),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("dtype", "fp8", "group", "dim", "window", "chunk", "history"),
                         PREFILL_GPU_CASES)
def test_long_chunks_on_gpu_equal_the_reference(dtype: torch.dtype, fp8: bool, group: int,
                                                dim: int, window: int | None, chunk: int,
                                                history: int) -> None:
    decodes = 63 if chunk == 8192 else 15
    lens = [chunk, *[4] * decodes] + [300] * (chunk == 8192)
    hist = [history, *range(0, 1500, 1500 // decodes)][:decodes + 1] + [90] * (chunk == 8192)
    step = random_step(chunk + dim + group, entries=len(lens), kv_heads=4 if dim == 64 else 2,
                       group=group, dim=dim, tokens_per_block=16, max_history=max(hist),
                       max_query=chunk, dtype=dtype, device="cuda", fp8=fp8, lead=True,
                       query_lens=lens, histories=hist)
    assert kernel_takes(step.query, step.pool_k, step.layout)
    assert_attention_matches(*_both(step, window=window))


@pytest.mark.gpu
@needs_cuda
def test_a_captured_mixed_step_replays_without_host_sync() -> None:
    """A prefill chunk beside decodes, captured once its tile map is uploaded: the replay
    equals the reference, and neither launch makes the host wait."""
    step = random_step(21, entries=9, kv_heads=2, group=4, dim=128, tokens_per_block=16,
                       max_history=3000, max_query=2048, dtype=torch.bfloat16, device="cuda",
                       lead=True, query_lens=[2048, *[4] * 8], histories=[3000, *[700] * 8])
    args = (step.query, step.staged_k, step.staged_v, step.pool_k, step.pool_v, step.layout)
    out = torch.full_like(step.query, float("nan"))
    pool_attention_triton(*args, out=out)  # compiled, and the tile map uploaded
    with no_host_sync():
        pool_attention_triton(*args, out=out)
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool_attention_triton(*args, out=out)
    graph.replay()
    assert_attention_matches(out, pool_attention(*args))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 64])
def test_float32_on_gpu_matches_to_float32_rounding(window: int | None) -> None:
    step = _gpu_step(9, group=4, dim=64, max_query=4, dtype=torch.float32)
    assert_attention_matches(*_both(step, window=window))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [1, 2, 8, None])
def test_every_split_count_on_gpu(splits: int | None) -> None:
    step = _gpu_step(12, group=4, dim=128, max_query=4, dtype=torch.bfloat16)
    assert_attention_matches(*_both(step, window=None, launch=LaunchConfig(splits=splits)))


@pytest.mark.gpu
@needs_cuda
def test_dispatch_rule_on_gpu() -> None:
    decode = _gpu_step(4, group=4, dim=64, max_query=4, dtype=torch.bfloat16)
    long = _gpu_step(4, group=4, dim=64, max_query=2048, dtype=torch.bfloat16)
    assert kernel_takes(decode.query, decode.pool_k, decode.layout)
    assert kernel_takes(long.query, long.pool_k, long.layout)


@pytest.mark.gpu
@needs_cuda
def test_a_launch_makes_no_host_sync() -> None:
    step = _gpu_step(6, group=4, dim=64, max_query=4, dtype=torch.bfloat16)
    _both(step, window=None)  # compiled before the check
    with no_host_sync():
        pool_attention_triton(step.query, step.staged_k, step.staged_v, step.pool_k,
                              step.pool_v, step.layout, window=32)


@pytest.mark.gpu
@needs_cuda
def test_a_captured_launch_replays_with_the_devices_new_histories() -> None:
    """Captured once, replayed after the device moved every history back one token (as an
    overlap worker's lead changes) and new queries and staged K/V arrived: the replay reads
    them all, and equals the reference on a layout built from the new histories."""
    step = _gpu_step(8, group=4, dim=128, max_query=4, dtype=torch.bfloat16)
    args = (step.query, step.staged_k, step.staged_v, step.pool_k, step.pool_v, step.layout)
    out = torch.empty_like(step.query)
    pool_attention_triton(*args, out=out)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool_attention_triton(*args, out=out)
    graph.replay()
    assert_attention_matches(out, pool_attention(*args))

    layout = step.layout
    moved = PagedLayout.build(
        layout.block_table, layout.tokens_per_block, rows=layout.rows.cpu().numpy(),
        query_starts=layout.query_starts.cpu().numpy(), query_lens=layout.query_lens.cpu().numpy(),
        starts=(layout.history - 1).clamp(min=0).cpu().numpy(), group_width=4)
    layout.history.copy_(moved.history)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tensor in (step.query, step.staged_k, step.staged_v):
        tensor.copy_(torch.randn(tensor.shape, device="cuda", generator=gen))
    graph.replay()
    assert_attention_matches(out, pool_attention(*args[:5], moved))


@pytest.mark.gpu
@needs_cuda
def test_the_workers_attention_takes_the_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    step = _gpu_step(10, group=4, dim=64, max_query=4, dtype=torch.bfloat16)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[-1])
        return pool_attention_triton(*args, **kwargs)

    monkeypatch.setattr(hook, "pool_attention_triton", counted)
    n = step.layout.num_tokens
    kv = torch.stack([step.pool_k, step.pool_v])[None]
    staging = torch.empty(1, 2, n + 8, *step.staged_k.shape[1:], dtype=step.query.dtype,
                          device="cuda")
    module = torch.nn.Module()
    module.layer_idx = 0
    out, _ = hook.kvalloc_attention(
        module, step.query.transpose(0, 1)[None], step.staged_k[:n].transpose(0, 1)[None],
        step.staged_v[:n].transpose(0, 1)[None], None, scaling=0.125,
        kvalloc_step=hook.PoolStep.of(kv, staging, step.layout))
    assert len(calls) == 1 and calls[0] is step.layout
    want = pool_attention(step.query, step.staged_k, step.staged_v, step.pool_k, step.pool_v,
                          step.layout, scale=0.125)
    assert_attention_matches(out[0], want)


def _gpu_step(seed: int, *, group: int, dim: int, max_query: int, dtype: torch.dtype,
              fp8: bool = False) -> RandomStep:
    return random_step(seed, entries=24, kv_heads=4, group=group, dim=dim, tokens_per_block=16,
                       max_history=700, max_query=max_query, dtype=dtype, device="cuda",
                       fp8=fp8, lead=True)
