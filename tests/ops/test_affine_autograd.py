"""Backward of fake_quantize_affine: a straight-through estimator through the
bit-packed clamp mask, which is all the autograd node saves. On every device
in DEVICES, against masks from the reference on the CPU."""

import pytest
import torch
from hypothesis import given, settings

from tests.conftest import DEVICES, affine_cases, assert_bits_equal, make_case, with_layout
from pt2e_fq import ops, reference


def grad_of(case, dy, device="cpu"):
    """x.grad on the CPU, from the op on `device` (dy keeps its layout if it
    is already there)."""
    case = case.to(device)
    x = case.x.detach().requires_grad_()
    y = ops.fake_quantize_affine(x, *case.args()[1:], minval=case.minval)
    assert y.device.type == device
    y.backward(dy.to(device))
    return x.grad.cpu()


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=100, deadline=None)
@given(affine_cases(max_numel=5000))
def test_grad_is_dy_where_in_range(device, case):
    dy = torch.randn(case.x.shape).to(case.x.dtype)
    _, mask, _ = case.ref()
    assert_bits_equal(grad_of(case, dy, device), torch.where(mask, dy, torch.zeros_like(dy)))


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_dy_at_clamped_positions_gives_zero(dtype, device):
    # A select, not a multiply: 0 * NaN would be NaN.
    case = make_case((4, 33), (1, 33), dtype, (-8, 7))
    _, mask, _ = case.ref()
    assert mask.any() and not mask.all()
    dy = torch.full(case.x.shape, float("nan"), dtype=dtype)
    dx = grad_of(case, dy, device)
    assert torch.equal(dx.isnan(), mask)
    assert (dx[~mask] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_grad_of_non_contiguous_dy(dtype, device):
    case = make_case((9, 20), (3, 20), dtype)
    _, mask, _ = case.ref()
    dy = with_layout(torch.randn(9, 20).to(dtype).to(device), "permuted")
    assert not dy.is_contiguous()
    expected = torch.where(mask, dy.cpu(), torch.zeros(9, 20, dtype=dtype))
    assert_bits_equal(grad_of(case, dy, device), expected)


def saved_tensors(fn):
    """The tensors autograd saves for backward while fn runs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (9,), (5, 13), (64, 3, 5), (0, 3)])
def test_saves_only_the_packed_mask(shape, dtype, device):
    case = make_case(shape, [1] * len(shape), dtype).to(device)
    x = case.x.requires_grad_()
    saved = saved_tensors(lambda: ops.fake_quantize_affine(*case.args(), minval=case.minval))
    assert len(saved) == 1
    (mask,) = saved
    assert mask.dtype == torch.uint8 and mask.device.type == device
    assert mask.numel() * mask.element_size() == (x.numel() + 7) // 8
    assert torch.equal(mask.cpu(), case.to("cpu").ref()[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0,), (1,), (2, 0, 3)])
def test_backward_of_empty_and_single_element(shape, dtype, device):
    case = make_case(shape, [1] * len(shape), dtype)
    dy = torch.ones(shape, dtype=dtype)
    _, mask, _ = case.ref()
    assert_bits_equal(grad_of(case, dy, device), torch.where(mask, dy, torch.zeros_like(dy)))


@pytest.mark.parametrize("device", DEVICES)
def test_ste_grad_op_against_unpacked_mask(dtype, device):
    g = torch.Generator().manual_seed(0)
    for numel in (0, 1, 8, 13, 4096 * 3 + 5):
        mask = torch.rand(numel, generator=g) < 0.5
        grad = torch.randn(numel, generator=g).to(dtype)
        dx = torch.ops.pt2e_fq.ste_grad(grad.to(device), reference.pack_mask(mask).to(device))
        assert dx.device.type == device
        assert_bits_equal(dx.cpu(), torch.where(mask, grad, torch.zeros_like(grad)))


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_is_twice_the_mask(dtype, device):
    # d/dx sum(d(y^2)/dx) through the STE: dy = 2y, dx = mask * 2y, and its
    # derivative is 2 * mask (what ATen's fake-quant ops give), never None.
    case = make_case((6, 40), (1, 8), dtype, (-8, 7))
    _, mask, _ = case.ref()
    case = case.to(device)
    x = case.x.detach().requires_grad_()
    y = ops.fake_quantize_affine(x, *case.args()[1:], minval=case.minval)
    (g,) = torch.autograd.grad(y.float().square().sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.float().sum(), x)
    assert_bits_equal(gg.cpu(), (2 * mask).to(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_of_the_float_formats(device):
    x = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 100).to(device).requires_grad_()
    scale = torch.tensor(0.05, device=device)
    ops_and_raw = [
        (lambda t: ops.fake_quantize_float(t, [4, 64], scale, torch.float8_e4m3fn),
         lambda t: torch.ops.pt2e_fq.fake_quantize_float(t, [4, 64], scale, "e4m3")),
        (lambda t: ops.fake_quantize_mx(t, torch.float4_e2m1fn_x2),
         lambda t: torch.ops.pt2e_fq.fake_quantize_mx(t, "e2m1", 32, -1)),
        (ops.fake_quantize_nvfp4, lambda t: torch.ops.pt2e_fq.fake_quantize_nvfp4(t, None, -1)),
    ]
    for fn, raw in ops_and_raw:
        (g,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        mask = ops.unpack_mask(raw(x.detach())[1], x.shape)
        assert torch.equal(gg, 2 * mask.float())
