"""Float-format ops (static-scale FP8/FP4, MX, NVFP4) against the pure-torch
reference written from the specs, against values computed by hand from the
OCP MX v1.0 and NVFP4 definitions, and against torchao's MX / NVFP4 code.
The comparisons with the reference run on every device in DEVICES (the
reference on the CPU)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pt2e_fq  # noqa: F401
from tests.conftest import DEVICES
from pt2e_fq import reference as ref
from pt2e_fq.ops.blocks import reduced_shape
from pt2e_fq.spec.formats import ELEMENTS
from pt2e_fq.ops import unpack_mask

ELEMENT_NAME = {e.torch_dtype: e.name for e in ELEMENTS.values()}  # the ops take the name
ELEM_DTYPES = list(ELEMENT_NAME)
X_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-42]
FEW = settings(max_examples=40, deadline=None)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (fp32), so signed zeros differ and NaNs compare equal."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def on_cpu(outputs, device):
    """The op's outputs, computed on `device`, on the CPU."""
    assert all(t.device.type == device for t in outputs)
    return tuple(t.cpu() for t in outputs)


def mx_op(x, dtype, block_size=32, axis=-1, device="cpu"):
    y, mask, scales = on_cpu(
        torch.ops.pt2e_fq.fake_quantize_mx(x.to(device), ELEMENT_NAME[dtype], block_size, axis), device
    )
    return y, unpack_mask(mask, x.shape), scales


def nvfp4_op(x, global_scale=None, axis=-1, device="cpu"):
    g = None if global_scale is None else global_scale.to(device)
    y, mask, scales, g = on_cpu(torch.ops.pt2e_fq.fake_quantize_nvfp4(x.to(device), g, axis), device)
    return y, unpack_mask(mask, x.shape), scales, g


def assert_same(ours, expected):
    for a, b in zip(ours, expected):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            assert torch.equal(bits(a), bits(b))


@st.composite
def tensors(draw, max_dims=3, max_size=40):
    shape = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_dims))
    dtype = draw(st.sampled_from(X_DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]))
    g = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        x = torch.randn(shape, generator=g) * magnitude
    else:  # small multiples of a power of two: exact ties under power-of-two scales
        x = torch.randint(-96, 97, shape, generator=g).float() * magnitude / 16
    for _ in range(draw(st.integers(0, 3))):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(SPECIALS))
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@FEW
@given(x=tensors(), dtype=st.sampled_from(ELEM_DTYPES), data=st.data())
def test_static_float_op_equals_reference(x, dtype, data, device):
    block = [data.draw(st.sampled_from([1, s, data.draw(st.integers(1, s))])) for s in x.shape]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    scale = torch.rand(reduced_shape(x.shape, block), generator=g) * 10 ** data.draw(st.integers(-3, 3)) + 1e-6
    y, mask = on_cpu(
        torch.ops.pt2e_fq.fake_quantize_float(x.to(device), block, scale.to(device), ELEMENT_NAME[dtype]), device
    )
    assert_same((y, unpack_mask(mask, x.shape)), ref.fake_quantize_float(x, block, scale, dtype))


@pytest.mark.parametrize("device", DEVICES)
@FEW
@given(x=tensors(), dtype=st.sampled_from(ELEM_DTYPES), block_size=st.sampled_from([1, 3, 16, 32, 33]), data=st.data())
def test_mx_op_equals_reference(x, dtype, block_size, data, device):
    axis = data.draw(st.integers(-x.dim(), x.dim() - 1))
    assert_same(mx_op(x, dtype, block_size, axis, device), ref.fake_quantize_mx(x, dtype, block_size, axis))


@pytest.mark.parametrize("device", DEVICES)
@FEW
@given(x=tensors(), given_scale=st.sampled_from([None, 1.0, 1e-3, 37.5]), data=st.data())
def test_nvfp4_op_equals_reference(x, given_scale, data, device):
    axis = data.draw(st.integers(-x.dim(), x.dim() - 1))
    g = None if given_scale is None else torch.tensor(given_scale)
    assert_same(nvfp4_op(x, g, axis, device), ref.fake_quantize_nvfp4(x, g, axis))


