// CUDA kernels of the backward of pt2e_fq::fake_quantize_affine_learnable
// (LSQ / LSQ+; its forward is the affine kernel). Plain CUDA C++: no torch.
//
// The per-block sums are deterministic: their order depends on the sizes
// only, never on the GPU or the grid. Work item (b, j) is slice j of block
// b's elements (kSlice of them, the block read row-major); one warp does it,
// lane l taking the slice's elements l, l + 32, ... in order, then the lanes
// combine by a butterfly (every lane ends with the same bits). Partials land
// at partial[b * slices + j]; a second kernel adds them in j order and
// applies the block's grad_factor.
#include "elementwise.cuh"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"

namespace pt2e_fq::cuda {
namespace {

constexpr int64_t kSlice = 32 * 64;

int64_t block_count(const BlockLayout& L) {
  int64_t n = 1;
  for (int d = 0; d < L.ndim; ++d) n *= (L.size[d] + L.block[d] - 1) / L.block[d];
  return n;
}

// Slices of the largest (first, never ragged) block.
int64_t slices_per_block(const BlockLayout& L) {
  int64_t largest = 1;
  for (int d = 0; d < L.ndim; ++d) largest *= L.block[d] < L.size[d] ? L.block[d] : L.size[d];
  return (largest + kSlice - 1) / kSlice;
}

// Block b of layout L: its first element's coordinates and its extents (the
// last block of a dimension may be shorter).
struct BlockSpan {
  int64_t origin[kMaxLayoutDims], extent[kMaxLayoutDims], count;

  __device__ BlockSpan(const BlockLayout& L, int64_t b) : count(1) {
    for (int d = 0; d < L.ndim; ++d) {
      const int64_t nblk = (L.size[d] + L.block[d] - 1) / L.block[d];
      origin[d] = (b / L.scale_stride[d]) % nblk * L.block[d];
      const int64_t left = L.size[d] - origin[d];
      extent[d] = left < L.block[d] ? left : L.block[d];
      count *= extent[d];
    }
  }

  // The flat index in x of the block's k-th element (row-major in the block).
  __device__ int64_t element(const BlockLayout& L, int64_t k) const {
    int64_t i = 0, stride = 1;
    for (int d = L.ndim - 1; d >= 0; --d) {
      i += (origin[d] + k % extent[d]) * stride;
      k /= extent[d];
      stride *= L.size[d];
    }
    return i;
  }
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = add_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    lsq_backward_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                        AffineQparams q, BlockLayout L, int64_t items, int64_t slices,
                        float* __restrict__ partial_scale, float* __restrict__ partial_outside) {
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t w = first_warp; w < items; w += num_warps) {  // warp-uniform
    const int64_t b = w / slices, j = w % slices;
    const BlockSpan span(L, b);
    const float s = q.scale[b], io = q.ioff_at(b), fo = q.foff_at(b);
    const int64_t end = span.count < (j + 1) * kSlice ? span.count : (j + 1) * kSlice;
    float s_sum = 0.0f, o_sum = 0.0f;
    for (int64_t k = j * kSlice + lane; k < end; k += 32) {
      const int64_t i = span.element(L, k);
      float ds, out;
      dx[i] = from_f32<T>(
          lsq_grads_one(to_f32(x[i]), to_f32(dy[i]), s, io, fo, q.qmin, q.qmax, ds, out));
      s_sum = add_rn(s_sum, ds);
      o_sum = add_rn(o_sum, out);
    }
    s_sum = warp_sum(s_sum);
    o_sum = warp_sum(o_sum);
    if (lane == 0) {
      partial_scale[w] = s_sum;
      partial_outside[w] = o_sum;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    lsq_finish_kernel(const float* __restrict__ partial_scale,
                      const float* __restrict__ partial_outside, int64_t nblocks, int64_t slices,
                      AffineQparams q, BlockLayout L, bool minval_offset,
                      GradFactor grad_factor, float* __restrict__ dscale,
                      float* __restrict__ doffset) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nblocks;
       b += stride) {
    float s_sum = 0.0f, o_sum = 0.0f;
    for (int64_t j = 0; j < slices; ++j) {
      s_sum = add_rn(s_sum, partial_scale[b * slices + j]);
      o_sum = add_rn(o_sum, partial_outside[b * slices + j]);
    }
    // d offset: minval's (y moves with it outside the range) or a zero
    // point's (y moves by -scale per step there).
    const float gf = grad_factor.for_block(block_numel_at(L, b));
    dscale[b] = mul_rn(gf, s_sum);
    doffset[b] = mul_rn(gf, minval_offset ? o_sum : -mul_rn(q.scale[b], o_sum));
  }
}

}  // namespace

int64_t learnable_backward_scratch_floats(const BlockLayout& layout) {
  return 2 * block_count(layout) * slices_per_block(layout);
}

cudaError_t launch_fake_quantize_affine_learnable_backward(
    ElemType type, const void* x, const void* dy, void* dx, int64_t numel,
    const AffineQparams& qparams, const BlockLayout& layout, bool minval_offset,
    const GradFactor& grad_factor, float* scratch, float* dscale, float* doffset,
    cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  const int64_t nblocks = block_count(layout);
  const int64_t slices = slices_per_block(layout);
  const int64_t items = nblocks * slices;
  float* partial_scale = scratch;
  float* partial_outside = scratch + items;
  dispatch_elem_type(type, [&](auto tag) {
    using T = decltype(tag);
    launch(lsq_backward_kernel<T>, grid_size(items * 32), kThreads, stream,
           static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), qparams,
           layout, items, slices, partial_scale, partial_outside);
  });
  launch(lsq_finish_kernel, grid_size(nblocks), kThreads, stream,
         static_cast<const float*>(partial_scale), static_cast<const float*>(partial_outside),
         nblocks, slices, qparams, layout, minval_offset, grad_factor, dscale, doffset);
  return cudaGetLastError();
}

}  // namespace pt2e_fq::cuda
