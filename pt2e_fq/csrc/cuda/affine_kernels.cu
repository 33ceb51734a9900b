// CUDA kernel of pt2e_fq::fake_quantize_affine. Plain CUDA C++: no torch.
//
// Each warp takes tiles of 32 * VEC consecutive elements (VEC = 16 bytes of
// x) in a grid-stride loop with 64-bit indices: one vector load per lane,
// the shared per-element math of affine.h, one vector store, and the mask
// packed with warp ballots. The last, partial tile goes element by element.
#include "elementwise.cuh"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"

namespace pt2e_fq::cuda {
namespace {

// How the elements of one vector find their qparams.
enum class BlockLookup {
  kSingle,     // one block for the whole tensor (per-tensor)
  kPerVector,  // every vector lies inside one block
  kPerElement  // blocks narrower than a vector, or misaligned
};

struct ElementQparams {
  float scale, ioff, foff;
};

__device__ __forceinline__ ElementQparams qparams_at(const AffineQparams& q, int64_t b) {
  return {q.scale[b], q.ioff_at(b), q.foff_at(b)};
}

__device__ __forceinline__ float apply(float v, const ElementQparams& p, const AffineQparams& q,
                                       bool& in_range) {
  return fake_quantize_affine_one(v, p.scale, p.ioff, p.foff, q.qmin, q.qmax, in_range);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    affine_kernel(const T* __restrict__ x, T* __restrict__ y, uint32_t* __restrict__ mask,
                  int64_t numel, AffineQparams q, BlockLayout layout, BlockLookup lookup) {
  constexpr int kTile = 32 * VEC;
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t num_tiles = (numel + kTile - 1) / kTile;
  const ElementQparams single =
      lookup == BlockLookup::kSingle ? qparams_at(q, 0) : ElementQparams{1.0f, 0.0f, 0.0f};

  for (int64_t tile = first_warp; tile < num_tiles; tile += num_warps) {
    const int64_t base = tile * kTile;
    if (base + kTile <= numel) {
      const int64_t i0 = base + static_cast<int64_t>(lane) * VEC;
      T in[VEC], out[VEC];
      load_vec<T, VEC>(x + i0, in);
      ElementQparams p = single;
      if (lookup == BlockLookup::kPerVector) p = qparams_at(q, scale_offset(layout, i0));
      uint32_t bits = 0;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (lookup == BlockLookup::kPerElement) p = qparams_at(q, scale_offset(layout, i0 + k));
        bool in_range;
        out[k] = from_f32<T>(apply(to_f32(in[k]), p, q, in_range));
        bits |= static_cast<uint32_t>(in_range) << k;
      }
      store_vec<T, VEC>(y + i0, out);
      write_tile_mask<VEC>(bits, lane, mask + base / 32);
    } else {
      // Partial tile: lane l takes elements base + 32k + l, so each ballot
      // is one mask word in element order.
      for (int k = 0; k < VEC; ++k) {
        const int64_t word_base = base + 32 * k;
        if (word_base >= numel) break;  // warp-uniform
        const int64_t i = word_base + lane;
        bool in_range = false;
        if (i < numel) {
          const ElementQparams p =
              lookup == BlockLookup::kSingle ? single : qparams_at(q, scale_offset(layout, i));
          y[i] = from_f32<T>(apply(to_f32(x[i]), p, q, in_range));
        }
        const uint32_t word = __ballot_sync(0xFFFFFFFFu, in_range);
        if (lane == 0) mask[word_base / 32] = word;
      }
    }
  }
}

template <typename T, int VEC>
void launch(const void* x, void* y, uint32_t* mask, int64_t numel, const AffineQparams& q,
            const BlockLayout& layout, BlockLookup lookup, cudaStream_t stream) {
  const int64_t tiles = (numel + 32 * VEC - 1) / (32 * VEC);
  affine_kernel<T, VEC><<<grid_size(tiles * 32), kThreads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<T*>(y), mask, numel, q, layout, lookup);
}

template <typename T>
void launch_typed(const void* x, void* y, uint32_t* mask, int64_t numel, const AffineQparams& q,
                  const BlockLayout& layout, cudaStream_t stream) {
  constexpr int V = kVec<T>;
  const int last = layout.ndim - 1;
  int64_t blocks = 1;
  for (int d = 0; d < layout.ndim; ++d) blocks *= (layout.size[d] + layout.block[d] - 1) / layout.block[d];
  // A vector starts at a multiple of V; it stays in one block when rows and
  // blocks along the last dimension are multiples of V.
  const bool vector_in_block = layout.size[last] % V == 0 && layout.block[last] % V == 0;
  const BlockLookup lookup = blocks == 1        ? BlockLookup::kSingle
                             : vector_in_block ? BlockLookup::kPerVector
                                               : BlockLookup::kPerElement;
  if (aligned16(x) && aligned16(y)) {
    launch<T, V>(x, y, mask, numel, q, layout, lookup, stream);
  } else {
    launch<T, 1>(x, y, mask, numel, q, layout,
                 lookup == BlockLookup::kPerVector ? BlockLookup::kPerElement : lookup, stream);
  }
}

}  // namespace

cudaError_t launch_fake_quantize_affine(ElemType type, const void* x, void* y,
                                        uint32_t* mask_words, int64_t numel,
                                        const AffineQparams& qparams, const BlockLayout& layout,
                                        cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  switch (type) {
    case ElemType::kFloat32:
      launch_typed<float>(x, y, mask_words, numel, qparams, layout, stream);
      break;
    case ElemType::kBFloat16:
      launch_typed<Bf16>(x, y, mask_words, numel, qparams, layout, stream);
      break;
    case ElemType::kFloat16:
      launch_typed<__half>(x, y, mask_words, numel, qparams, layout, stream);
      break;
  }
  return cudaGetLastError();
}

}  // namespace pt2e_fq::cuda
