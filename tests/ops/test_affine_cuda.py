"""fake_quantize_affine on CUDA only: no host sync, and qparams on another
device than x named in the error. The CUDA kernels against the reference and
the CUDA gradient run in test_affine_numerics and test_affine_autograd (their
"cuda" cases). Every test here is marked requires_cuda_kernels: skipped, with
the reason, where there is no CUDA device or no CUDA kernel."""

import pytest
import torch

from tests.conftest import make_case, requires_cuda_kernels
from pt2e_fq import ops

pytestmark = requires_cuda_kernels


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
