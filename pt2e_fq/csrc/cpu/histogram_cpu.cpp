// CPU implementations of HistogramObserver's passes over a batch:
// pt2e_fq::block_finite_range (each block's finite min / max, batch_range.h)
// and pt2e_fq::block_histogram, its binning in one pass over x, each value's
// bin computed in float64 with the operations, in the order, of the ATen
// reference (observers.py, HistogramObserver._count): (v - lo) / width *
// bins, each rounded once, so the counts are that reference's bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "affine_args.h"
#include "batch_range.h"
#include "cpu_loops.h"
#include "histogram_args.h"
#include "op_names.h"

namespace pt2e_fq::cpu {
namespace {

// Most int64 counters the per-thread histograms may take together (32 MiB):
// with many blocks, fewer threads, down to one.
constexpr int64_t kMaxScratchCounts = int64_t{1} << 22;

// Elements per pass of bin_piece: its bin indices fit in a stack buffer.
constexpr int64_t kBinSpan = 1024;

// The bin of each of x[0, n) (n <= kBinSpan), the elements of one block, over
// the range from lo of width w (> 0), in idx; `bins` (one past the last bin)
// for a NaN or +-Inf, and for every value of an empty range (lo = +inf).
// Returns how many values were NaN or +-Inf. Branch-free, so it vectorises
// (the float64 division is most of the work).
template <typename T>
PT2E_FQ_CLONES int64_t bin_indices(const T* __restrict__ x, int64_t n, double lo, double w,
                                   int32_t bins, int32_t* __restrict__ idx) {
  const double nb = static_cast<double>(bins), last = nb - 1.0;
  constexpr double kMax = std::numeric_limits<double>::max();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_f32(x[i]);
    bad += !(std::fabs(v) <= std::numeric_limits<float>::max());
    const double p = (static_cast<double>(v) - lo) / w * nb;
    const bool finite = std::fabs(p) <= kMax;
    // p >= 0 for v >= lo, so truncation is floor; the clamps put v = hi
    // (p = bins) in the last bin and values outside the range at the ends.
    double c = p > 0.0 ? p : 0.0;
    c = c < last ? c : last;
    c = finite ? c : 0.0;
    idx[i] = finite ? static_cast<int32_t>(c) : bins;
  }
  return bad;
}

// Bins x[0, n), the elements of one block (see bin_indices), into
// counts[0, bins] (counts[bins]: the values in no bin) and returns how many
// were NaN or +-Inf.
template <typename T>
int64_t bin_piece(const T* x, int64_t n, double lo, double w, int32_t bins, int64_t* counts) {
  alignas(64) int32_t idx[kBinSpan];
  int64_t bad = 0;
  for (int64_t s = 0; s < n; s += kBinSpan) {
    const int64_t m = std::min(kBinSpan, n - s);
    bad += bin_indices(x + s, m, lo, w, bins, idx);
    for (int64_t i = 0; i < m; ++i) ++counts[idx[i]];
  }
  return bad;
}

std::tuple<at::Tensor, at::Tensor> block_histogram_cpu(const at::Tensor& x,
                                                      at::IntArrayRef block_size,
                                                      const at::Tensor& lo, const at::Tensor& hi,
                                                      int64_t bins) {
  const HistogramInputs in =
      check_histogram_args(op_names::kBlockHistogram, x, block_size, lo, hi, bins);
  const int64_t nblocks = in.nblocks, numel = in.x.numel();
  // Per block: the range's start and width in float64 (exact: both are
  // fp32), width 1 for a one-point or empty range, as the reference's
  // where(width > 0, width, 1).
  std::vector<double> lo_d(nblocks), w_d(nblocks);
  const float* lp = in.lo.data_ptr<float>();
  const float* hp = in.hi.data_ptr<float>();
  for (int64_t b = 0; b < nblocks; ++b) {
    lo_d[b] = static_cast<double>(lp[b]);
    const double w = static_cast<double>(hp[b]) - lo_d[b];
    w_d[b] = w > 0.0 ? w : 1.0;
  }
  // Threads count disjoint slices of x into histograms of their own, summed
  // after (integer counts: the order does not matter); each block has its
  // bins and one counter for the values in none.
  const int64_t stride = bins + 1, per_slice = std::max<int64_t>(1, nblocks * stride);
  const int64_t nslices = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(at::get_num_threads()), numel / (4 * kChunk),
                   kMaxScratchCounts / per_slice}));
  std::vector<int64_t> counts(nslices * nblocks * stride, 0), bad(nslices, 0);
  dispatch_float_dtype(in.x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = in.x.data_ptr<T>();
    at::parallel_for(0, nslices, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        int64_t* c = counts.data() + s * nblocks * stride;
        for_each_row_run(in.layout, numel * s / nslices, numel * (s + 1) / nslices,
                         [&](const QparamRun& run) {
                           for_each_block_piece(run, [&](int64_t k, int64_t m, int64_t b) {
                             bad[s] += bin_piece(xp + run.i + k, m, lo_d[b], w_d[b],
                                                 static_cast<int32_t>(bins), c + b * stride);
                           });
                         });
      }
    });
  });
  at::Tensor out = at::empty(in.counts_shape, x.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  int64_t nonfinite = 0;
  for (int64_t s = 0; s < nslices; ++s) nonfinite += bad[s];
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int64_t j = 0; j < bins; ++j) {
      int64_t total = 0;
      for (int64_t s = 0; s < nslices; ++s) total += counts[(s * nblocks + b) * stride + j];
      o[b * bins + j] = static_cast<double>(total);
    }
  }
  return {out, at::scalar_tensor(nonfinite, x.options().dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor> block_finite_range_cpu(const at::Tensor& x,
                                                         at::IntArrayRef block_size) {
  const BlockLayout layout = check_x_and_block_size(op_names::kBlockFiniteRange, x, block_size);
  const std::vector<int64_t> shape = reduced_shape(x.sizes(), block_size);
  at::Tensor lo = at::empty(shape, x.options().dtype(at::kFloat));
  at::Tensor hi = at::empty(shape, x.options().dtype(at::kFloat));
  std::vector<float> l, h;
  int64_t bad = 0;
  batch_range(x.contiguous(), layout, lo.numel(), l, h, bad);
  std::copy_n(l.data(), lo.numel(), lo.data_ptr<float>());
  std::copy_n(h.data(), hi.numel(), hi.data_ptr<float>());
  return {lo, hi};
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) {
  m.impl("block_histogram", &block_histogram_cpu);
  m.impl("block_finite_range", &block_finite_range_cpu);
}

}  // namespace pt2e_fq::cpu
