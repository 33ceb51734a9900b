// Registers the CUDA kernels as the CUDA implementations of the pt2e_fq
// operators. Built only with a CUDA torch (setup.py, PT2E_FQ_CUDA).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels.h"
#include "qparams.h"

namespace pt2e_fq::cuda {
namespace {

ElemType elem_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return ElemType::kFloat32;
    case at::kBFloat16:
      return ElemType::kBFloat16;
    case at::kHalf:
      return ElemType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "pt2e_fq: expected float32, bfloat16 or float16, got ", dtype);
  }
}

// Qparam values are not checked here: that would need a host sync. Invalid
// values give NaN or saturated outputs; see README, "Bad qparams on CUDA".
std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_cuda(
    const at::Tensor& x_in, at::IntArrayRef block_size, const at::Tensor& scale,
    const c10::optional<at::Tensor>& zero_point, int64_t quant_min, int64_t quant_max,
    const c10::optional<at::Tensor>& minval) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale, zero_point, quant_min,
                                                quant_max, minval);
  at::Tensor y = at::empty_like(in.x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(in.x);
  const AffineQparams q = affine_qparams(in, quant_min, quant_max);
  C10_CUDA_CHECK(launch_fake_quantize_affine(
      elem_type(in.x.scalar_type()), in.x.data_ptr(), y.data_ptr(),
      reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>()), in.x.numel(), q, in.layout,
      c10::cuda::getCurrentCUDAStream().stream()));
  return {y, mask};
}

at::Tensor ste_grad_cuda(const at::Tensor& grad_in, const at::Tensor& mask_in) {
  check_ste_args(grad_in, mask_in);
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  at::Tensor dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  C10_CUDA_CHECK(launch_ste_grad(elem_type(grad.scalar_type()), grad.data_ptr(),
                                 mask.data_ptr<uint8_t>(), dx.data_ptr(), grad.numel(),
                                 c10::cuda::getCurrentCUDAStream().stream()));
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CUDA, m) {
  m.impl("fake_quantize_affine", &fake_quantize_affine_cuda);
  m.impl("ste_grad", &ste_grad_cuda);
}

}  // namespace pt2e_fq::cuda
