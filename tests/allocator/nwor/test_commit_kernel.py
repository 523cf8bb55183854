"""`write_staged`: exactly the selected rows land at their slots, nothing else changes, and the
fused Triton kernel (run here in Triton's interpreter) equals the torch path bit for bit."""

from __future__ import annotations

import pytest
import torch
from kvalloc.allocator.errors import NworInputError, SlotDtypeError
from kvalloc.allocator.nwor.commit_kernel import quantise_fp8, resolve_backend, write_staged
from triton_interpreter import needs_triton_interpreter

FP8 = torch.float8_e4m3fn
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
NAN_BITS = {FP8: 0x7F, torch.bfloat16: 0x7FC1, torch.float16: 0x7E01, torch.float32: 0x7FC00001}



def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def _case(pool_dtype: torch.dtype, stage_dtype: torch.dtype, seed: int, *, layers: int = 3,
          num_slots: int = 96, capacity: int = 40, row: int = 48, planes: int = 2):
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(layers, planes, capacity, row, generator=gen) * 8 - 5)
    staged = (torch.randn(layers, planes, capacity, row, generator=gen) * magnitude).to(
        stage_dtype)
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:capacity]
                         for _ in range(layers)])
    slots[torch.rand(layers, capacity, generator=gen) < 0.2] = -1
    slots[0, 3] = num_slots + 5  # out of range: skipped, never written out of bounds
    layer_rows = torch.tensor([capacity, capacity // 2, 0][:layers])
    inv = None
    if pool_dtype == FP8:
        inv = (1.0 / (torch.rand(layers, planes, generator=gen) * 4 + 0.05)).float()
    pool = torch.empty(layers, planes, num_slots, row, dtype=pool_dtype)
    _bits(pool).fill_(NAN_BITS[pool_dtype])  # NaN: no write produces it
    return pool, staged, slots, layer_rows, inv


def _expected(pool, staged, slots, layer_rows, num_rows, inv):
    out = pool.clone()
    num_slots = pool.shape[2]
    for layer in range(pool.shape[0]):
        for t in range(min(num_rows, int(layer_rows[layer]))):
            s = int(slots[layer, t])
            if not 0 <= s < num_slots:
                continue
            for kv in range(pool.shape[1]):
                src = staged[layer, kv, t]
                if inv is not None:
                    src = (src.float() * inv[layer, kv]).clamp(-448, 448).to(FP8)
                _bits(out)[layer, kv, s] = _bits(src)
    return out


CASES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (FP8, torch.bfloat16),
    (FP8, torch.float16),
    (FP8, torch.float32),
]


@pytest.mark.parametrize(("pool_dtype", "stage_dtype"), CASES)
def test_torch_path_writes_exactly_the_selected_rows(pool_dtype, stage_dtype):
    pool, staged, slots, layer_rows, inv = _case(pool_dtype, stage_dtype, seed=1)
    want = _expected(pool, staged, slots, layer_rows, 33, inv)
    write_staged(pool, staged, slots, layer_rows, 33, inv, backend="torch")
    assert torch.equal(_bits(pool), _bits(want))


@needs_triton_interpreter
@pytest.mark.parametrize(("pool_dtype", "stage_dtype"), CASES)
@pytest.mark.parametrize("seed", [2, 3])
def test_triton_kernel_equals_torch_path_bit_for_bit(pool_dtype, stage_dtype, seed):
    pool, staged, slots, layer_rows, inv = _case(pool_dtype, stage_dtype, seed)
    ref = pool.clone()
    write_staged(ref, staged, slots, layer_rows, 37, inv, backend="torch")
    write_staged(pool, staged, slots, layer_rows, 37, inv, backend="triton")
    assert torch.equal(_bits(pool), _bits(ref))
    assert (_bits(pool) != NAN_BITS[pool_dtype]).any()


# An MLA latent pool: one plane per layer, a 576-wide row (512 compressed KV + 64 rope key), one
# fp8 scale per layer.
LATENT_CASES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (FP8, torch.bfloat16),
    (FP8, torch.float32),
]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton",
                                                             marks=needs_triton_interpreter)])
@pytest.mark.parametrize(("pool_dtype", "stage_dtype"), LATENT_CASES)
def test_a_latent_pool_gets_exactly_the_selected_rows(pool_dtype, stage_dtype, backend):
    pool, staged, slots, layer_rows, inv = _case(pool_dtype, stage_dtype, seed=11, row=576,
                                                 planes=1)
    want = _expected(pool, staged, slots, layer_rows, 33, inv)
    write_staged(pool, staged, slots, layer_rows, 33, inv, backend=backend)
    assert torch.equal(_bits(pool), _bits(want))
    assert (_bits(pool) != NAN_BITS[pool_dtype]).any()


