// Registers the CUDA kernels as the CUDA implementations of every pt2e_fq
// operator. Built only with a CUDA torch (setup.py, PT2E_FQ_CUDA).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>
#include <type_traits>
#include <vector>

#include "affine_args.h"
#include "elem_type.h"
#include "float_args.h"
#include "float_dtype.h"
#include "kernels.h"
#include "observe_args.h"
#include "op_names.h"

namespace pt2e_fq::cuda {
namespace {

// A mask or scratch tensor as the 32-bit words the kernels write (new_packed_mask
// pads masks to whole words).
uint32_t* words(const at::Tensor& t) { return static_cast<uint32_t*>(t.data_ptr()); }

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
      words(mask), in.x.numel(), q, in.layout,
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

at::Tensor fake_quantize_affine_learnable_cuda(const at::Tensor& x_in, at::IntArrayRef block_size,
                                               const at::Tensor& scale,
                                               const c10::optional<at::Tensor>& zero_point,
                                               int64_t quant_min, int64_t quant_max,
                                               c10::optional<double> grad_factor,
                                               const c10::optional<at::Tensor>& minval) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  grad_factor_arg(op_names::kLearnable, grad_factor, quant_max);
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale, zero_point, quant_min,
                                                quant_max, minval, op_names::kLearnable,
                                                /*float_zero_point=*/true);
  return std::get<0>(affine_forward(in, quant_min, quant_max));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quantize_affine_learnable_backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& x_in, at::IntArrayRef block_size,
    const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
    int64_t quant_max, c10::optional<double> grad_factor,
    const c10::optional<at::Tensor>& minval) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const GradFactor factor = grad_factor_arg(op_names::kLearnableBackward, grad_factor, quant_max);
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale, zero_point, quant_min,
                                                quant_max, minval, op_names::kLearnableBackward,
                                                /*float_zero_point=*/true);
  check_learnable_grad(op_names::kLearnableBackward, grad_in, x_in);
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

// Float formats. As for the affine op, scale values are not checked here.
std::tuple<at::Tensor, at::Tensor> fake_quantize_float_cuda(const at::Tensor& x_in,
                                                            at::IntArrayRef block_size,
                                                            const at::Tensor& scale_in,
                                                            c10::string_view fmt) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const BlockLayout layout = check_x_and_block_size(op_names::kFloat, x_in, block_size);
  const ElemFormat format = parse_elem_format(op_names::kFloat, "fmt", std::string(fmt));
  const at::Tensor scale =
      qparam_as_float(x_in, scale_in, "scale", reduced_shape(x_in.sizes(), block_size),
                      op_names::kFloat);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(x);
  C10_CUDA_CHECK(launch_fake_quantize_float(elem_type(x.scalar_type()), format, x.data_ptr(),
                                            y.data_ptr(), words(mask), x.numel(),
                                            scale.data_ptr<float>(), layout,
                                            c10::cuda::getCurrentCUDAStream().stream()));
  return {y, mask};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quantize_mx_cuda(const at::Tensor& x_in,
                                                                     c10::string_view elem_fmt,
                                                                     int64_t block_size,
                                                                     int64_t axis) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const AxisBlocks A = check_axis_blocks(op_names::kMx, x_in, block_size, axis);
  const ElemFormat format = parse_elem_format(op_names::kMx, "elem_fmt", std::string(elem_fmt));
  BlockOutputs o = new_block_outputs(x_in, axis, A);
  C10_CUDA_CHECK(launch_fake_quantize_mx(elem_type(o.x.scalar_type()), format, o.x.data_ptr(),
                                         o.y.data_ptr(), words(o.mask),
                                         o.scales.data_ptr<float>(), A,
                                         c10::cuda::getCurrentCUDAStream().stream()));
  return {o.y, o.mask, o.scales};
}

// The global scale stays on the device: given, it is copied into the output;
// otherwise the kernels compute it from x's amax. No host sync either way.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_nvfp4_cuda(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& global_scale, int64_t axis) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const AxisBlocks A = check_axis_blocks(op_names::kNvfp4, x_in, 16, axis);
  BlockOutputs o = new_block_outputs(x_in, axis, A);
  const auto f32 = o.x.options().dtype(at::kFloat);
  at::Tensor g, amax;
  if (global_scale.has_value()) {
    g = qparam_as_float(x_in, *global_scale, "global_scale", {}, op_names::kNvfp4, "a single value")
            .reshape({})
            .clone();
  } else {
    g = at::empty({}, f32);
    amax = at::zeros({1}, o.x.options().dtype(at::kInt));
  }
  C10_CUDA_CHECK(launch_fake_quantize_nvfp4(
      elem_type(o.x.scalar_type()), o.x.data_ptr(), o.y.data_ptr(), words(o.mask),
      o.scales.data_ptr<float>(), g.data_ptr<float>(),
      amax.defined() ? words(amax) : nullptr, A,
      c10::cuda::getCurrentCUDAStream().stream()));
  return {o.y, o.mask, o.scales, g};
}

