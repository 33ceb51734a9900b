// CUDA kernels of the float-format ops: fake_quantize_float (static scales,
// through blockwise_kernel), and fake_quantize_mx / fake_quantize_nvfp4,
// whose block scales come from the data. Plain CUDA C++: no torch.
#include "elementwise.cuh"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"

namespace pt2e_fq::cuda {
namespace {

template <ElemFormat F>
struct FloatOp {
  using Params = float;
  const float* scale;
  __device__ __forceinline__ float at(int64_t b) const { return scale[b]; }
  __device__ __forceinline__ float apply(float v, float s, bool& in_range) const {
    return fake_quantize_float_one<F>(v, s, in_range);
  }
};

// How a format turns a block's amax into the scale it reports and the fp32
// scale its elements are divided by (as in the CPU kernels).
template <ElemFormat F>
struct MxScaling {
  static constexpr ElemFormat kElem = F;
  __device__ __forceinline__ float block_scale(float amax) const { return mx_block_scale<F>(amax); }
  __device__ __forceinline__ float element_scale(float s) const { return s; }
};

struct Nvfp4Scaling {
  static constexpr ElemFormat kElem = ElemFormat::kE2M1;
  const float* global_scale;  // device
  __device__ __forceinline__ float block_scale(float amax) const {
    return nvfp4_block_scale(amax, *global_scale);
  }
  __device__ __forceinline__ float element_scale(float s) const {
    return nvfp4_element_scale(s, *global_scale);
  }
};

// Collects the mask bits of elements visited in increasing order and ORs
// each finished 32-bit word into the mask: blocks need not start on a word,
// and neighbouring threads may share one.
struct MaskBits {
  uint32_t* mask;
  int64_t word = -1;
  uint32_t bits = 0;
  __device__ __forceinline__ void add(int64_t i, bool set) {
    if (i / 32 != word) flush();
    word = i / 32;
    bits |= static_cast<uint32_t>(set) << (i % 32);
  }
  __device__ __forceinline__ void flush() {
    if (bits) atomicOr(mask + word, bits);
    bits = 0;
  }
};

// One thread per block (outer, block along the axis, inner position), inner
// fastest: when blocks run along an outer axis (inner > 1) neighbouring
// threads read neighbouring addresses. The warp kernels below take the
// layouts they can. Pass one takes the block amax, pass
// two quantizes (the re-read hits the cache).
template <typename T, typename Scaling>
__global__ void __launch_bounds__(kThreads)
    block_scaled_kernel(const T* __restrict__ x, T* __restrict__ y, uint32_t* __restrict__ mask,
                        float* __restrict__ scales, AxisBlocks A, Scaling sc) {
  const int64_t nb = A.blocks_per_axis();
  const int64_t total = A.outer * nb * A.inner;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < total;
       w += stride) {
    const int64_t c = w % A.inner, g = w / A.inner, j = g % nb;  // g = outer * nb + j
    const int64_t n = min(A.block, A.len - j * A.block);
    const int64_t first = ((g / nb) * A.len + j * A.block) * A.inner + c;
    uint32_t amax = 0;
    for (int64_t t = 0; t < n; ++t) amax = max(amax, abs_bits(to_f32(x[first + t * A.inner])));
    const float block_scale = sc.block_scale(amax_from_bits(amax));
    scales[w] = block_scale;  // scales are [outer, nb, inner]: index g * inner + c
    const float s = sc.element_scale(block_scale);
    MaskBits m{mask};
    for (int64_t t = 0; t < n; ++t) {
      const int64_t i = first + t * A.inner;
      bool in_range;
      y[i] = from_f32<T>(fake_quantize_float_one<Scaling::kElem>(to_f32(x[i]), s, in_range));
      m.add(i, in_range);
    }
    m.flush();
  }
}

// Blocks along the innermost dimension (inner == 1) whose size is a power of
// two up to 32 (MX's 32, NVFP4's 16): a warp takes 32 / block blocks at a
// time, a lane per element, so its loads are coalesced (the kernel above
// gives each thread a whole block, and neighbouring threads read a block
// apart). Each group of `block` lanes takes its amax by a butterfly of
// shuffles; when the warp's elements are consecutive (no ragged block among
// them) one ballot gives their mask bits, else each lane sets its own.
template <typename T, typename Scaling>
__global__ void __launch_bounds__(kThreads)
    block_scaled_warp_kernel(const T* __restrict__ x, T* __restrict__ y,
                             uint32_t* __restrict__ mask, float* __restrict__ scales,
                             AxisBlocks A, Scaling sc) {
  const int lane = threadIdx.x & 31;
  const int64_t per_warp = 32 / A.block;
  const int64_t nb = A.blocks_per_axis();
  const int64_t total = A.outer * nb;
  const int64_t groups = (total + per_warp - 1) / per_warp;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t t = lane % A.block;  // the lane's element in its block
  for (int64_t group = first_warp; group < groups; group += num_warps) {  // warp-uniform
    const int64_t g = group * per_warp + lane / A.block;  // the lane's block: outer * nb + j
    const int64_t n = g < total ? min(A.block, A.len - (g % nb) * A.block) : 0;
    const bool active = t < n;
    const int64_t i = (g / nb) * A.len + (g % nb) * A.block + t;
    const float v = active ? to_f32(x[i]) : 0.0f;
    uint32_t amax = active ? abs_bits(v) : 0u;
    for (int offset = static_cast<int>(A.block) / 2; offset > 0; offset /= 2) {
      amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
    }
    const float block_scale = sc.block_scale(amax_from_bits(amax));
    bool in_range = false;
    if (active) {
      if (t == 0) scales[g] = block_scale;
      y[i] = from_f32<T>(
          fake_quantize_float_one<Scaling::kElem>(v, sc.element_scale(block_scale), in_range));
    }
    // Lane 0's element (always active when any lane is) starts the run.
    const int64_t g0 = group * per_warp;
    const int64_t i0 = (g0 / nb) * A.len + (g0 % nb) * A.block;
    const uint32_t bits = __ballot_sync(0xFFFFFFFFu, in_range);
    if (__ballot_sync(0xFFFFFFFFu, !active || i == i0 + lane) == 0xFFFFFFFFu) {
      if (lane == 0 && bits) {  // neighbouring warps may share the words: OR
        const int shift = static_cast<int>(i0 & 31);
        atomicOr(mask + (i0 >> 5), bits << shift);
        const uint32_t high = shift ? bits >> (32 - shift) : 0u;
        if (high) atomicOr(mask + (i0 >> 5) + 1, high);
      }
    } else if (in_range) {
      atomicOr(mask + (i >> 5), 1u << (i & 31));
    }
  }
}

// Blocks along an outer axis (inner > 1): a warp takes 32 consecutive
// block columns (w = block * inner + inner position, as in
// block_scaled_kernel), a lane each, so for every row t of the blocks the
// warp's loads and stores are consecutive addresses. Each lane finds its
// column's amax alone (no shuffle: a column is a whole block), with eight
// loads in flight; then row by row, one ballot gives the warp's mask bits
// and the first lane of each run of lanes in one block (a segment: its
// elements are consecutive) ORs the segment's bits into the mask, one or
// two words (block_scaled_kernel ORs one word per element here, its
// elements lying `inner` apart).
template <typename T, typename Scaling>
__global__ void __launch_bounds__(kThreads)
    block_scaled_column_kernel(const T* __restrict__ x, T* __restrict__ y,
                               uint32_t* __restrict__ mask, float* __restrict__ scales,
                               AxisBlocks A, Scaling sc) {
  constexpr int kInFlight = 8;
  const int lane = threadIdx.x & 31;
  const int64_t nb = A.blocks_per_axis();
  const int64_t total = A.outer * nb * A.inner;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t w0 = first_warp * 32; w0 < total; w0 += num_warps * 32) {  // warp-uniform
    const int64_t w = w0 + lane;
    const int64_t c = w % A.inner, g = w / A.inner, j = g % nb;  // g = outer * nb + j
    const int64_t n = w < total ? min(A.block, A.len - j * A.block) : 0;
    const int64_t first = ((g / nb) * A.len + j * A.block) * A.inner + c;
    uint32_t amax = 0;
    for (int64_t t0 = 0; t0 < n; t0 += kInFlight) {
      float v[kInFlight];
#pragma unroll
      for (int k = 0; k < kInFlight; ++k) {
        v[k] = t0 + k < n ? to_f32(x[first + (t0 + k) * A.inner]) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kInFlight; ++k) amax = max(amax, abs_bits(v[k]));
    }
    const float block_scale = sc.block_scale(amax_from_bits(amax));
    if (n > 0) scales[w] = block_scale;  // scales are [outer, nb, inner]: index g * inner + c
    const float s = sc.element_scale(block_scale);
    // The lane's segment: itself and the following lanes of the same block.
    const bool leads = lane == 0 || c == 0;
    const int64_t seg_len = min(A.inner - c, static_cast<int64_t>(32 - lane));
    const uint32_t seg_mask = seg_len >= 32 ? 0xFFFFFFFFu : (1u << seg_len) - 1u;
    for (int64_t t = 0; t < A.block; ++t) {  // warp-uniform bound: the ballot needs every lane
      const int64_t i = first + t * A.inner;
      bool in_range = false;
      if (t < n) {
        y[i] = from_f32<T>(fake_quantize_float_one<Scaling::kElem>(to_f32(x[i]), s, in_range));
      }
      const uint32_t bits = (__ballot_sync(0xFFFFFFFFu, in_range) >> lane) & seg_mask;
      if (leads && bits) {  // neighbouring warps may share the words: OR
        const int shift = static_cast<int>(i & 31);
        atomicOr(mask + (i >> 5), bits << shift);
        const uint32_t high = shift ? bits >> (32 - shift) : 0u;
        if (high) atomicOr(mask + (i >> 5) + 1, high);
      }
    }
  }
}