def test_latent_pool_takes_one_scale_per_layer_and_one_staged_plane():
    pool, staged, slots, layer_rows, inv = _case(FP8, torch.bfloat16, seed=13, planes=1)
    with pytest.raises(NworInputError) as err:
        write_staged(pool, staged, slots, layer_rows, 8, inv.repeat(1, 2), backend="torch")
    assert err.value.field == "inv_scales"
    with pytest.raises(NworInputError) as err:
        write_staged(pool, staged.repeat(1, 2, 1, 1), slots, layer_rows, 8, inv, backend="torch")
    assert err.value.field == "staged"


@needs_triton_interpreter
def test_triton_fp8_rounding_matches_torch_on_every_code_and_midpoint():
    """All e4m3 values, the midpoints between neighbours (ties round to even) and one ulp either
    side, saturation past 448 and subnormals: the kernel's integer rounding equals torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    codes = codes[~codes.isnan()].sort().values
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    values = torch.cat([codes, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                        torch.tensor([460.0, -500.0, 1e6, 2.0**-10, -(2.0**-10), 0.0, -0.0])])
    row = values.numel()
    staged = values.reshape(1, 1, 1, row).expand(1, 2, 1, row).contiguous()
    slots = torch.zeros(1, 1, dtype=torch.int64)
    layer_rows = torch.ones(1, dtype=torch.int64)
    inv = torch.ones(1, 2)
    ref = torch.zeros(1, 2, 1, row, dtype=FP8)
    out = ref.clone()
    write_staged(ref, staged, slots, layer_rows, 1, inv, backend="torch")
    write_staged(out, staged, slots, layer_rows, 1, inv, backend="triton")
    assert torch.equal(_bits(out), _bits(ref))
    assert torch.equal(_bits(ref[0, 0, 0]), _bits(values.clamp(-448, 448).to(FP8)))


def test_fp8_quantisation_saturates_and_uses_the_reciprocal_scale():
    values = torch.tensor([1.0, 1000.0, -1000.0, 3.0])
    inv = torch.tensor([0.5, 1.0, 1.0, 2.0])
    got = quantise_fp8(values[:, None], inv).float().flatten()
    assert got.tolist() == [0.5, 448.0, -448.0, 6.0]


def test_zero_rows_write_nothing():
    pool, staged, slots, layer_rows, _ = _case(torch.bfloat16, torch.bfloat16, seed=4)
    before = pool.clone()
    write_staged(pool, staged, slots, layer_rows, 0, backend="torch")
    assert torch.equal(_bits(pool), _bits(before))


def test_int32_slots_are_a_typed_error():
    pool, staged, slots, layer_rows, _ = _case(torch.bfloat16, torch.bfloat16, seed=5)
    with pytest.raises(SlotDtypeError) as err:
        write_staged(pool, staged, slots.to(torch.int32), layer_rows, 8, backend="torch")
    assert err.value.field == "slot_mapping"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda a: {**a, "staged": a["staged"].to(torch.float16)}, "staged"),
        (lambda a: {**a, "staged": a["staged"][:, :, :, :8].contiguous()}, "staged"),
        (lambda a: {**a, "layer_rows": a["layer_rows"][:2]}, "layer_rows"),
        (lambda a: {**a, "layer_rows": a["layer_rows"].to(torch.int32)}, "layer_rows"),
        (lambda a: {**a, "num_rows": 41}, "num_rows"),
        (lambda a: {**a, "slots": a["slots"][:2]}, "slots"),
        (lambda a: {**a, "inv_scales": torch.ones(3, 2)}, "inv_scales"),
    ],
)
def test_bad_arguments_name_the_field_and_write_nothing(mutate, field):
    pool, staged, slots, layer_rows, _ = _case(torch.bfloat16, torch.bfloat16, seed=6)
    before = pool.clone()
    args = mutate({"staged": staged, "slots": slots, "layer_rows": layer_rows, "num_rows": 8,
                   "inv_scales": None})
    with pytest.raises(NworInputError) as err:
        write_staged(pool, args["staged"], args["slots"], args["layer_rows"], args["num_rows"],
                     args["inv_scales"], backend="torch")
    assert err.value.field == field
    assert torch.equal(_bits(pool), _bits(before))


def test_fp8_pool_needs_scales():
    pool, staged, slots, layer_rows, _ = _case(FP8, torch.bfloat16, seed=7)
    with pytest.raises(NworInputError) as err:
        write_staged(pool, staged, slots, layer_rows, 8, None, backend="torch")
    assert err.value.field == "inv_scales"


def test_auto_backend_is_torch_on_cpu_and_unknown_backend_is_rejected():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(NworInputError) as err:
        resolve_backend("cuda-magic", torch.device("cpu"))  # type: ignore[arg-type]
    assert err.value.field == "backend"
