// CPU implementation of pt2e_fq::fake_quantize_float: FP8 E4M3 / E5M2 and
// FP4 E2M1 fake quantization with static per-tensor, per-channel or
// per-block scales (the same block layouts as the integer affine op).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "affine_args.h"
#include "cpu_loops.h"
#include "float_args.h"
#include "float_cpu.h"
#include "op_names.h"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"

namespace pt2e_fq::cpu {
namespace {

template <ElemFormat F, typename T>
void float_chunk(const T* x, T* y, uint8_t* flags, int64_t begin, int64_t end,
                 const BlockLayout& L, const float* scale) {
  alignas(64) float s_buf[kChunk];
  for_each_qparam_run(L, begin, end, [&](const QparamRun& run, bool one_block) {
    const int64_t i = run.i;
    if (one_block) {
      scaled_run<FloatElem<F>, T, false>(x + i, y + i, flags + (i - begin), run.n, scale + run.b);
      return;
    }
    gather_qparams(run, [&](int64_t b) { return scale[b]; }, s_buf);
    scaled_run<FloatElem<F>, T, true>(x + i, y + i, flags + (i - begin), run.n, s_buf);
  });
}

std::tuple<at::Tensor, at::Tensor> fake_quantize_float_cpu(const at::Tensor& x_in,
                                                           at::IntArrayRef block_size,
                                                           const at::Tensor& scale_in,
                                                           c10::string_view fmt) {
  const BlockLayout L = check_x_and_block_size(op_names::kFloat, x_in, block_size);
  const ElemFormat format = parse_elem_format(op_names::kFloat, "fmt", std::string(fmt));
  const at::Tensor scale =
      qparam_as_float(x_in, scale_in, "scale", reduced_shape(x_in.sizes(), block_size),
                      op_names::kFloat);
  check_scale_values(op_names::kFloat, "scale", scale);
  return float_forward(x_in.contiguous(), L, scale, format);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> float_forward(const at::Tensor& x, const BlockLayout& L,
                                                 const at::Tensor& scale, ElemFormat format) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(x);
  if (x.numel() == 0) return {y, mask};
  const float* s = scale.data_ptr<float>();
  dispatch_elem_format(format, [&](auto ftag) {
    for_each_typed_chunk(x, y, mask, [&](auto xp, auto yp, uint8_t* flags, int64_t begin,
                                         int64_t end) {
      float_chunk<decltype(ftag)::value>(xp, yp, flags, begin, end, L, s);
    });
  });
  return {y, mask};
}

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) { m.impl("fake_quantize_float", &fake_quantize_float_cpu); }

}  // namespace pt2e_fq::cpu
