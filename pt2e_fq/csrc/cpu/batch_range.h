// The per-block range of a batch on the CPU: each block's finite min / max
// and the count of non-finite values in one pass over x, shared by the fused
// observe ops (observe_cpu.cpp) and block_finite_range (histogram_cpu.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "cpu_loops.h"
#include "float_dtype.h"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/observe.h"

namespace pt2e_fq::cpu {

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
inline void batch_range(const at::Tensor& x, const BlockLayout& L, int64_t nblocks,
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

}  // namespace pt2e_fq::cpu
