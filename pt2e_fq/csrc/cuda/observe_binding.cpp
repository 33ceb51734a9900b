// Registers the CUDA kernels of the fused observe-and-fake-quantize ops
// (observe_kernels.cu). Built only with a CUDA torch (setup.py, PT2E_FQ_CUDA).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "elem_type.h"
#include "float_args.h"
#include "kernels.h"
#include "observe_args.h"
#include "qparams.h"

namespace pt2e_fq::cuda {
namespace {

constexpr const char* kAffineOp = "pt2e_fq.fake_quantize_affine_observe";
constexpr const char* kFloatOp = "pt2e_fq.fake_quantize_float_observe";

// Device scratch of the range pass (observe_scratch_words).
at::Tensor observe_scratch(const ObserveInputs& in) {
  return at::empty({observe_scratch_words(in.nblocks)}, in.x.options().dtype(at::kInt));
}

uint32_t* words(const at::Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>()); }

// The state tensors are written through pointers: contiguous ones directly,
// others through a contiguous copy written back after (finish_write).
std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_observe_cuda(
    const at::Tensor& x, at::IntArrayRef block_size, const at::Tensor& min_val,
    const at::Tensor& max_val, const at::Tensor& scale, const at::Tensor& offset,
    const at::Tensor& nonfinite, int64_t quant_min, int64_t quant_max, c10::string_view scheme,
    double range_limit, c10::optional<double> averaging_constant) {
  const c10::cuda::CUDAGuard guard(x.device());
  const ObserveInputs in = check_observe_args(kAffineOp, x, block_size, min_val, max_val, scale,
                                              nonfinite, averaging_constant);
  const AffineRangeParams p = check_affine_observe_args(
      kAffineOp, x, block_size, offset, quant_min, quant_max, std::string(scheme), range_limit);
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
  const ObserveInputs in = check_observe_args(kFloatOp, x, block_size, min_val, max_val, scale,
                                              nonfinite, averaging_constant);
  const ElemFormat format = parse_elem_format(kFloatOp, "fmt", std::string(fmt));
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
  m.impl("fake_quantize_affine_observe", &fake_quantize_affine_observe_cuda);
  m.impl("fake_quantize_float_observe", &fake_quantize_float_observe_cuda);
}

}  // namespace pt2e_fq::cuda
