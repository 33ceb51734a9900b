// CUDA kernels of the fused observe-and-fake-quantize ops. Plain CUDA C++:
// no torch. Three launches on one stream, no host sync: (1) each block's
// finite min / max as order-preserving integers with atomicMin / atomicMax
// (min and max do not depend on the order) and the non-finite count;
// (2) one thread per block: the range update and the qparams (observe.h,
// the CPU kernel's math); (3) the static op's kernel on the new qparams.
#include "elementwise.cuh"
#include "kernels.h"
#include "pt2e_fq/observe.h"

namespace pt2e_fq::cuda {
namespace {

// Each thread folds runs of kRun consecutive elements, flushing its partial
// range with one atomic per block it touched: per-tensor and per-channel
// blocks get one atomic per run, not per element.
constexpr int64_t kRun = 16;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    block_range_kernel(const T* __restrict__ x, int64_t numel, BlockLayout L,
                       uint32_t* __restrict__ lo, uint32_t* __restrict__ hi,
                       unsigned long long* __restrict__ nonfinite) {
  const int64_t runs = (numel + kRun - 1) / kRun;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < runs;
       r += stride) {
    const int64_t end = min(numel, (r + 1) * kRun);
    int64_t block = -1;
    uint32_t l = kMinIdentity, h = kMaxIdentity;
    for (int64_t i = r * kRun; i < end; ++i) {
      const int64_t b = scale_offset(L, i);
      if (b != block) {
        if (block >= 0 && l != kMinIdentity) {
          atomicMin(lo + block, l);
          atomicMax(hi + block, h);
        }
        block = b;
        l = kMinIdentity;
        h = kMaxIdentity;
      }
      const float v = to_f32(x[i]);
      if (isfinite(v)) {
        const uint32_t o = ordered(v);
        l = min(l, o);
        h = max(h, o);
      } else {
        ++bad;
      }
    }
    if (block >= 0 && l != kMinIdentity) {
      atomicMin(lo + block, l);
      atomicMax(hi + block, h);
    }
  }
  if (bad) atomicAdd(nonfinite, bad);
}

// A batch block's range; one with no finite value kept the identities and
// reads as the empty range (+inf, -inf), as block_min_max gives it.
__device__ __forceinline__ void batch_block(const uint32_t* lo, const uint32_t* hi, int64_t b,
                                            float& blo, float& bhi) {
  blo = lo[b] == kMinIdentity ? INFINITY : unordered(lo[b]);
  bhi = hi[b] == kMaxIdentity ? -INFINITY : unordered(hi[b]);
}

struct AffineQparamsOut {
  AffineRangeParams p;
  float* scale;
  int32_t* zero_point;  // ZP schemes
  float* minval;        // MINVAL
  float* ioff;          // the zero point as fp32, for the fake-quant kernel (ZP schemes)
};

struct FloatQparamsOut {
  float fmax;
  float* scale;
};

__device__ __forceinline__ void write_qparams(const AffineQparamsOut& o, int64_t b, float lo,
                                              float hi) {
  int32_t zp;
  float minval;
  affine_qparams_from_range(o.p, lo, hi, o.scale[b], zp, minval);
  if (o.p.scheme == AffineScheme::kMinval) {
    o.minval[b] = minval;
  } else {
    o.zero_point[b] = zp;
    o.ioff[b] = static_cast<float>(zp);
  }
}

__device__ __forceinline__ void write_qparams(const FloatQparamsOut& o, int64_t b, float lo,
                                              float hi) {
  o.scale[b] = float_scale_from_range(lo, hi, o.fmax);
}

template <typename Out>
__global__ void __launch_bounds__(kThreads)
    update_kernel(int64_t nblocks, const uint32_t* __restrict__ batch_lo,
                  const uint32_t* __restrict__ batch_hi, RangeUpdate u, float* __restrict__ min_val,
                  float* __restrict__ max_val, const unsigned long long* __restrict__ batch_bad,
                  int64_t* __restrict__ nonfinite, Out out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) *nonfinite += static_cast<int64_t>(*batch_bad);
  for (int64_t b = first; b < nblocks; b += stride) {
    float blo, bhi;
    batch_block(batch_lo, batch_hi, b, blo, bhi);
    float lo = min_val[b], hi = max_val[b];
    update_range(u, blo, bhi, lo, hi);
    min_val[b] = lo;
    max_val[b] = hi;
    nonempty_range(lo, hi);
    write_qparams(out, b, lo, hi);
  }
}

