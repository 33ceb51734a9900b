// CPU implementation of the fused observe-and-fake-quantize ops
// (pt2e_fq::fake_quantize_affine_observe, fake_quantize_float_observe): one
// pass for each block's finite min / max and the non-finite count, one loop
// over the blocks for the range update and the qparams (observe.h), then the
// existing fake-quant forward on the new qparams, so y and the mask are the
// static ops' bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

#include "affine_args.h"
#include "affine_cpu.h"
#include "cpu_loops.h"
#include "float_args.h"
#include "float_cpu.h"
#include "observe_args.h"
#include "op_names.h"
#include "pt2e_fq/observe.h"

namespace pt2e_fq::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Folds the finite values of x[0, n) into [lo, hi] and counts the others.
// Min and max compare the order-preserving integers of observe.h: integer
// min / max vectorise without -ffast-math (a float compare-and-select with a
// NaN guard does not), and give the CUDA kernel's result whatever the
// order, -0 below +0. The count runs in 32 bits, flushed every kSpan
// elements (fewer than 2^32), for the same reason.
template <typename T>
PT2E_FQ_CLONES void finite_min_max(const T* __restrict__ x, int64_t n, float& lo, float& hi,
                                   int64_t& nonfinite) {
  constexpr int64_t kSpan = int64_t{1} << 30;
  uint32_t l = ordered(lo), h = ordered(hi);
  for (int64_t s = 0; s < n; s += kSpan) {
    const int64_t e = std::min(n, s + kSpan);
    uint32_t bad = 0;
    for (int64_t i = s; i < e; ++i) {
      const float v = load_f32(x[i]);
      // All ones for a finite v, else 0 (GCC 12 vectorises this, not a
      // select on a bool): a non-finite v becomes both identities.
      const uint32_t keep = 0u - static_cast<uint32_t>((f32_bits(v) & 0x7FFFFFFFu) < 0x7F800000u);
      const uint32_t o = ordered(v);
      const uint32_t ol = o | ~keep, oh = o & keep;
      l = ol < l ? ol : l;
      h = oh > h ? oh : h;
      bad += keep + 1u;  // 0 for finite, 1 otherwise
    }
    nonfinite += bad;
  }
  // lo / hi came in as ordered values (+-inf for an empty block), so l / h
  // never stay at the NaN identities.
  lo = unordered(l);
  hi = unordered(h);
}

// Per block of L, the min and max of x's finite elements in [begin, end)
// folded into lo / hi (nblocks each), and the count of the others.
template <typename T>
void fold_range(const T* x, const BlockLayout& L, int64_t begin, int64_t end, float* lo,
                float* hi, int64_t& nonfinite) {
  for_each_row_run(L, begin, end, [&](const QparamRun& run) {
    for_each_block_piece(run, [&](int64_t k, int64_t m, int64_t b) {
      finite_min_max(x + run.i + k, m, lo[b], hi[b], nonfinite);
    });
  });
}

// The batch's per-block range of x's finite values ((+inf, -inf) for a block
// with none) and its count of non-finite values. Min and max do not depend on
// the order, so threads fold disjoint slices into their own arrays, merged
// after.
void batch_range(const at::Tensor& x, const BlockLayout& L, int64_t nblocks,
                 std::vector<float>& lo, std::vector<float>& hi, int64_t& nonfinite) {
  const int64_t numel = x.numel();
  // Slices of at least kChunk elements: below that a thread costs more than it saves.
  const int64_t nslices =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), numel / kChunk));
  lo.assign(nslices * nblocks, kInf);
  hi.assign(nslices * nblocks, -kInf);
  std::vector<int64_t> bad(nslices, 0);
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, nslices, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        fold_range(xp, L, numel * s / nslices, numel * (s + 1) / nslices, lo.data() + s * nblocks,
                   hi.data() + s * nblocks, bad[s]);
      }
    });
  });
  nonfinite = 0;
  for (int64_t s = 0; s < nslices; ++s) {
    nonfinite += bad[s];
    if (s == 0) continue;
    for (int64_t b = 0; b < nblocks; ++b) {
      lo[b] = std::min(lo[b], lo[s * nblocks + b]);
      hi[b] = std::max(hi[b], hi[s * nblocks + b]);
    }
  }
}

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
