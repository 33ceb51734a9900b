// Argument checks of pt2e_fq::block_histogram (HistogramObserver's binning).
// The Python wrapper (ops/histogram.py) checks the same with the same
// messages. Shapes, dtypes and devices only.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "pt2e_fq/block_layout.h"

namespace pt2e_fq {

// The most bins per block (bin indices are int32).
constexpr int64_t kMaxHistogramBins = int64_t{1} << 24;

// The checked inputs of block_histogram: contiguous x, its block layout, the
// per-block range as contiguous fp32, and the counts' shape
// (ceil(x.shape / block_size) + (bins,)).
struct HistogramInputs {
  at::Tensor x, lo, hi;
  BlockLayout layout;
  int64_t nblocks;
  std::vector<int64_t> counts_shape;
};

// Checks x, block_size, lo and hi (fp32 on x's device, shape
// ceil(x.shape / block_size), size-1 dimensions optional) and bins (in
// [1, kMaxHistogramBins]).
HistogramInputs check_histogram_args(const char* op, const at::Tensor& x,
                                     at::IntArrayRef block_size, const at::Tensor& lo,
                                     const at::Tensor& hi, int64_t bins);

}  // namespace pt2e_fq
