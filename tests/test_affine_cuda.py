"""The CUDA kernels against the same pure-torch reference (run on the CPU).
Runs only where torch sees a CUDA device; elsewhere every test here is
skipped with that reason."""

import pytest
import torch
from hypothesis import given, settings

from conftest import affine_cases, assert_bits_equal, make_case
from pt2e_fq import ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA kernels are tested on a GPU machine"
)


@settings(max_examples=200, deadline=None)
@given(affine_cases())
def test_cuda_op_equals_reference(case):
    y, packed = case.to("cuda").op()
    y_ref, _, packed_ref = case.ref()
    assert_bits_equal(y.cpu(), y_ref)
    assert torch.equal(packed.cpu(), packed_ref)


@settings(max_examples=50, deadline=None)
@given(affine_cases(max_numel=5000))
def test_cuda_grad_is_dy_where_in_range(case):
    dy = torch.randn(case.x.shape).to(case.x.dtype)
    _, mask, _ = case.ref()
    gpu = case.to("cuda")
    x = gpu.x.detach().requires_grad_()
    ops.fake_quantize_affine(x, *gpu.args()[1:], minval=gpu.minval).backward(dy.cuda())
    assert_bits_equal(x.grad.cpu(), torch.where(mask, dy, torch.zeros_like(dy)))


def test_cuda_makes_no_host_sync(dtype):
    case = make_case((64, 96), (1, 32), dtype).to("cuda")
    x = case.x.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.fake_quantize_affine(*case.args(), minval=case.minval).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None


def test_scale_on_cpu_with_x_on_cuda_names_scale():
    case = make_case((4, 6), (1, 6))
    with pytest.raises(ValueError, match="scale is on cpu but x is on cuda"):
        ops.fake_quantize_affine(case.x.cuda(), case.block_size, case.scale, case.zero_point.cuda(), -8, 7)