def test_non_contiguous_input_gives_the_contiguous_result():
    x = torch.randn(48, 64).t()
    for op in (lambda t: mx_op(t, torch.float4_e2m1fn_x2, 32, 0), lambda t: nvfp4_op(t, None, 1)):
        assert_same(op(x), op(x.contiguous()))


# ---------------------------------------------------------------------------
# Hand-computed from OCP MX v1.0 section 6.3: X = 2^(floor(log2 amax) - emax).


def one_block(values, block_size=8):
    return torch.tensor(values + [0.0] * (block_size - len(values)))


@pytest.mark.parametrize(
    "dtype, values, scale, expected",
    [
        # amax 1: floor(log2 1) = 0, e4m3 emax 8 -> X = 2^-8; 0.3 * 256 = 76.8
        # lies in [64, 128) where the E4M3 step is 8 -> 80 -> 80 / 256.
        (torch.float8_e4m3fn, [1.0, 0.3], 2.0**-8, [1.0, 0.3125]),
        # amax 1e4: floor(log2) = 13, e5m2 emax 15 -> X = 2^-2; 4e4 lies in
        # [32768, 65536) with step 8192 -> 40960 -> 10240.
        (torch.float8_e5m2, [1e4, -2.0], 0.25, [10240.0, -2.0]),
        # amax 5: floor(log2) = 2, e2m1 emax 2 -> X = 1; 5 is the tie between
        # 4 and 6 -> 4 (even code); 0.25 ties between 0 and 0.5 -> 0.
        (torch.float4_e2m1fn_x2, [5.0, 0.25, -1.75], 1.0, [4.0, 0.0, -2.0]),
        # amax 7.9: X = 1, 7.9 saturates to 6 (mask 0).
        (torch.float4_e2m1fn_x2, [7.9, 3.2], 1.0, [6.0, 3.0]),
        # amax 2^-130: the exponent clamps at E8M0's -127; 2^-130 / 2^-127 =
        # 0.125 rounds to 0.
        (torch.float4_e2m1fn_x2, [2.0**-130], 2.0**-127, [0.0]),
        # an all-zero block: log2(0) = -inf clamps to 2^-127.
        (torch.float8_e4m3fn, [0.0], 2.0**-127, [0.0]),
    ],
)
def test_mx_hand_computed_blocks(dtype, values, scale, expected):
    y, mask, scales = mx_op(one_block(values), dtype, 8)
    assert scales.tolist() == [scale]
    assert y.tolist() == one_block(expected).tolist()
    assert mask[: len(values)].tolist() == [abs(v) / scale <= ref.FLOAT_FORMATS[dtype][0] for v in values]


def test_mx_nan_poisons_only_its_block_and_inf_takes_the_largest_scale():
    x = torch.zeros(3, 4)
    x[0] = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    x[1] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    x[2] = torch.tensor([float("inf"), 1.0, -2.0, 0.5])
    y, mask, scales = mx_op(x, torch.float4_e2m1fn_x2, 4)
    assert torch.isnan(scales[0, 0]) and bool(torch.isnan(y[0]).all()) and not bool(mask[0].any())
    assert scales[1, 0].item() == 1.0 and y[1].tolist() == [1.0, 2.0, 3.0, 4.0] and bool(mask[1].all())
    assert scales[2, 0].item() == 2.0**127
    assert y[2].tolist() == [float("inf"), 0.0, -0.0, 0.0]  # 6 * 2^127 overflows fp32
    assert mask[2].tolist() == [False, True, True, True]