// The current kernels: the warp kernels where blocks run along the last axis
// with a power-of-two size up to 32, or along an outer axis; else one thread
// a block. PT2E_FQ_CUDA_KERNELS=previous: block_scaled_kernel for blocks
// along an outer axis too, as before the column kernel.
template <typename T, typename Scaling>
void launch_block_scaled(const void* x, void* y, uint32_t* mask, float* scales,
                         const AxisBlocks& A, const Scaling& sc, cudaStream_t stream) {
  const bool warp_blocks = A.inner == 1 && A.block <= 32 && (A.block & (A.block - 1)) == 0;
  const int64_t columns = A.outer * A.blocks_per_axis() * A.inner;
  if (warp_blocks) {
    const int64_t groups = (A.outer * A.blocks_per_axis() + 32 / A.block - 1) / (32 / A.block);
    launch(block_scaled_warp_kernel<T, Scaling>, grid_size(groups * 32), kThreads, stream,
           static_cast<const T*>(x), static_cast<T*>(y), mask, scales, A, sc);
  } else if (A.inner > 1 && !previous_kernels()) {
    launch(block_scaled_column_kernel<T, Scaling>, grid_size((columns + 31) / 32 * 32), kThreads,
           stream, static_cast<const T*>(x), static_cast<T*>(y), mask, scales, A, sc);
  } else {
    launch(block_scaled_kernel<T, Scaling>, grid_size(columns), kThreads, stream,
           static_cast<const T*>(x), static_cast<T*>(y), mask, scales, A, sc);
  }
}

