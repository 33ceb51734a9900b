"""The element casts of the float-format op against independent references:
torch's own FP8 casts over every finite value and every midpoint, and the
E2M1 grid by hand and from torchao's FP4 cast.

The static-scale op with scale 1 is y = cast_rne(clamp(x, -fmax, fmax)), so
it exposes the cast directly."""

import pytest
import torch

import pt2e_fq  # noqa: F401
from pt2e_fq.ops import fake_quantize_float_with_mask, unpack_mask

FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
E2M1 = torch.float4_e2m1fn_x2


def cast(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    y, mask = fake_quantize_float_with_mask(v, v.shape, torch.tensor(1.0), dtype)
    return y, unpack_mask(mask, v.shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns, so -0.0 != 0.0 and NaNs compare equal."""
    return t.float().view(torch.int32)


def finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an FP8 format, sorted, -0 included."""
    v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return v[torch.isfinite(v)].sort().values


@pytest.mark.parametrize("dtype", list(FP8))
def test_every_fp8_value_is_exact(dtype):
    v = finite_values(dtype)
    y, mask = cast(v, dtype)
    assert torch.equal(bits(y), bits(v))
    assert bool(mask.all())


@pytest.mark.parametrize("dtype", list(FP8))
def test_fp8_midpoints_and_their_neighbours_round_as_torch_casts(dtype):
    v = finite_values(dtype).double().unique()  # -0 and 0 merge
    mid = ((v[1:] + v[:-1]) / 2).float()  # exact in fp32: FP8 has <= 4 significant bits
    assert torch.equal(mid.double(), (v[1:] + v[:-1]) / 2)
    below = torch.nextafter(mid, torch.tensor(-float("inf")))
    above = torch.nextafter(mid, torch.tensor(float("inf")))
    x = torch.cat([mid, below, above])
    y, mask = cast(x, dtype)
    assert torch.equal(bits(y), bits(x.to(dtype).float()))
    assert bool(mask.all())


@pytest.mark.parametrize("dtype", list(FP8))
def test_fp8_tiny_values_and_fp32_subnormals_flush_with_sign(dtype):
    tiny = torch.tensor([1e-45, 1e-40, 1e-30, 2.0**-30], dtype=torch.float32)
    x = torch.cat([tiny, -tiny])
    y, _ = cast(x, dtype)
    assert torch.equal(bits(y), bits(x.to(dtype).float()))
    assert torch.equal(torch.signbit(y), torch.signbit(x))


@pytest.mark.parametrize("dtype", list(FP8) + [E2M1])
def test_saturation_nan_and_inf(dtype):
    fmax = FP8.get(dtype, 6.0)
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([fmax, fmax * 1.01, fmax * 4, 3e38, inf, -fmax * 1.01, -inf, nan, -fmax])
    y, mask = cast(x, dtype)
    assert y[:6].tolist() == [fmax, fmax, fmax, fmax, fmax, -fmax]
    assert y[6].item() == -fmax and torch.isnan(y[7]) and y[8].item() == -fmax
    assert mask.tolist() == [True, False, False, False, False, False, False, False, True]


# E2M1 by hand: the eight magnitudes, and each tie between neighbours goes to
# the neighbour whose code is even (0.25->0, 0.75->1, 1.25->1, 1.75->2,
# 2.5->2, 3.5->4, 5->4).
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def test_every_e2m1_value_is_exact():
    x = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES])
    y, mask = cast(x, E2M1)
    assert torch.equal(bits(y), bits(x))
    assert bool(mask.all())


def test_e2m1_ties_go_to_the_even_code():
    x = torch.tensor(list(E2M1_TIES))
    y, _ = cast(torch.cat([x, -x]), E2M1)
    expected = torch.tensor(list(E2M1_TIES.values()))
    assert torch.equal(bits(y), bits(torch.cat([expected, -expected])))


def test_e2m1_just_off_the_ties_goes_to_the_nearer_value():
    ties = torch.tensor(list(E2M1_TIES))
    below = torch.nextafter(ties, torch.tensor(0.0))
    above = torch.nextafter(ties, torch.tensor(10.0))
    grid = torch.tensor(E2M1_VALUES)
    lower = grid[torch.searchsorted(grid, ties) - 1]
    upper = grid[torch.searchsorted(grid, ties)]
    assert torch.equal(cast(below, E2M1)[0], lower)
    assert torch.equal(cast(above, E2M1)[0], upper)


def test_e2m1_matches_torchao_fp4_cast_on_a_dense_sweep():
    kernels = pytest.importorskip(
        "torchao.prototype.mx_formats.kernels", reason="torchao's MX kernels need numpy"
    )
    x = torch.linspace(-6.0, 6.0, 200_001)
    ties = torch.tensor(list(E2M1_TIES))
    x = torch.cat([x, ties, -ties])
    expected = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked(x))
    y, _ = cast(x, E2M1)
    assert torch.equal(bits(y), bits(expected))


@pytest.mark.parametrize("dtype", list(FP8) + [E2M1])
def test_bf16_and_fp16_inputs_round_the_same_and_keep_their_dtype(dtype):
    x32 = torch.randn(4096) * {torch.float8_e4m3fn: 100, torch.float8_e5m2: 1e4}.get(dtype, 3.0)
    for low in (torch.bfloat16, torch.float16):
        x = x32.to(low)
        y, _ = cast(x, dtype)
        assert y.dtype == low
        y_from_fp32, _ = cast(x.float(), dtype)
        assert torch.equal(bits(y), bits(y_from_fp32.to(low)))