def test_mx_ragged_last_block_along_a_middle_axis():
    x = torch.randn(2, 37, 3)
    y, mask, scales = mx_op(x, torch.float8_e4m3fn, 16, 1)
    assert scales.shape == (2, 3, 3)
    last = x[:, 32:, :].abs().amax(dim=1)  # the third block holds 5 elements
    expected = torch.pow(2.0, torch.floor(torch.log2(last)) - 8)
    assert torch.equal(scales[:, 2, :], expected)


# ---------------------------------------------------------------------------
# NVFP4 by hand: g = amax / 2688, s_b = e4m3(amax_b / 6 / g), scale s_b * g.


def test_nvfp4_block_at_the_tensor_amax_gets_the_full_e4m3_range():
    x = torch.full((16,), 2688.0)
    x[1:] = torch.tensor([1.0, 100.0, 500.0, 1000.0, 2000.0] + [0.0] * 10)
    y, mask, scales, g = nvfp4_op(x)
    assert g.item() == 1.0 and scales.tolist() == [448.0]  # 2688 / 6 / 1 = 448 exactly
    # x / 448 = 6, 1/448 -> 0, 0.223 -> 0, 1.116 -> 1, 2.23 -> 2, 4.46 -> 4
    assert y[:6].tolist() == [2688.0, 0.0, 0.0, 448.0, 896.0, 1792.0]
    assert bool(mask.all())


def test_nvfp4_given_global_scale_and_e4m3_rounding_of_the_block_scale():
    x = torch.zeros(2, 16)
    x[0, 0] = 6.0  # 6 / 6 / 0.5 = 2, an E4M3 value
    x[1, 0] = 6.9  # 6.9 / 6 / 0.5 = 2.3 -> E4M3 2.25 (step 0.25 in [2, 4))
    x[1, 1] = -1.0
    y, mask, scales, g = nvfp4_op(x, torch.tensor(0.5))
    assert g.item() == 0.5 and scales[:, 0].tolist() == [2.0, 2.25]
    # row 1 scale 1.125: 6.9 / 1.125 = 6.13 saturates (mask 0); -1 / 1.125 -> -1
    assert y[0, 0].item() == 6.0
    assert y[1, :2].tolist() == [6 * 1.125, -1.125]
    assert mask[1, :2].tolist() == [False, True]


def test_nvfp4_all_zero_tensor_is_zero_with_full_gradient_mask():
    y, mask, scales, g = nvfp4_op(torch.zeros(4, 32))
    assert g.item() == 1.0 and bool((scales == 0).all())
    assert bool((y == 0).all()) and bool(mask.all())


def test_nvfp4_block_whose_scale_rounds_to_zero_flushes_to_zero():
    x = torch.zeros(2, 16)
    x[0, 0] = 2688.0  # g = 1
    x[1, :3] = torch.tensor([0.005, -0.004, 0.001])  # 0.005 / 6 < 2^-10: s_b = 0
    y, mask, scales, _ = nvfp4_op(x)
    assert scales[1, 0].item() == 0.0
    assert y[1, :3].tolist() == [0.0, -0.0, 0.0] and torch.signbit(y[1, 1])
    assert bool(mask.all())


def test_nvfp4_inf_uses_global_scale_one_and_saturates():
    x = torch.ones(2, 16)
    x[0, 0] = float("inf")
    y, mask, scales, g = nvfp4_op(x)
    assert g.item() == 1.0
    assert scales[0, 0].item() == 448.0 and y[0, 0].item() == 6 * 448.0 and not mask[0, 0]
    assert scales[1, 0].item() == ref.cast_float(torch.tensor(1 / 6), torch.float8_e4m3fn).item()


# ---------------------------------------------------------------------------
# torchao's MX (to_mx / to_dtype) and NVFP4 (nvfp4_quantize) on CPU.

mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao MX needs numpy")
nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="torchao NVFP4 needs numpy")


