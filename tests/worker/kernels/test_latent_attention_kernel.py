"""The MLA attention kernel (`worker.attention.latent_attention_triton`) against its reference
(`worker.attention.latent_attention.latent_attention`) on random steps in a latent pool's
shape (`pool_steps` with one KV head of width R + P): ragged histories crossing blocks, empty
entries, rows whose history runs past their blocks, device-only leads, an entry on the spare
row, and NaN in every pool slot and staging row the step does not own. CPU cases run the kernel
in Triton's interpreter on small shapes, GPU cases compiled at DeepSeek-V3's latent (512 + 64).

Tolerances as the GQA kernel's test has them (`test_pool_attention_kernel`): float32 1e-5,
bf16 2e-2 (the kernel rounds its probabilities to bf16 before the value product), fp8 pools
the tolerance of the query's dtype (neither form rounds the dequantised values).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kvalloc.worker.attention.latent_attention import latent_attention
from kvalloc.worker.attention.latent_attention_triton import (
    LATENT_CANDIDATES,
    LatentLaunch,
    latent_attention_triton,
    sized_for,
)
from kvalloc.worker.errors import PoolAttentionInputError
from pool_steps import RandomStep, assert_attention_matches, random_step
from triton_interpreter import needs_triton_interpreter_with_loaded_bounds as needs_interpreter

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _latent_step(seed: int, *, heads: int, rank: int, rope: int, dtype: torch.dtype,
                 device: str, fp8: bool = False, **shape: object) -> RandomStep:
    return random_step(seed, kv_heads=1, group=heads, dim=rank + rope, dtype=dtype,
                       device=device, fp8=fp8, lead=True, **shape)


def _both(step: RandomStep, rank: int, launch: LatentLaunch | None = None,
          window: int | None = None, *, scale: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    q_latent, q_rope = step.query[..., :rank], step.query[..., rank:]
    args = (q_latent, q_rope, step.staged_k, step.pool_k, step.layout)
    kw = {"scale": scale, "window": window, "kv_scale": step.k_scale}
    out = torch.full_like(q_latent, float("nan"))
    got = latent_attention_triton(*args, **kw, out=out, launch=launch)
    assert got is out
    return got, latent_attention(*args, **kw)


CPU_CASES = [  # (dtype, fp8 pool, heads, splits, max query, tokens per block)
    (torch.float32, False, 8, 1, 4, 4), (torch.float32, False, 6, 2, 4, 5),
    (torch.float32, False, 4, 4, 1, 4), (torch.bfloat16, False, 8, 1, 4, 4),
    (torch.bfloat16, True, 8, 2, 4, 4), (torch.float32, False, 8, 1, 11, 4),
]


@needs_interpreter
@pytest.mark.parametrize(("value_split", "lazy"), [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize(("dtype", "fp8", "heads", "splits", "max_query", "tokens_per_block"),
                         CPU_CASES)
def test_kernel_equals_reference_in_the_interpreter(dtype: torch.dtype, fp8: bool, heads: int,
                                                    splits: int, max_query: int,
                                                    tokens_per_block: int, value_split: int,
                                                    lazy: bool) -> None:
    """Latent 32 + rope 16, its value columns in one program or two, rescaled every tile or
    lazily; 4 heads a program, so 6 heads take blocks of 2; 11-token entries (a prefill chunk)
    take several query tiles of 16 rows; 5-token blocks put block edges inside a 16-token
    step."""
    step = _latent_step(heads * 7 + splits + fp8, heads=heads, rank=32, rope=16, dtype=dtype,
                        device="cpu", fp8=fp8, entries=5, tokens_per_block=tokens_per_block,
                        max_history=40, max_query=max_query)
    launch = LatentLaunch(block_h=4, max_rows=16, block_n=16, splits=splits,
                          value_split=value_split, lazy_rescale=lazy)
    assert_attention_matches(*_both(step, 32, launch))


@needs_interpreter
@pytest.mark.parametrize(("dtype", "fp8", "window", "splits", "max_query"), [
    (torch.float32, False, 5, 1, 4), (torch.float32, False, 9, 4, 4),
    (torch.float32, False, 7, 1, 11), (torch.bfloat16, True, 6, 2, 4)])
def test_a_window_over_released_columns_equals_the_reference(
        dtype: torch.dtype, fp8: bool, window: int, splits: int, max_query: int) -> None:
    """A windowed latent layer (DeepSeek-V4's cache slides): each row's columns behind its
    window hold RELEASED (-2) and NaN blocks, which neither form reads; decodes, a prefill
    chunk's query tiles and split histories."""
    step = _latent_step(window * 5 + splits, heads=8, rank=32, rope=16, dtype=dtype,
                        device="cpu", fp8=fp8, entries=5, tokens_per_block=4, max_history=50,
                        max_query=max_query, released=window)
    assert (step.layout.block_table == -2).any()
    launch = LatentLaunch(block_h=4, max_rows=16, block_n=16, splits=splits)
    assert_attention_matches(*_both(step, 32, launch, window))


@needs_interpreter
@pytest.mark.parametrize("rank", [40, 33])
def test_a_latent_of_any_width_splits_its_values_or_keeps_them_whole(rank: int) -> None:
    """A value split of a latent whose halves are no power of two (2 x 20 columns in blocks of
    32) and of an odd one, which one program keeps whole."""
    step = _latent_step(rank, heads=8, rank=rank, rope=16, dtype=torch.float32, device="cpu",
                        entries=4, tokens_per_block=4, max_history=40, max_query=4)
    launch = LatentLaunch(block_h=4, max_rows=16, block_n=16, splits=2, value_split=2)
    assert_attention_matches(*_both(step, rank, launch))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_lazy_rescale_equals_the_reference_where_the_max_grows(dtype: torch.dtype) -> None:
    """Scores 400 times the other tests' spread, so a row's base-2 max grows by hundreds in
    later tiles as well as the first: past the slack of 8 a lazy update must rescale (its
    probabilities would overflow float32 past 128), and what it does is as exact as every
    tile's rescale."""
    step = _latent_step(5, heads=8, rank=32, rope=16, dtype=dtype, device="cpu", entries=5,
                        tokens_per_block=4, max_history=120, max_query=4)
    launch = LatentLaunch(block_h=4, max_rows=16, block_n=16, lazy_rescale=True)
    assert_attention_matches(*_both(step, 32, launch, scale=20.0))


@needs_interpreter
@pytest.mark.parametrize("launch", LATENT_CANDIDATES, ids=repr)
@pytest.mark.parametrize(("dtype", "fp8", "splits"), [(torch.float32, False, 1),
                                                      (torch.bfloat16, True, 2)])
def test_every_candidate_cut_equals_the_reference(launch: LatentLaunch, dtype: torch.dtype,
                                                  fp8: bool, splits: int) -> None:
    """The cuts bench_mla.py sweeps, on 16 heads (their head blocks cut to 16) and a latent of
    32 + 16: decodes and an 11-token prefill chunk over 5-token blocks, whole or split."""
    step = _latent_step(11 + fp8, heads=16, rank=32, rope=16, dtype=dtype, device="cpu",
                        fp8=fp8, entries=4, tokens_per_block=5, max_history=40, max_query=11)
    assert_attention_matches(*_both(step, 32, replace(launch, splits=splits)))


@needs_interpreter
def test_the_default_cut_equals_the_reference() -> None:
    step = _latent_step(3, heads=16, rank=32, rope=16, dtype=torch.float32, device="cpu",
                        entries=3, tokens_per_block=4, max_history=30, max_query=4)
    assert_attention_matches(*_both(step, 32))


@pytest.mark.parametrize("launch", LATENT_CANDIDATES, ids=repr)
def test_float32_queries_on_a_gpu_take_tiles_of_the_same_bytes(launch: LatentLaunch) -> None:
    """A cut is stated for 2-byte queries; float32 ones on a GPU get half its rows and latents
    a step (the same shared memory), bf16 ones and every interpreter launch the cut as given."""
    cuda = torch.device("cuda")
    assert sized_for(launch, torch.bfloat16, cuda) == launch
    assert sized_for(launch, torch.float32, torch.device("cpu")) == launch
    fp32 = sized_for(launch, torch.float32, cuda)
    assert fp32.max_rows * fp32.block_n * 4 <= launch.max_rows * launch.block_n * 2
    assert fp32.max_rows == launch.max_rows // 2 and fp32.block_h <= fp32.max_rows
    assert (fp32.max_rows // fp32.block_h) == (launch.max_rows // launch.block_h)  # queries


def test_bad_input_is_a_typed_error_naming_it_and_writes_nothing() -> None:
    step = _latent_step(2, heads=4, rank=32, rope=16, dtype=torch.float32, device="cpu",
                        entries=3, tokens_per_block=4, max_history=8, max_query=3)
    q_latent, q_rope = step.query[..., :32], step.query[..., 32:]
    out = torch.full_like(q_latent, float("nan"))
    layout, pool, staged = step.layout, step.pool_k, step.staged_k
    cases = [
        ((q_latent, q_rope[..., :8], staged, pool, layout), {}, "pool"),
        ((q_latent, q_rope[:, :2], staged, pool, layout), {}, "q_rope"),
        ((q_latent, q_rope, staged[..., :40], pool, layout), {}, "staged"),
        ((q_latent, q_rope, staged, pool.to(torch.float8_e4m3fn), layout), {}, "k_scale"),
        ((q_latent, q_rope, staged, pool, layout), {"out": out.half()}, "out"),
        ((q_latent, q_rope.double(), staged, pool, layout), {}, "q_rope"),
        ((q_latent, q_rope, staged, pool, layout), {"window": 0}, "window"),
    ]
    for args, kwargs, field in cases:
        with pytest.raises(PoolAttentionInputError, match=rf"^{field}:"):
            latent_attention_triton(*args, scale=0.1, **{"out": out, **kwargs})
    for bad in ({"block_n": 48}, {"value_split": 4}, {"lazy_rescale": 1}):
        with pytest.raises(PoolAttentionInputError, match=r"^launch:"):
            LatentLaunch(**bad)
    assert out.isnan().all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("dtype", "fp8", "max_query", "splits"), [
    (torch.bfloat16, False, 4, None), (torch.bfloat16, True, 4, None),
    (torch.float32, False, 4, 4), (torch.bfloat16, False, 70, None)])
def test_kernel_equals_reference_on_the_gpu(dtype: torch.dtype, fp8: bool, max_query: int,
                                            splits: int | None) -> None:
    """DeepSeek-V3's per-layer shape (128 heads, latent 512 + rope 64) over 16-token blocks."""
    step = _latent_step(9, heads=128, rank=512, rope=64, dtype=dtype, device="cuda", fp8=fp8,
                        entries=6, tokens_per_block=16, max_history=700, max_query=max_query)
    assert_attention_matches(*_both(step, 512, LatentLaunch(splits=splits)))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("max_query", "splits"), [(4, None), (70, None), (4, 4)])
def test_a_window_over_released_columns_on_the_gpu(max_query: int, splits: int | None) -> None:
    """DeepSeek-V3's per-layer shape with a window of 256 over RELEASED columns, compiled."""
    step = _latent_step(11, heads=128, rank=512, rope=64, dtype=torch.bfloat16, device="cuda",
                        entries=6, tokens_per_block=16, max_history=700, max_query=max_query,
                        released=256)
    assert_attention_matches(*_both(step, 512, LatentLaunch(splits=splits), 256))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("launch", LATENT_CANDIDATES, ids=repr)
def test_every_candidate_cut_equals_the_reference_on_the_gpu(launch: LatentLaunch) -> None:
    """The cuts bench_mla.py sweeps, compiled at DeepSeek-V3's shape (bf16, a 16-token block
    pool), a prefill chunk among the decodes."""
    step = _latent_step(10, heads=128, rank=512, rope=64, dtype=torch.bfloat16, device="cuda",
                        entries=6, tokens_per_block=16, max_history=700, max_query=11)
    assert_attention_matches(*_both(step, 512, launch))