// Fused observe-and-fake-quantize (observe_kernels.cu).

// Device scratch of the range pass (observe_scratch_words).
at::Tensor observe_scratch(const ObserveInputs& in) {
  return at::empty({observe_scratch_words(in.nblocks)}, in.x.options().dtype(at::kInt));
}

// The state tensors are written through pointers: contiguous ones directly,
// others through a contiguous copy written back after (finish_write).
std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_observe_cuda(
    const at::Tensor& x, at::IntArrayRef block_size, const at::Tensor& min_val,
    const at::Tensor& max_val, const at::Tensor& scale, const at::Tensor& offset,
    const at::Tensor& nonfinite, int64_t quant_min, int64_t quant_max, c10::string_view scheme,
    double range_limit, c10::optional<double> averaging_constant) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ObserveInputs in = check_observe_args(op_names::kAffineObserve, x, block_size, min_val,
                                              max_val, scale, nonfinite, averaging_constant);
  const AffineRangeParams p = check_affine_observe_args(
      op_names::kAffineObserve, x, block_size, offset, quant_min, quant_max, std::string(scheme),
      range_limit);
  const bool is_minval = p.scheme == AffineScheme::kMinval;
  at::Tensor lo = writable(min_val), hi = writable(max_val), s = writable(scale);
  at::Tensor off = writable(offset), count = writable(nonfinite);
  at::Tensor ioff = at::empty({in.nblocks}, in.x.options().dtype(at::kFloat));
  at::Tensor scratch = observe_scratch(in);
  at::Tensor y = at::empty_like(in.x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(in.x);
  C10_CUDA_CHECK(launch_fake_quantize_affine_observe(
      elem_type(in.x.scalar_type()), in.x.data_ptr(), y.data_ptr(),
      words(mask), in.x.numel(), in.layout, in.nblocks, in.update, p, lo.data_ptr<float>(),
      hi.data_ptr<float>(), s.data_ptr<float>(), is_minval ? nullptr : off.data_ptr<int32_t>(),
      is_minval ? off.data_ptr<float>() : nullptr, ioff.data_ptr<float>(),
      count.data_ptr<int64_t>(), words(scratch), c10::cuda::getCurrentCUDAStream().stream()));
  finish_write(min_val, lo);
  finish_write(max_val, hi);
  finish_write(scale, s);
  finish_write(offset, off);
  finish_write(nonfinite, count);
  return {y, mask};
}

std::tuple<at::Tensor, at::Tensor> fake_quantize_float_observe_cuda(
    const at::Tensor& x, at::IntArrayRef block_size, const at::Tensor& min_val,
    const at::Tensor& max_val, const at::Tensor& scale, const at::Tensor& nonfinite,
    c10::string_view fmt, c10::optional<double> averaging_constant) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ObserveInputs in = check_observe_args(op_names::kFloatObserve, x, block_size, min_val,
                                              max_val, scale, nonfinite, averaging_constant);
  const ElemFormat format = parse_elem_format(op_names::kFloatObserve, "fmt", std::string(fmt));
  at::Tensor lo = writable(min_val), hi = writable(max_val), s = writable(scale);
  at::Tensor count = writable(nonfinite);
  at::Tensor scratch = observe_scratch(in);
  at::Tensor y = at::empty_like(in.x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(in.x);
  C10_CUDA_CHECK(launch_fake_quantize_float_observe(
      elem_type(in.x.scalar_type()), format, in.x.data_ptr(), y.data_ptr(), words(mask),
      in.x.numel(), in.layout, in.nblocks, in.update, lo.data_ptr<float>(), hi.data_ptr<float>(),
      s.data_ptr<float>(), count.data_ptr<int64_t>(), words(scratch),
      c10::cuda::getCurrentCUDAStream().stream()));
  finish_write(min_val, lo);
  finish_write(max_val, hi);
  finish_write(scale, s);
  finish_write(nonfinite, count);
  return {y, mask};
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
  m.impl("fake_quantize_affine_observe", &fake_quantize_affine_observe_cuda);
  m.impl("fake_quantize_float_observe", &fake_quantize_float_observe_cuda);
}

}  // namespace pt2e_fq::cuda
