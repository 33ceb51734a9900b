// Registers the CUDA kernels as the CUDA implementations of the pt2e_fq
// operators. Built only with a CUDA torch (setup.py, PT2E_FQ_CUDA).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "float_args.h"
#include "float_dtype.h"
#include "elem_type.h"
#include "kernels.h"
#include "qparams.h"

namespace pt2e_fq::cuda {
namespace {

// (y, packed mask) of prepared inputs. Qparam values are not checked here:
// that would need a host sync. Invalid values give NaN or saturated outputs;
// see README, "Bad qparams on CUDA".
std::tuple<at::Tensor, at::Tensor> affine_forward(const AffineInputs& in, int64_t quant_min,
                                                  int64_t quant_max) {
  at::Tensor y = at::empty_like(in.x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(in.x);
  const AffineQparams q = affine_qparams(in, quant_min, quant_max);
  C10_CUDA_CHECK(launch_fake_quantize_affine(
      elem_type(in.x.scalar_type()), in.x.data_ptr(), y.data_ptr(),
      reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>()), in.x.numel(), q, in.layout,
      c10::cuda::getCurrentCUDAStream().stream()));
  return {y, mask};
}

std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_cuda(
    const at::Tensor& x_in, at::IntArrayRef block_size, const at::Tensor& scale,
    const c10::optional<at::Tensor>& zero_point, int64_t quant_min, int64_t quant_max,
    const c10::optional<at::Tensor>& minval) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale, zero_point, quant_min,
                                                quant_max, minval);
  return affine_forward(in, quant_min, quant_max);
}

constexpr const char* kLearnableOp = "pt2e_fq.fake_quantize_affine_learnable";
constexpr const char* kLearnableBackwardOp = "pt2e_fq.fake_quantize_affine_learnable_backward";

at::Tensor fake_quantize_affine_learnable_cuda(const at::Tensor& x_in, at::IntArrayRef block_size,
                                               const at::Tensor& scale,
                                               const c10::optional<at::Tensor>& zero_point,
                                               int64_t quant_min, int64_t quant_max,
                                               c10::optional<double> grad_factor,
                                               const c10::optional<at::Tensor>& minval) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  grad_factor_arg(kLearnableOp, grad_factor, quant_max);
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale, zero_point, quant_min,
                                                quant_max, minval, kLearnableOp,
                                                /*float_zero_point=*/true);
  return std::get<0>(affine_forward(in, quant_min, quant_max));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quantize_affine_learnable_backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& x_in, at::IntArrayRef block_size,
    const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
    int64_t quant_max, c10::optional<double> grad_factor,
    const c10::optional<at::Tensor>& minval) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const GradFactor factor = grad_factor_arg(kLearnableBackwardOp, grad_factor, quant_max);
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale, zero_point, quant_min,
                                                quant_max, minval, kLearnableBackwardOp,
                                                /*float_zero_point=*/true);
  check_learnable_grad(kLearnableBackwardOp, grad_in, x_in);
  const at::Tensor grad = grad_in.contiguous();
  const auto f32 = in.x.options().dtype(at::kFloat);
  const std::vector<int64_t> qshape = reduced_shape(in.x.sizes(), block_size);
  at::Tensor dx = at::empty_like(in.x, at::MemoryFormat::Contiguous);
  at::Tensor dscale = at::zeros(qshape, f32);
  at::Tensor doffset = at::zeros(qshape, f32);
  at::Tensor scratch = at::empty({learnable_backward_scratch_floats(in.layout)}, f32);
  C10_CUDA_CHECK(launch_fake_quantize_affine_learnable_backward(
      elem_type(in.x.scalar_type()), in.x.data_ptr(), grad.data_ptr(), dx.data_ptr(),
      in.x.numel(), affine_qparams(in, quant_min, quant_max), in.layout, in.minval.defined(),
      factor, scratch.data_ptr<float>(), dscale.data_ptr<float>(),
      doffset.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream()));
  return {dx, dscale, doffset};
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

uint32_t* mask_words(at::Tensor& mask) { return reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>()); }