// (1) and (2): scratch holds the batch range (2 * nblocks words) and, after
// it, the count (one 64-bit word: 2 * nblocks is even, so it is aligned).
template <typename Out>
cudaError_t observe(ElemType type, const void* x, int64_t numel, const BlockLayout& layout,
                    int64_t nblocks, const RangeUpdate& update, float* min_val, float* max_val,
                    int64_t* nonfinite, const Out& out, uint32_t* scratch, cudaStream_t stream) {
  uint32_t* lo = scratch;
  uint32_t* hi = scratch + nblocks;
  auto* bad = reinterpret_cast<unsigned long long*>(scratch + 2 * nblocks);
  cudaError_t err = cudaMemsetAsync(lo, 0xFF, nblocks * sizeof(uint32_t), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(hi, 0, nblocks * sizeof(uint32_t), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(bad, 0, sizeof(*bad), stream);
  if (err != cudaSuccess) return err;
  if (numel > 0) {
    dispatch_elem_type(type, [&](auto tag) {
      using T = decltype(tag);
      launch(block_range_kernel<T>, grid_size((numel + kRun - 1) / kRun), kThreads, stream,
             static_cast<const T*>(x), numel, layout, lo, hi, bad);
    });
  }
  launch(update_kernel<Out>, grid_size(nblocks), kThreads, stream, nblocks,
         static_cast<const uint32_t*>(lo), static_cast<const uint32_t*>(hi), update, min_val,
         max_val, static_cast<const unsigned long long*>(bad), nonfinite, out);
  return cudaGetLastError();
}

}  // namespace

int64_t observe_scratch_words(int64_t nblocks) { return 2 * nblocks + 2; }

cudaError_t launch_fake_quantize_affine_observe(
    ElemType type, const void* x, void* y, uint32_t* mask_words, int64_t numel,
    const BlockLayout& layout, int64_t nblocks, const RangeUpdate& update,
    const AffineRangeParams& params, float* min_val, float* max_val, float* scale,
    int32_t* zero_point, float* minval, float* ioff, int64_t* nonfinite, uint32_t* scratch,
    cudaStream_t stream) {
  const AffineQparamsOut out{params, scale, zero_point, minval, ioff};
  cudaError_t err = observe(type, x, numel, layout, nblocks, update, min_val, max_val, nonfinite,
                            out, scratch, stream);
  if (err != cudaSuccess) return err;
  const bool is_minval = params.scheme == AffineScheme::kMinval;
  const AffineQparams q = make_affine_qparams(scale, is_minval ? nullptr : ioff,
                                              is_minval ? minval : nullptr, params.quant_min,
                                              params.quant_max);
  return launch_fake_quantize_affine(type, x, y, mask_words, numel, q, layout, stream);
}

cudaError_t launch_fake_quantize_float_observe(ElemType type, ElemFormat format, const void* x,
                                               void* y, uint32_t* mask_words, int64_t numel,
                                               const BlockLayout& layout, int64_t nblocks,
                                               const RangeUpdate& update, float* min_val,
                                               float* max_val, float* scale, int64_t* nonfinite,
                                               uint32_t* scratch, cudaStream_t stream) {
  float fmax = 0.0f;
  dispatch_elem_format(format, [&](auto ftag) { fmax = Elem<decltype(ftag)::value>::fmax; });
  cudaError_t err = observe(type, x, numel, layout, nblocks, update, min_val, max_val, nonfinite,
                            FloatQparamsOut{fmax, scale}, scratch, stream);
  if (err != cudaSuccess) return err;
  return launch_fake_quantize_float(type, format, x, y, mask_words, numel, scale, layout, stream);
}

}  // namespace pt2e_fq::cuda