@pytest.mark.parametrize("dtype", ELEM_DTYPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_mx_matches_torchao(dtype, x_dtype):
    g = torch.Generator().manual_seed(0)
    # Blocks over many binades; torchao's FLOOR mode is OCP's rule.
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64).unsqueeze(1)).to(x_dtype)
    scale_e8m0, data = mx_tensor.to_mx(x, dtype, 32)
    expected = mx_tensor.to_dtype(data, scale_e8m0, dtype, 32, x_dtype)
    y, _, scales = mx_op(x, dtype, 32)
    assert torch.equal(bits(y), bits(expected))
    expected_scales = torch.pow(2.0, scale_e8m0.view(torch.uint8).float() - 127)
    assert torch.equal(scales, expected_scales)


def test_mx_tiny_blocks_differ_from_torchao_which_divides_by_2_pow_minus_126():
    """torchao clamps the fp32 scale it divides by to 2^-126 but dequantizes
    with the E8M0 scale 2^-127, halving such blocks; OCP's X is 2^-127."""
    x = torch.full((1, 32), 2.0**-125)
    scale_e8m0, data = mx_tensor.to_mx(x, torch.float4_e2m1fn_x2, 32)
    torchao_y = mx_tensor.to_dtype(data, scale_e8m0, torch.float4_e2m1fn_x2, 32, torch.float32)
    y, _, scales = mx_op(x, torch.float4_e2m1fn_x2, 32)
    assert scales.item() == 2.0**-127 and bool((y == x).all())  # 2^-125 / 2^-127 = 4 is on the grid
    assert bool((torchao_y == x / 2).all())


def torchao_nvfp4(x, global_scale):
    scales, packed = nvfp4_tensor.nvfp4_quantize(x, 16, global_scale)
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4

    q = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(x.shape[0], -1, 16)
    return (q * (global_scale * scales.float()).unsqueeze(-1)).reshape(x.shape), scales.float()


def test_nvfp4_matches_torchao_where_scales_are_powers_of_two():
    """With power-of-two scales torchao's x * ((1 / g) / s_b) is our x / (s_b * g) exactly."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(32, 64, generator=g) * 2 - 1
    x = x.reshape(32, 4, 16)
    exponents = torch.randint(-5, 6, (32, 4, 1), generator=g).float()
    x = x / x.abs().amax(-1, keepdim=True) * 6 * torch.pow(2.0, exponents)  # block amax = 6 * 2^k
    x = x.reshape(32, 64)
    global_scale = torch.tensor(0.5)
    expected_y, expected_scales = torchao_nvfp4(x, global_scale)
    y, _, scales, _ = nvfp4_op(x, global_scale)
    assert torch.equal(scales, expected_scales.reshape(scales.shape))
    assert torch.equal(bits(y), bits(expected_y))


def test_nvfp4_matches_torchao_on_gaussian_data_with_the_computed_global_scale():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(128, 256, generator=g)
    global_scale = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
    expected_y, expected_scales = torchao_nvfp4(x, global_scale)
    y, _, scales, used = nvfp4_op(x)
    assert used.item() == global_scale.item()
    assert torch.equal(scales, expected_scales.reshape(scales.shape))
    assert torch.equal(bits(y), bits(expected_y))


def test_nvfp4_ties_follow_true_division_where_torchao_multiplies_by_a_reciprocal():
    """s_b = 15 * 2^-9 and x = 1.25 * s_b: x / s_b is the tie 1.25 -> 1 (even
    code), as ONNX QuantizeLinear computes it; torchao's x * fl(1 / s_b)
    lands just above the tie and rounds to 1.5."""
    s_b = 15 * 2.0**-9
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6 * s_b, 1.25 * s_b  # amax_b / 6 / g = s_b exactly with g = 1
    y, _, scales, _ = nvfp4_op(x, torch.tensor(1.0))
    torchao_y, _ = torchao_nvfp4(x, torch.tensor(1.0))
    assert scales.item() == s_b
    assert y[0, 1].item() == 1.0 * s_b
    assert torchao_y[0, 1].item() == 1.5 * s_b
