"""Bad arguments raise a clear error that names the argument, both through the
Python entry point and through the raw torch.ops call (whose C++ checks keep
it memory-safe)."""

import pytest
import torch

from pt2e_fq import ops

X = torch.randn(4, 6)
BLOCK = [1, 6]  # per-channel on axis 0: qparams of shape (4, 1)
SCALE = torch.full((4, 1), 0.1)
ZP = torch.zeros(4, 1, dtype=torch.int32)
NAN = float("nan")


def call(x=X, block_size=BLOCK, scale=SCALE, zero_point=ZP, quant_min=-8, quant_max=7, minval=None):
    return dict(x=x, block_size=block_size, scale=scale, zero_point=zero_point,
                quant_min=quant_min, quant_max=quant_max, minval=minval)


# (id, the argument's name as the message gives it, arguments, exception type,
#  text the Python entry point's message must contain)
BAD = [
    ("scale_zero", "scale", call(scale=torch.zeros(4, 1)), ValueError, "scale must be finite and > 0"),
    ("scale_negative", "scale", call(scale=-SCALE), ValueError, "scale must be finite and > 0"),
    ("scale_nan", "scale", call(scale=torch.full((4, 1), NAN)), ValueError, "scale must be finite and > 0"),
    (
        "scale_inf", "scale", call(scale=torch.full((4, 1), float("inf"))),
        ValueError, "scale must be finite and > 0",
    ),
    (
        "scale_underflows_fp32", "scale", call(scale=torch.full((4, 1), 1e-60, dtype=torch.float64)),
        ValueError, "scale must be finite and > 0",
    ),
    ("scale_shape", "scale", call(scale=torch.full((3, 1), 0.1)), ValueError, "scale must have"),
    (
        "scale_integer", "scale", call(scale=torch.ones(4, 1, dtype=torch.int32)),
        TypeError, "scale must be a floating",
    ),
    ("scale_not_tensor", "scale", call(scale=0.1), TypeError, "scale must be a torch.Tensor"),
    (
        "zero_point_shape", "zero_point", call(zero_point=torch.zeros(4, 2, dtype=torch.int32)),
        ValueError, "zero_point must have",
    ),
    (
        "zero_point_float", "zero_point", call(zero_point=ZP.float()),
        TypeError, "zero_point must have an integer dtype",
    ),
    (
        "zero_point_above_range", "zero_point", call(zero_point=ZP + 8),
        ValueError, "zero_point must lie in [quant_min, quant_max]",
    ),
    (
        "zero_point_below_range", "zero_point", call(zero_point=ZP - 9),
        ValueError, "zero_point must lie in [quant_min, quant_max]",
    ),
    (
        "zero_point_and_minval", "minval", call(minval=torch.zeros(4, 1)),
        ValueError, "zero_point (ZP formulation) or minval",
    ),
    (
        "minval_nan", "minval", call(zero_point=None, minval=torch.full((4, 1), NAN)),
        ValueError, "minval must be finite",
    ),
    (
        "minval_shape", "minval", call(zero_point=None, minval=torch.zeros(2, 1)),
        ValueError, "minval must have",
    ),
    (
        "block_size_too_short", "block_size", call(block_size=[6]),
        ValueError, "block_size needs one entry per dimension",
    ),
    (
        "block_size_too_long", "block_size", call(block_size=[1, 6, 1]),
        ValueError, "block_size needs one entry per dimension",
    ),
    ("block_size_zero", "block_size[0]", call(block_size=[0, 6]), ValueError, "block_size[0] must be >= 1"),
    (
        "block_size_negative", "block_size[1]", call(block_size=[1, -6]),
        ValueError, "block_size[1] must be >= 1",
    ),
    (
        "quant_min_above_quant_max", "quant_min", call(quant_min=7, quant_max=-8),
        ValueError, "quant_min <= quant_max",
    ),
    (
        "quant_max_above_int16", "quant_max", call(quant_min=0, quant_max=2**15),
        ValueError, "quant_max <= 32767",
    ),
    (
        "quant_min_below_int16", "quant_min", call(quant_min=-(2**15) - 1, quant_max=0),
        ValueError, "-32768 <= quant_min",
    ),
    ("x_integer", "x must", call(x=X.to(torch.int32)), TypeError, "x must be float32, bfloat16 or float16"),
    ("x_float64", "x must", call(x=X.double()), TypeError, "x must be float32, bfloat16 or float16"),
    (
        "scale_on_other_device", "scale is on meta", call(scale=SCALE.to("meta")),
        ValueError, "scale is on meta but x is on cpu",
    ),
    (
        "zero_point_on_other_device", "zero_point is on meta", call(zero_point=ZP.to("meta")),
        ValueError, "zero_point is on meta but x is on cpu",
    ),
    # The raw op checks shapes, not only element counts,
    # and dtypes, as the Python entry point does. Blocks of 2x2: (2, 3) scales.
    (
        "scale_transposed", "scale",
        call(block_size=[2, 2], scale=torch.full((3, 2), 0.1), zero_point=torch.zeros(2, 3, dtype=torch.int32)),
        ValueError, "scale must have shape (2, 3)",
    ),
    (
        "zero_point_transposed", "zero_point",
        call(block_size=[2, 2], scale=torch.full((2, 3), 0.1), zero_point=torch.zeros(3, 2, dtype=torch.int32)),
        ValueError, "zero_point must have shape (2, 3)",
    ),
    ("scale_bool", "scale", call(scale=torch.ones(4, 1, dtype=torch.bool)), TypeError, "scale must be a floating"),
    (
        "scale_complex", "scale", call(scale=torch.ones(4, 1, dtype=torch.complex64)),
        TypeError, "scale must be a floating",
    ),
    (
        "minval_integer", "minval", call(zero_point=None, minval=torch.zeros(4, 1, dtype=torch.int32)),
        TypeError, "minval must be a floating",
    ),
    (
        "minval_complex", "minval", call(zero_point=None, minval=torch.zeros(4, 1, dtype=torch.complex64)),
        TypeError, "minval must be a floating",
    ),
    (
        "zero_point_bool", "zero_point", call(zero_point=torch.zeros(4, 1, dtype=torch.bool)),
        TypeError, "zero_point must have an integer dtype",
    ),
    # Item 18: the exact out-of-range zero point (2**24 + 1 has no fp32 value).
    (
        "zero_point_not_rounded", "zero_point",
        call(quant_min=-(2**15), quant_max=2**15 - 1, zero_point=torch.full((4, 1), 2**24 + 1, dtype=torch.int32)),
        ValueError, "= 16777217",
    ),
    # Item 18: block_size itself and entries beyond int64 are named.
    ("block_size_none", "block_size", call(block_size=None), TypeError, "block_size must be a sequence of ints"),
    (
        "block_size_beyond_int64", "block_size[0]", call(block_size=[2**63, 6]),
        ValueError, "block_size[0] must be at most 2**63 - 1",
    ),
]

