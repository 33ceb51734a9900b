// CPU implementation of pt2e_fq::fake_quantize_affine.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "affine_cpu.h"
#include "cpu_loops.h"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"
#include "qparams.h"

namespace pt2e_fq::cpu {
namespace {

// The hot loop over n elements. kPerElement: qparams are arrays of n values
// (small blocks); otherwise one value each for the whole run.
template <typename T, bool kPerElement>
PT2E_FQ_CLONES void affine_run(const T* __restrict__ x, T* __restrict__ y,
                               uint8_t* __restrict__ flags, int64_t n,
                               const float* __restrict__ scale, const float* __restrict__ ioff,
                               const float* __restrict__ foff, float qmin, float qmax) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = kPerElement ? i : 0;
    bool in_range;
    y[i] = store_as<T>(
        fake_quantize_affine_one(load_f32(x[i]), scale[k], ioff[k], foff[k], qmin, qmax, in_range));
    flags[i] = in_range;
  }
}

template <typename T>
void affine_chunk(const T* x, T* y, uint8_t* flags, int64_t begin, int64_t end,
                  const BlockLayout& L, const AffineQparams& qp) {
  alignas(64) float s_buf[kChunk], i_buf[kChunk], f_buf[kChunk];
  for_each_qparam_run(L, begin, end, [&](const QparamRun& run, bool one_block) {
    const int64_t i = run.i;
    if (one_block) {
      const float s = qp.scale[run.b], io = qp.ioff_at(run.b), fo = qp.foff_at(run.b);
      affine_run<T, false>(x + i, y + i, flags + (i - begin), run.n, &s, &io, &fo, qp.qmin,
                           qp.qmax);
      return;
    }
    gather_qparams(run, [&](int64_t b) { return qp.scale[b]; }, s_buf);
    gather_qparams(run, [&](int64_t b) { return qp.ioff_at(b); }, i_buf);
    gather_qparams(run, [&](int64_t b) { return qp.foff_at(b); }, f_buf);
    affine_run<T, true>(x + i, y + i, flags + (i - begin), run.n, s_buf, i_buf, f_buf, qp.qmin,
                        qp.qmax);
  });
}

}  // namespace

// The zero point is checked on its fp32 copy (exact for any value in an int16
// range, and out of range whenever the integer is), but the message reads the
// caller's value: fp32 would round a large integer.
void check_qparam_values(const char* op, const AffineInputs& in,
                         const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
                         int64_t quant_max) {
  check_scale_values(op, "scale", in.scale);
  if (in.zero_point.defined()) {
    const float* z = in.zero_point.data_ptr<float>();
    for (int64_t b = 0; b < in.zero_point.numel(); ++b) {
      // The message (and its item()) is evaluated only when the check fails.
      TORCH_CHECK_VALUE(z[b] >= quant_min && z[b] <= quant_max, op,
                        ": zero_point must lie in [quant_min, quant_max] = [", quant_min, ", ",
                        quant_max, "], got zero_point[", b, "] (flat index) = ",
                        zero_point->reshape(-1)[b].item());
    }
  }
  if (in.minval.defined()) {
    const float* m = in.minval.data_ptr<float>();
    for (int64_t b = 0; b < in.minval.numel(); ++b) {
      TORCH_CHECK_VALUE(std::isfinite(m[b]), op, ": minval must be finite, got minval[", b,
                        "] (flat index) = ", m[b]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> affine_forward(const AffineInputs& in, int64_t quant_min,
                                                  int64_t quant_max) {
  const at::Tensor& x = in.x;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(x);
  if (x.numel() == 0) return {y, mask};

  const AffineQparams qp = affine_qparams(in, quant_min, quant_max);
  for_each_typed_chunk(x, y, mask, [&](auto xp, auto yp, uint8_t* flags, int64_t begin,
                                       int64_t end) {
    affine_chunk(xp, yp, flags, begin, end, in.layout, qp);
  });
  return {y, mask};
}

namespace {

std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_cpu(
    const at::Tensor& x, at::IntArrayRef block_size, const at::Tensor& scale,
    const c10::optional<at::Tensor>& zero_point, int64_t quant_min, int64_t quant_max,
    const c10::optional<at::Tensor>& minval) {
  const AffineInputs in = prepare_affine_inputs(x, block_size, scale, zero_point, quant_min,
                                                quant_max, minval);
  check_qparam_values("pt2e_fq.fake_quantize_affine", in, zero_point, quant_min, quant_max);
  return affine_forward(in, quant_min, quant_max);
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) {
  m.impl("fake_quantize_affine", &fake_quantize_affine_cpu);
}

}  // namespace pt2e_fq::cpu