// max |x| as bits (abs_bits) into *out, which starts at 0.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    max_abs_bits_kernel(const T* __restrict__ x, int64_t numel, uint32_t* out) {
  uint32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    m = max(m, abs_bits(to_f32(x[i])));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
  if ((threadIdx.x & 31) == 0 && m) atomicMax(out, m);
}

__global__ void nvfp4_global_scale_kernel(const uint32_t* amax_bits, float* global_scale) {
  *global_scale = nvfp4_global_scale(amax_from_bits(*amax_bits));
}

}  // namespace

cudaError_t launch_fake_quantize_float(ElemType type, ElemFormat format, const void* x, void* y,
                                       uint32_t* mask_words, int64_t numel, const float* scale,
                                       const BlockLayout& layout, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  dispatch_elem_type(type, [&](auto tag) {
    dispatch_elem_format(format, [&](auto ftag) {
      launch_blockwise<decltype(tag)>(x, y, mask_words, numel,
                                      FloatOp<decltype(ftag)::value>{scale}, layout, stream);
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_fake_quantize_mx(ElemType type, ElemFormat format, const void* x, void* y,
                                    uint32_t* mask_words, float* scales, const AxisBlocks& blocks,
                                    cudaStream_t stream) {
  if (blocks.outer * blocks.len * blocks.inner == 0) return cudaSuccess;
  dispatch_elem_type(type, [&](auto tag) {
    dispatch_elem_format(format, [&](auto ftag) {
      launch_block_scaled<decltype(tag)>(x, y, mask_words, scales, blocks,
                                         MxScaling<decltype(ftag)::value>{}, stream);
    });
  });
  return cudaGetLastError();
}

cudaError_t launch_fake_quantize_nvfp4(ElemType type, const void* x, void* y,
                                       uint32_t* mask_words, float* scales, float* global_scale,
                                       uint32_t* amax_scratch, const AxisBlocks& blocks,
                                       cudaStream_t stream) {
  const int64_t numel = blocks.outer * blocks.len * blocks.inner;
  dispatch_elem_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (amax_scratch != nullptr) {
      if (numel > 0) {
        launch(max_abs_bits_kernel<T>, grid_size(numel), kThreads, stream, static_cast<const T*>(x),
               numel, amax_scratch);
      }
      launch(nvfp4_global_scale_kernel, 1, 1, stream, amax_scratch, global_scale);
    }
    if (numel > 0) {
      launch_block_scaled<T>(x, y, mask_words, scales, blocks, Nvfp4Scaling{global_scale}, stream);
    }
  });
  return cudaGetLastError();
}

}  // namespace pt2e_fq::cuda
