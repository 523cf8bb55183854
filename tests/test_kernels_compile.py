"""Every Triton kernel of the project compiles for the GPU it is tuned for (Hopper, sm_90), on a
machine without one.

Each kernel is launched in Triton's interpreter on CPU tensors, as the CPU tests launch it; the
launch's arguments are recorded, and the same specialisation (argument types, constexprs,
warps and stages) is compiled ahead of time to a cubin with Triton's NVIDIA backend. A kernel
the interpreter runs but the compiler rejects (an op the interpreter allows on a type the
compiler does not, a constexpr misuse, a shape that is not a power of two) fails here, in CI,
rather than on its first GPU run. What it cannot see: numerics and speed on a real device, and
a Triton on the GPU machine older than this one's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from kernel_probes import calls_a_plain_function
from kvalloc.allocator.nwor.commit_kernel import write_staged
from kvalloc.allocator.nwor.keep_mask import NEVER, mask_rejected
from kvalloc.worker.attention.latent_attention_triton import LatentLaunch, latent_attention_triton
from kvalloc.worker.attention.pool_attention_triton import LaunchConfig, pool_attention_triton
from kvalloc.worker.attention.rotary import rotate_and_stage
from kvalloc.worker.mlp.gated_mlp import silu_and_mul_triton
from kvalloc.worker.norm.rms_norm import rms_norm_triton
from kvalloc.worker.step.step_metadata import EntryColumns, GroupTable, step_metadata
from pool_steps import random_step

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, CompiledKernel  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# An sm_90 block's most shared memory (227 KiB): a kernel past it fails at launch only.
HOPPER_SHARED_BYTES = 232448
_POINTER = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8",
            torch.bool: "i1",
            torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages")
pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Launch:
    fn: Callable[..., Any]  # the kernel's Python function
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Launch]]:
    """Every interpreted launch from here on, recorded as it runs."""
    seen: list[Launch] = []
    run = InterpretedFunction.run

    def recording(self: InterpretedFunction, *args: Any, grid: Any, warmup: Any,
                  **kwargs: Any) -> Any:
        seen.append(Launch(self.fn, args, dict(kwargs)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    yield seen


def _jit(value: Any) -> Any:
    """A helper passed as a constexpr, as the compiled launch passes it: jit-wrapped."""
    return triton.jit(value.fn) if isinstance(value, InterpretedFunction) else value


def _int_type(value: int) -> str:
    return "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"


def compile_for_hopper(launch: Launch) -> CompiledKernel:
    """The recorded launch's specialisation, compiled."""
    kernel = triton.jit(launch.fn)
    kwargs = {k: v for k, v in launch.kwargs.items() if k not in _OPTIONS}
    if "DOT_F32" in kwargs:  # recorded on the CPU, where the interpreter needs float32 tiles
        kwargs["DOT_F32"] = False
    bound = dict(zip(kernel.arg_names, launch.args, strict=False)) | kwargs
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = _jit(value)
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = _int_type(value)
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise AssertionError(f"{launch.fn.__name__}: {param.name} = {value!r}")
    options = {k: launch.kwargs[k] for k in _OPTIONS if k in launch.kwargs}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=HOPPER, options=options)


def _compiles(launches: list[Launch], *names: str) -> None:
    """Every recorded specialisation compiles within an sm_90 block's shared memory, and the
    kernels ``names`` were among them."""
    assert {launch.fn.__name__ for launch in launches} >= set(names), launches
    for launch in launches:
        compiled = compile_for_hopper(launch)
        assert len(compiled.asm["cubin"]) > 0, launch.fn.__name__
        assert compiled.metadata.shared <= HOPPER_SHARED_BYTES, (launch.fn.__name__,
                                                                 compiled.metadata.shared)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_rms_norm_kernel_compiles(launches: list[Launch], dtype: torch.dtype) -> None:
    rms_norm_triton(torch.randn(3, 2048).to(dtype), torch.ones(2048, dtype=dtype), 1e-6)
    _compiles(launches, "_rms_norm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_silu_and_mul_kernel_compiles(launches: list[Launch], dtype: torch.dtype) -> None:
    silu_and_mul_triton(torch.randn(3, 2 * 1500).to(dtype))
    _compiles(launches, "_silu_and_mul")


@pytest.mark.parametrize(("dtype", "fp8"), [(torch.bfloat16, False), (torch.float16, False),
                                             (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "bf16-fp8-pool"])
@pytest.mark.parametrize("dim", [64, 128])
def test_the_pool_attention_kernels_compile(launches: list[Launch], dtype: torch.dtype,
                                            fp8: bool, dim: int) -> None:
    """Decodes and a prefill chunk longer than the decode launch takes, and a split history
    (the combine kernel), with a window."""
    step = random_step(dim, entries=4, kv_heads=2, group=4, dim=dim, tokens_per_block=16,
                       max_history=40, max_query=70, dtype=dtype, device="cpu", fp8=fp8,
                       query_lens=[1, 4, 70, 0])
    args = (step.query, step.staged_k, step.staged_v, step.pool_k, step.pool_v, step.layout)
    kw = {"scale": 0.1, "k_scale": step.k_scale, "v_scale": step.v_scale}
    pool_attention_triton(*args, **kw, window=None)
    pool_attention_triton(*args, **kw, window=24, launch=LaunchConfig(block_n=16, splits=2))
    _compiles(launches, "_pool_attention", "_combine_splits")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "bf16-fp8-pool"])
