"""Forward numerics of pt2e_fq.fake_quantize_affine: bit for bit equal to the
pure-torch reference, hand-checked ties and special values, and where ATen's
fake-quant differs from true division. The comparisons with the reference
run on every device in DEVICES (the reference on the CPU)."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings

from tests.conftest import DEVICES, QUANT_RANGES, affine_cases, assert_bits_equal, make_case
from pt2e_fq import ops, reference


def assert_matches_reference(case, device="cpu"):
    """The op on `device` against the reference on the CPU."""
    y, packed = case.to(device).op()
    y_ref, _, packed_ref = case.ref()
    assert y.device.type == device
    assert_bits_equal(y.cpu(), y_ref)
    assert torch.equal(packed.cpu(), packed_ref), "packed mask differs"


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=200, deadline=None)
@given(affine_cases())
def test_op_equals_reference(device, case):
    assert_matches_reference(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,qmin,qmax", QUANT_RANGES, ids=[r[0] for r in QUANT_RANGES])
@pytest.mark.parametrize("zp", ["random", "none", "minval"])
def test_every_quant_range_and_formulation(name, qmin, qmax, zp, dtype, device):
    # Per-group along the last dim with a ragged last group, as a fixed
    # baseline next to the random search.
    assert_matches_reference(make_case((7, 45), (1, 16), dtype, (qmin, qmax), zp=zp, seed=qmax), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape,block_size",
    [
        ((3, 4096 * 2 + 5), (3, 4096 * 2 + 5)),  # several parallel chunks, one scale
        ((4096 + 9,), (7,)),  # small blocks across a chunk boundary
        ((5, 3, 17), (1, 3, 17)),  # per-channel, axis 0
        ((5, 3, 17), (5, 1, 17)),  # per-channel, axis 1
        ((5, 3, 17), (5, 3, 1)),  # per-channel, axis 2
        ((6, 40), (4, 16)),  # 2-D blocks, ragged on both axes
        ((1, 1, 1), (1, 1, 1)),  # size-1 dims only
    ],
)
def test_granularities(shape, block_size, dtype, device):
    assert_matches_reference(make_case(shape, block_size, dtype), device)


def test_ties_round_half_to_even(dtype):
    # x / scale is exactly k + 0.5 (scale a power of two); rounding goes to
    # the even neighbour in both directions, then the zero point is added.
    scale = torch.tensor([0.25])
    k_half = [0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 126.5, 127.5]
    rounded = [0, 2, 2, 4, 0, -2, -2, -4, 126, 128]
    x = (torch.tensor(k_half) * 0.25).to(dtype)
    for zp in (0, 3):
        y = ops.fake_quantize_affine(x, [x.numel()], scale, torch.tensor([zp]), -128, 127)
        expected = [(min(max(q + zp, -128), 127) - zp) * 0.25 for q in rounded]
        assert y.tolist() == expected, f"zero point {zp}"


def test_ties_minval_formulation():
    # (x - minval) / scale = k + 0.5 exactly: q = even(k + 0.5) + quant_min.
    minval, scale = torch.tensor([-1.0]), torch.tensor([0.5])
    x = torch.tensor([-0.75, -0.25, 0.25, 0.75])  # (x + 1) / 0.5 = 0.5, 1.5, 2.5, 3.5
    y = ops.fake_quantize_affine(x, [4], scale, None, 0, 15, minval=minval)
    assert y.tolist() == [q * 0.5 - 1.0 for q in (0, 2, 2, 4)]


def test_true_division_where_aten_multiplies_by_the_reciprocal():
    # 890.75 / 3.5 = 254.5 exactly (3.5 * 254.5 = 890.75), so IEEE division
    # gives the tie 254.5, which rounds to even: 254. ATen's fake-quant
    # computes x * (1 / 3.5) = x * 0.2857142984867096 (fp32), which lands
    # above the tie and rounds to 255. ONNX QuantizeLinear divides, as we do.
    x = torch.tensor([890.75, -890.75] * 4)
    assert 890.75 / 3.5 == 254.5
    y = ops.fake_quantize_affine(x, [x.numel()], torch.tensor([3.5]), None, -(2**15), 2**15 - 1)
    assert y.tolist() == [254 * 3.5, -254 * 3.5] * 4
    aten = torch.fake_quantize_per_tensor_affine(x, 3.5, 0, -(2**15), 2**15 - 1)
    assert aten.tolist() == [255 * 3.5, -255 * 3.5] * 4


# Hand-computed: x = [nan, inf, -inf, 1.0], scale 0.5.
# ZP: zero point 1, range [-8, 7]: +inf -> (7 - 1) * 0.5, -inf -> (-8 - 1) * 0.5,
#     1.0 -> q = 2 + 1 in range -> 1.0.
# MINVAL: minval -2, range [0, 15]: +inf -> 15 * 0.5 - 2, -inf -> -2,
#     1.0 -> q = (1 + 2) / 0.5 = 6 in range -> 1.0.
@pytest.mark.parametrize(
    "zero_point,minval,qrange,y_inf,y_minus_inf",
    [([1], None, (-8, 7), 3.0, -4.5), (None, [-2.0], (0, 15), 5.5, -2.0)],
    ids=["zp", "minval"],
)
def test_nan_and_inf(zero_point, minval, qrange, y_inf, y_minus_inf, dtype):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0], dtype=dtype)
    y, packed = ops.fake_quantize_affine_with_mask(
        x, [4], torch.tensor([0.5]), None if zero_point is None else torch.tensor(zero_point), *qrange,
        minval=None if minval is None else torch.tensor(minval),
    )
    assert y[0].isnan()
    assert y[1:].tolist() == [y_inf, y_minus_inf, 1.0]
    assert packed.tolist() == [0b1000]  # only element 3 is in range


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0), (2, 0, 5), (), (1,), (1, 1)])
def test_empty_and_single_element(shape, dtype, device):
    block_size = [1] * len(shape)
    case = make_case(shape, block_size, dtype)
    y, packed = case.to(device).op()
    assert y.shape == torch.Size(shape) and packed.numel() == (case.x.numel() + 7) // 8
    assert_matches_reference(case, device)


def test_output_dtype_and_layout(dtype):
    x = torch.randn(6, 10).to(dtype).t()  # non-contiguous input
    y, packed = ops.fake_quantize_affine_with_mask(x, [10, 6], torch.tensor(0.1), None, -8, 7)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert packed.dtype == torch.uint8 and packed.shape == ((60 + 7) // 8,)


def test_unpack_mask_inverts_reference_packing():
    mask = torch.rand(3, 11, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(ops.unpack_mask(reference.pack_mask(mask), mask.shape), mask)


@pytest.mark.skipif(os.environ.get("PT2E_FQ_PORTABLE_CPU") == "1", reason="already the portable run")
def test_the_portable_cpu_path_equals_reference_too():
    # On a CPU with AVX-512 the kernel takes hand-written intrinsics for
    # blocks that tiles do not straddle; PT2E_FQ_PORTABLE_CPU=1 turns them
    # off, so this run checks the portable code that other CPUs take.
    env = dict(os.environ, PT2E_FQ_PORTABLE_CPU="1")
    tests = "op_equals_reference or every_quant_range or granularities or ties"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                         env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
