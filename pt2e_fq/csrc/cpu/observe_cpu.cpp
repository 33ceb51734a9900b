// CPU implementation of the fused observe-and-fake-quantize ops
// (pt2e_fq::fake_quantize_affine_observe, fake_quantize_float_observe): one
// pass for each block's finite min / max and the non-finite count
// (batch_range.h), one loop over the blocks for the range update and the
// qparams (observe.h), then the existing fake-quant forward on the new
// qparams, so y and the mask are the static ops' bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

#include "affine_args.h"
#include "affine_cpu.h"
#include "batch_range.h"
#include "cpu_loops.h"
#include "float_args.h"
#include "float_cpu.h"
#include "observe_args.h"
#include "op_names.h"
#include "pt2e_fq/observe.h"

namespace pt2e_fq::cpu {
namespace {

// Observes x: updates the running range in place and returns it per block
// (lo, hi: after the update, empty ranges as [0, 0]) for the qparams.
struct Observed {
  std::vector<float> lo, hi;
};

Observed observe(const ObserveInputs& in, const at::Tensor& min_val, const at::Tensor& max_val,
                 const at::Tensor& nonfinite) {
  Observed o;
  int64_t bad = 0;
  batch_range(in.x, in.layout, in.nblocks, o.lo, o.hi, bad);
  at::Tensor lo_t = writable(min_val), hi_t = writable(max_val);
  float* run_lo = lo_t.data_ptr<float>();
  float* run_hi = hi_t.data_ptr<float>();
  for (int64_t b = 0; b < in.nblocks; ++b) {
    update_range(in.update, o.lo[b], o.hi[b], run_lo[b], run_hi[b]);
    o.lo[b] = run_lo[b];
    o.hi[b] = run_hi[b];
    nonempty_range(o.lo[b], o.hi[b]);
  }
  finish_write(min_val, lo_t);
  finish_write(max_val, hi_t);
  *nonfinite.data_ptr<int64_t>() += bad;  // a one-element CPU tensor: no copy needed
  return o;
}

std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_observe_cpu(
    const at::Tensor& x, at::IntArrayRef block_size, const at::Tensor& min_val,
    const at::Tensor& max_val, const at::Tensor& scale, const at::Tensor& offset,
    const at::Tensor& nonfinite, int64_t quant_min, int64_t quant_max, c10::string_view scheme,
    double range_limit, c10::optional<double> averaging_constant) {
  const ObserveInputs in = check_observe_args(op_names::kAffineObserve, x, block_size, min_val,
                                              max_val, scale, nonfinite, averaging_constant);
  const AffineRangeParams p = check_affine_observe_args(
      op_names::kAffineObserve, x, block_size, offset, quant_min, quant_max, std::string(scheme),
      range_limit);
  const Observed o = observe(in, min_val, max_val, nonfinite);

  // The kernel takes fp32 qparams; the buffers keep their dtypes.
  const bool minval = p.scheme == AffineScheme::kMinval;
  at::Tensor scale_t = writable(scale);
  at::Tensor offset_t = writable(offset);
  at::Tensor offset_f = minval ? offset_t : at::empty({in.nblocks}, x.options().dtype(at::kFloat));
  float* s = scale_t.data_ptr<float>();
  float* off_f = offset_f.data_ptr<float>();
  int32_t* zp = minval ? nullptr : offset_t.data_ptr<int32_t>();
  for (int64_t b = 0; b < in.nblocks; ++b) {
    int32_t z = 0;
    float m = 0.0f;
    affine_qparams_from_range(p, o.lo[b], o.hi[b], s[b], z, m);
    if (minval) {
      off_f[b] = m;
    } else {
      zp[b] = z;
      off_f[b] = static_cast<float>(z);
    }
  }
  finish_write(scale, scale_t);
  finish_write(offset, offset_t);

  AffineInputs fq;
  fq.x = in.x;
  fq.layout = in.layout;
  fq.scale = scale_t.reshape({-1});
  (minval ? fq.minval : fq.zero_point) = offset_f.reshape({-1});
  // As the static op: a corrupt running range (NaN, loaded) gives a bad
  // scale, which is an error rather than NaN outputs.
  check_qparam_values(op_names::kAffineObserve, fq,
                      minval ? c10::nullopt : c10::optional<at::Tensor>(offset),
                      quant_min, quant_max);
  return affine_forward(fq, quant_min, quant_max);
}

std::tuple<at::Tensor, at::Tensor> fake_quantize_float_observe_cpu(
    const at::Tensor& x, at::IntArrayRef block_size, const at::Tensor& min_val,
    const at::Tensor& max_val, const at::Tensor& scale, const at::Tensor& nonfinite,
    c10::string_view fmt, c10::optional<double> averaging_constant) {
  const ObserveInputs in = check_observe_args(op_names::kFloatObserve, x, block_size, min_val,
                                              max_val, scale, nonfinite, averaging_constant);
  const ElemFormat format = parse_elem_format(op_names::kFloatObserve, "fmt", std::string(fmt));
  const Observed o = observe(in, min_val, max_val, nonfinite);
  at::Tensor scale_t = writable(scale);
  float* s = scale_t.data_ptr<float>();
  dispatch_elem_format(format, [&](auto ftag) {
    constexpr float fmax = Elem<decltype(ftag)::value>::fmax;
    for (int64_t b = 0; b < in.nblocks; ++b) s[b] = float_scale_from_range(o.lo[b], o.hi[b], fmax);
  });
  finish_write(scale, scale_t);
  const at::Tensor flat_scale = scale_t.reshape({-1});
  check_scale_values(op_names::kFloatObserve, "scale", flat_scale);
  return float_forward(in.x, in.layout, flat_scale, format);
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) {
  m.impl("fake_quantize_affine_observe", &fake_quantize_affine_observe_cpu);
  m.impl("fake_quantize_float_observe", &fake_quantize_float_observe_cpu);
}

}  // namespace pt2e_fq::cpu