@pytest.mark.parametrize("cut", [LatentLaunch(),
                                 LatentLaunch(block_h=16, max_rows=64, value_split=1)],
                         ids=["default", "64-rows-whole-values"])
def test_the_latent_attention_kernels_compile(launches: list[Launch], fp8: bool,
                                              cut: LatentLaunch) -> None:
    """DeepSeek-V3's latent (512 + 64) over 32 heads, cut as by default (128 rows, the value
    columns split over two programs) and as the first cut (64 rows, the values whole):
    decodes and a prefill chunk, whole and with a window over released columns, and a split
    history (the combine kernel)."""
    step = random_step(3, entries=3, kv_heads=1, group=32, dim=576, tokens_per_block=16,
                       max_history=80, max_query=20, dtype=torch.bfloat16, device="cpu",
                       fp8=fp8, query_lens=[1, 4, 20], released=24)
    args = (step.query[..., :512], step.query[..., 512:], step.staged_k, step.pool_k,
            step.layout)
    latent_attention_triton(*args, scale=0.1, kv_scale=step.k_scale, launch=cut)
    latent_attention_triton(*args, scale=0.1, kv_scale=step.k_scale, window=24,
                            launch=replace(cut, splits=2))
    _compiles(launches, "_latent_attention", "_combine_splits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(32, 8, 64), (32, 8, 128)])
def test_the_rotary_and_stage_kernel_compiles(launches: list[Launch], dtype: torch.dtype,
                                              q_heads: int, kv_heads: int, dim: int) -> None:
    n = 5
    query, key, value = (torch.randn(n, h, dim).to(dtype) for h in (q_heads, kv_heads, kv_heads))
    cos, sin = torch.randn(n, dim).to(dtype), torch.randn(n, dim).to(dtype)
    staging = torch.empty(2, n + 3, kv_heads, dim, dtype=dtype)
    rotate_and_stage(query, key, value, cos, sin, staging[0, :n], staging[1, :n])
    _compiles(launches, "_rotate_and_stage")


def test_the_step_metadata_kernel_compiles(launches: list[Launch]) -> None:
    table = torch.tensor([[9, 2, -1], [0, 5, 7]], dtype=torch.int32)
    cols = EntryColumns(*(torch.tensor(a) for a in (
        [0, 1], [0, 3], [3, 3], [1, 0], [1, 0], [0, 0, 0, 1, 1], [0, 70, 71, 80, 81])))
    # Two groups: the first group's launch stores every column, the second its slots alone.
    tables = [GroupTable(table, 4), GroupTable(table[:, :2].contiguous(), 8)]
    step_metadata(cols, torch.tensor([2, 7]), torch.tensor([42, 43]), tables, backend="triton")
    _compiles(launches)
    assert len(launches) == 2


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_the_commit_kernels_compile(launches: list[Launch], pool_dtype: torch.dtype) -> None:
    layers, capacity, row = 2, 8, 32
    pool = torch.zeros(layers, 2, 64, row, dtype=pool_dtype)
    staged = torch.randn(layers, 2, capacity, row).to(torch.bfloat16)
    slots = torch.arange(layers * capacity).view(layers, capacity).contiguous()
    inv = torch.ones(layers, 2) if pool_dtype == torch.float8_e4m3fn else None
    write_staged(pool, staged, slots, torch.tensor([capacity, 3]), capacity, inv,
                 backend="triton")
    tokens = torch.tensor([[0, -1, 0], [0, 0, 1], [0, 1, 2], [1, -1, 0]] + [[0, NEVER, 0]] * 4)
    out = torch.empty_like(slots)
    mask_rejected(tokens, torch.tensor([1, 0]), torch.tensor([2, 0, capacity]), slots, 4, out,
                  (torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                   torch.zeros(4, dtype=torch.int64)), backend="triton")
    _compiles(launches, "_commit_rows", "_mask_rejected")



def test_what_only_the_interpreter_runs_is_refused() -> None:
    """The check itself: a kernel that calls a plain Python function runs in the interpreter
    and is refused by the compiler."""
    x, out = torch.randn(16), torch.empty(16)
    InterpretedFunction(calls_a_plain_function)[(1,)](x, out, BLOCK=16)
    assert torch.equal(out, x * 2)
    with pytest.raises(Exception, match="Unsupported function referenced"):
        compile_for_hopper(Launch(calls_a_plain_function, (x, out), {"BLOCK": 16}))
