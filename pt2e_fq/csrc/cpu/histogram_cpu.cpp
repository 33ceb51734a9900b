// CPU implementation of pt2e_fq::block_histogram: HistogramObserver's binning
// of a batch in one pass over x, each value's bin computed in float64 with
// the operations, in the order, of the ATen reference (observers.py,
// HistogramObserver._count): (v - lo) / width * bins, each rounded once, so
// the counts are that reference's bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_loops.h"
#include "histogram_args.h"
#include "op_names.h"

namespace pt2e_fq::cpu {
namespace {

// Most int64 counters the per-thread histograms may take together (32 MiB):
// with many blocks, fewer threads, down to one.
constexpr int64_t kMaxScratchCounts = int64_t{1} << 22;

// Bins x[0, n), the elements of one block, over the range from lo of width w
// (> 0) into counts[0, bins) and returns how many were NaN or +-Inf.
template <typename T>
int64_t bin_piece(const T* __restrict__ x, int64_t n, double lo, double w, int64_t bins,
                  int64_t* __restrict__ counts) {
  const double nb = static_cast<double>(bins), last = nb - 1.0;
  constexpr double kMax = std::numeric_limits<double>::max();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_f32(x[i]);
    if (!(std::fabs(v) <= std::numeric_limits<float>::max())) {
      ++bad;
      continue;
    }
    const double p = (static_cast<double>(v) - lo) / w * nb;
    if (!(std::fabs(p) <= kMax)) continue;  // an empty range (lo = +inf): nothing is binned
    // p >= 0 for v >= lo, so truncation is floor; the clamps put v = hi
    // (p = bins) in the last bin and values outside the range at the ends.
    ++counts[static_cast<int64_t>(std::min(std::max(p, 0.0), last))];
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
  // after (integer counts: the order does not matter).
  const int64_t per_slice = std::max<int64_t>(1, nblocks * bins);
  const int64_t nslices = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(at::get_num_threads()), numel / (4 * kChunk),
                   kMaxScratchCounts / per_slice}));
  std::vector<int64_t> counts(nslices * nblocks * bins, 0), bad(nslices, 0);
  dispatch_float_dtype(in.x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = in.x.data_ptr<T>();
    at::parallel_for(0, nslices, 1, [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s) {
        int64_t* c = counts.data() + s * nblocks * bins;
        for_each_row_run(in.layout, numel * s / nslices, numel * (s + 1) / nslices,
                         [&](const QparamRun& run) {
                           for_each_block_piece(run, [&](int64_t k, int64_t m, int64_t b) {
                             bad[s] += bin_piece(xp + run.i + k, m, lo_d[b], w_d[b], bins,
                                                 c + b * bins);
                           });
                         });
      }
    });
  });
  at::Tensor out = at::empty(in.counts_shape, x.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  int64_t nonfinite = 0;
  for (int64_t s = 0; s < nslices; ++s) nonfinite += bad[s];
  for (int64_t j = 0; j < nblocks * bins; ++j) {
    int64_t total = counts[j];
    for (int64_t s = 1; s < nslices; ++s) total += counts[s * nblocks * bins + j];
    o[j] = static_cast<double>(total);
  }
  return {out, at::scalar_tensor(nonfinite, x.options().dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) { m.impl("block_histogram", &block_histogram_cpu); }

}  // namespace pt2e_fq::cpu