// Float formats. As for the affine op, scale values are not checked here.
std::tuple<at::Tensor, at::Tensor> fake_quantize_float_cuda(const at::Tensor& x_in,
                                                            at::IntArrayRef block_size,
                                                            const at::Tensor& scale_in,
                                                            c10::string_view fmt) {
  constexpr const char* op = "pt2e_fq.fake_quantize_float";
  const c10::cuda::CUDAGuard guard(x_in.device());
  const BlockLayout layout = check_x_and_block_size(op, x_in, block_size);
  const ElemFormat format = parse_elem_format(op, "fmt", std::string(fmt));
  const at::Tensor scale =
      qparam_as_float(x_in, scale_in, "scale", reduced_shape(x_in.sizes(), block_size), op);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(x);
  C10_CUDA_CHECK(launch_fake_quantize_float(elem_type(x.scalar_type()), format, x.data_ptr(),
                                            y.data_ptr(), mask_words(mask), x.numel(),
                                            scale.data_ptr<float>(), layout,
                                            c10::cuda::getCurrentCUDAStream().stream()));
  return {y, mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quantize_mx_cuda(const at::Tensor& x_in,
                                                                     c10::string_view elem_fmt,
                                                                     int64_t block_size,
                                                                     int64_t axis) {
  constexpr const char* op = "pt2e_fq.fake_quantize_mx";
  const c10::cuda::CUDAGuard guard(x_in.device());
  const AxisBlocks A = check_axis_blocks(op, x_in, block_size, axis);
  const ElemFormat format = parse_elem_format(op, "elem_fmt", std::string(elem_fmt));
  BlockOutputs o = new_block_outputs(x_in, axis, A);
  C10_CUDA_CHECK(launch_fake_quantize_mx(elem_type(o.x.scalar_type()), format, o.x.data_ptr(),
                                         o.y.data_ptr(), mask_words(o.mask),
                                         o.scales.data_ptr<float>(), A,
                                         c10::cuda::getCurrentCUDAStream().stream()));
  return {o.y, o.mask, o.scales};
}

// The global scale stays on the device: given, it is copied into the output;
// otherwise the kernels compute it from x's amax. No host sync either way.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_nvfp4_cuda(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& global_scale, int64_t axis) {
  constexpr const char* op = "pt2e_fq.fake_quantize_nvfp4";
  const c10::cuda::CUDAGuard guard(x_in.device());
  const AxisBlocks A = check_axis_blocks(op, x_in, 16, axis);
  BlockOutputs o = new_block_outputs(x_in, axis, A);
  const auto f32 = o.x.options().dtype(at::kFloat);
  at::Tensor g, amax;
  if (global_scale.has_value()) {
    g = qparam_as_float(x_in, *global_scale, "global_scale", {}, op, "a single value")
            .reshape({})
            .clone();
  } else {
    g = at::empty({}, f32);
    amax = at::zeros({1}, o.x.options().dtype(at::kInt));
  }
  C10_CUDA_CHECK(launch_fake_quantize_nvfp4(
      elem_type(o.x.scalar_type()), o.x.data_ptr(), o.y.data_ptr(), mask_words(o.mask),
      o.scales.data_ptr<float>(), g.data_ptr<float>(),
      amax.defined() ? reinterpret_cast<uint32_t*>(amax.data_ptr<int32_t>()) : nullptr, A,
      c10::cuda::getCurrentCUDAStream().stream()));
  return {o.y, o.mask, o.scales, g};
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CUDA, m) {
  m.impl("fake_quantize_affine", &fake_quantize_affine_cuda);
  m.impl("ste_grad", &ste_grad_cuda);
  m.impl("fake_quantize_affine_learnable", &fake_quantize_affine_learnable_cuda);
  m.impl("fake_quantize_affine_learnable_backward", &fake_quantize_affine_learnable_backward_cuda);
  m.impl("fake_quantize_float", &fake_quantize_float_cuda);
  m.impl("fake_quantize_mx", &fake_quantize_mx_cuda);
  m.impl("fake_quantize_nvfp4", &fake_quantize_nvfp4_cuda);
}

}  // namespace pt2e_fq::cuda