# What only the Python entry point checks: the raw op's schema rejects a
# non-tensor scale, a None block_size and ints beyond int64 by itself.
PYTHON_ONLY = {"scale_not_tensor", "block_size_none", "block_size_beyond_int64"}


@pytest.mark.parametrize("name,kwargs,exc,text", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_python_entry_point_names_the_argument(name, kwargs, exc, text):
    kwargs = dict(kwargs)
    minval = kwargs.pop("minval")
    with pytest.raises(exc) as info:
        ops.fake_quantize_affine(**kwargs, minval=minval)
    assert name in str(info.value) and text in str(info.value)


@pytest.mark.parametrize(
    "name,kwargs,exc", [pytest.param(*b[1:4], id=b[0]) for b in BAD if b[0] not in PYTHON_ONLY]
)
def test_raw_op_names_the_argument(name, kwargs, exc):
    with pytest.raises(exc) as info:
        torch.ops.pt2e_fq.fake_quantize_affine(*kwargs.values())
    assert name in str(info.value)


def test_non_int_quant_range():
    with pytest.raises(TypeError, match="quant_min must be an int"):
        ops.fake_quantize_affine(X, BLOCK, SCALE, ZP, True, 7)
    with pytest.raises(TypeError, match="quant_max must be an int"):
        ops.fake_quantize_affine(X, BLOCK, SCALE, ZP, -8, 7.0)


@pytest.mark.parametrize(
    "grad,mask,exc,text",
    [
        (torch.randn(16), torch.zeros(1).byte(), ValueError, "mask must have ceil(grad.numel() / 8)"),
        (torch.randn(16), torch.zeros(2).char(), TypeError, "mask must be uint8"),
        (torch.ones(16).int(), torch.zeros(2).byte(), TypeError, "grad must be float"),
    ],
    ids=["mask_size", "mask_dtype", "grad_dtype"],
)
def test_ste_grad_names_the_argument(grad, mask, exc, text):
    with pytest.raises(exc) as info:
        torch.ops.pt2e_fq.ste_grad(grad, mask)
    assert text in str(info.value)


def test_a_nan_scale_reads_nan_whatever_its_sign_bit():
    # Inf - Inf (an overflowed range) may give a NaN with its sign bit set;
    # the message must not depend on it (the fused and unfused paths compare).
    negative_nan = -torch.tensor([float("nan")])
    assert torch.signbit(negative_nan).item()
    with pytest.raises(ValueError, match=r"scale\[0\] \(flat index\) = nan$"):
        torch.ops.pt2e_fq.fake_quantize_affine(torch.randn(4), [4], negative_nan, None, -8, 7, None)
