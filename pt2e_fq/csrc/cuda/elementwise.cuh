// Device helpers shared by the CUDA kernels: element types held as raw bits,
// 16-byte vector loads and stores, the launch shape, warp-ballot packing of
// the clamp mask, and the kernel of every op whose scales come per block of
// a BlockLayout (affine, static-scale float formats).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels.h"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_ops.h"

namespace pt2e_fq::cuda {

// Storage types. bfloat16 converts by the same bit manipulation as the CPU
// kernels (float_ops.h), so both round identically.
struct Bf16 {
  uint16_t bits;
};

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(Bf16 v) { return bf16_bits_to_float(v.bits); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ Bf16 from_f32<Bf16>(float v) { return Bf16{float_to_bf16_bits(v)}; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// Calls fn(T{}) with T the storage type of `type`.
template <typename Fn>
void dispatch_elem_type(ElemType type, const Fn& fn) {
  switch (type) {
    case ElemType::kFloat32:
      return fn(float{});
    case ElemType::kBFloat16:
      return fn(Bf16{});
    case ElemType::kFloat16:
      return fn(__half{});
  }
}

// Elements per 16-byte vector.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, T (&v)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(v, &raw, 16);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = p[k];
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const T (&v)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 raw;
    memcpy(&raw, v, 16);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = v[k];
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

constexpr int kThreads = 256;

// Enough blocks to fill the device a few times over; grid-stride loops do
// the rest, so the grid never depends on a 2^31 limit.
inline int grid_size(int64_t work_items) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t wanted = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms > 0 ? sms : 1) * 8;
  return static_cast<int>(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

// kernel<<<grid, block, 0, stream>>>(args...). The one place that launches:
// under nvcc the launch syntax; in the CUDA simulation harness of the tests
// (tests/cuda_sim, which compiles these files as host C++) its launcher.
template <typename... Params, typename... Args>
inline void launch(void (*kernel)(Params...), int grid, int block, cudaStream_t stream,
                   Args... args) {
#if defined(PT2E_FQ_CUDA_SIM)
  cuda_sim::launch(kernel, grid, block, stream, args...);
#else
  kernel<<<grid, block, 0, stream>>>(args...);
#endif
}

// Moves bit m of the low 32/VEC bits of x to bit m * VEC.
template <int VEC>
__device__ __forceinline__ uint32_t spread_bits(uint32_t x) {
  if constexpr (VEC == 1) {
    return x;
  } else if constexpr (VEC == 4) {  // 8 bits -> every 4th bit
    x &= 0xFFu;
    x = (x | (x << 12)) & 0x000F000Fu;
    x = (x | (x << 6)) & 0x03030303u;
    return (x | (x << 3)) & 0x11111111u;
  } else {
    static_assert(VEC == 8, "vectors of 1, 4 or 8 elements");
    x &= 0xFu;  // 4 bits -> every 8th bit
    x = (x | (x << 14)) & 0x00030003u;
    return (x | (x << 7)) & 0x01010101u;
  }
}

// A warp holds a tile of 32 * VEC consecutive elements, lane l elements
// l*VEC .. l*VEC+VEC-1, their mask bits in `bits` (bit k = element l*VEC+k).
// One ballot per k gathers bit k of every lane; lane w < VEC then assembles
// word w (elements 32w .. 32w+31) and writes it: VEC coalesced words a tile.
template <int VEC>
__device__ __forceinline__ void write_tile_mask(uint32_t bits, int lane, uint32_t* tile_words) {
  constexpr int kLanesPerWord = 32 / VEC;
  uint32_t ballots[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) ballots[k] = __ballot_sync(0xFFFFFFFFu, (bits >> k) & 1u);
  if (lane < VEC) {
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      word |= spread_bits<VEC>(ballots[k] >> (lane * kLanesPerWord)) << k;
    }
    tile_words[lane] = word;
  }
}

// ---------------------------------------------------------------------------
// y = op(x, qparams of x's block) with the packed mask, for any BlockLayout.
//
// A warp takes tiles of U * 32 * VEC consecutive elements (VEC = 16 bytes of
// x) in a grid-stride loop with 64-bit indices. Lane l loads vectors
// l, 32 + l, ..., 32 (U-1) + l of the tile, all U before any math, so U
// 16-byte loads per lane are in flight at once (one load a lane left the
// memory system short of bytes in flight: benchmarks/RESULTS.md).
// Then the shared per-element math, U vector stores, and the mask of each
// 32 * VEC sub-tile packed with warp ballots. A last, partial tile goes
// vector by vector while whole sub-tiles remain, then element by element.
// U = 1 is the previous kernel (one vector a lane), kept for comparison
// (PT2E_FQ_CUDA_KERNELS=previous).
//
// Op is a small copyable functor: `Params at(int64_t block)` reads a block's
// qparams, `float apply(float x, const Params&, bool& in_range)` is the math.

// How the elements of one vector find their qparams.
enum class BlockLookup {
  kSingle,     // one block for the whole tensor (per-tensor)
  kPerVector,  // every vector lies inside one block
  kPerElement  // blocks narrower than a vector, or misaligned
};

// Vectors in flight per lane of the current kernels.
constexpr int kVectorsPerLane = 4;

// The launchers' choice: PT2E_FQ_CUDA_KERNELS=previous selects the kernels
// as they were before the latest rework (to time both in one process; read
// at every launch), anything else the current ones.
inline bool previous_kernels() {
  const char* v = std::getenv("PT2E_FQ_CUDA_KERNELS");
  return v != nullptr && std::strcmp(v, "previous") == 0;
}

// Applies op to the VEC elements of v in place (x in, y out), which start at
// the vector-aligned index i0; returns their mask bits.
template <typename T, int VEC, typename Op>
__device__ __forceinline__ uint32_t apply_vec(T (&v)[VEC], int64_t i0, const Op& op,
                                              const BlockLayout& layout, BlockLookup lookup,
                                              const typename Op::Params& single) {
  typename Op::Params p = single;
  if (lookup == BlockLookup::kPerVector) p = op.at(scale_offset(layout, i0));
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    if (lookup == BlockLookup::kPerElement) p = op.at(scale_offset(layout, i0 + k));
    bool in_range;
    v[k] = from_f32<T>(op.apply(to_f32(v[k]), p, in_range));
    bits |= static_cast<uint32_t>(in_range) << k;
  }
  return bits;
}

template <typename T, int VEC, int U, typename Op>
__global__ void __launch_bounds__(kThreads)
    blockwise_kernel(const T* __restrict__ x, T* __restrict__ y, uint32_t* __restrict__ mask,
                     int64_t numel, Op op, BlockLayout layout, BlockLookup lookup) {
  using Params = typename Op::Params;
  constexpr int kSub = 32 * VEC;  // a sub-tile: one vector per lane
  constexpr int kTile = U * kSub;
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t num_tiles = (numel + kTile - 1) / kTile;
  const Params single = lookup == BlockLookup::kSingle ? op.at(0) : Params{};

  for (int64_t tile = first_warp; tile < num_tiles; tile += num_warps) {
    const int64_t base = tile * kTile;
    if (base + kTile <= numel) {
      T v[U][VEC];
#pragma unroll
      for (int u = 0; u < U; ++u) load_vec<T, VEC>(x + base + (u * 32 + lane) * VEC, v[u]);
      uint32_t bits[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        bits[u] = apply_vec<T, VEC>(v[u], base + (u * 32 + lane) * VEC, op, layout, lookup, single);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) store_vec<T, VEC>(y + base + (u * 32 + lane) * VEC, v[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) write_tile_mask<VEC>(bits[u], lane, mask + (base + u * kSub) / 32);
    } else {
      // Partial tile: whole sub-tiles as above, one at a time (warp-uniform).
      int64_t sub = base;
      for (; sub + kSub <= numel; sub += kSub) {
        const int64_t i0 = sub + static_cast<int64_t>(lane) * VEC;
        T v[VEC];
        load_vec<T, VEC>(x + i0, v);
        const uint32_t bits = apply_vec<T, VEC>(v, i0, op, layout, lookup, single);
        store_vec<T, VEC>(y + i0, v);
        write_tile_mask<VEC>(bits, lane, mask + sub / 32);
      }
      // The rest: lane l takes elements sub + 32k + l, so each ballot is one
      // mask word in element order.
      for (int k = 0; k < VEC; ++k) {
        const int64_t word_base = sub + 32 * k;
        if (word_base >= numel) break;  // warp-uniform
        const int64_t i = word_base + lane;
        bool in_range = false;
        if (i < numel) {
          const Params p = lookup == BlockLookup::kSingle ? single : op.at(scale_offset(layout, i));
          y[i] = from_f32<T>(op.apply(to_f32(x[i]), p, in_range));
        }
        const uint32_t word = __ballot_sync(0xFFFFFFFFu, in_range);
        if (lane == 0) mask[word_base / 32] = word;
      }
    }
  }
}

template <typename T, int VEC, int U, typename Op>
void launch_blockwise_vec(const void* x, void* y, uint32_t* mask, int64_t numel, const Op& op,
                          const BlockLayout& layout, BlockLookup lookup, cudaStream_t stream) {
  const int64_t tiles = (numel + U * 32 * VEC - 1) / (U * 32 * VEC);
  launch(blockwise_kernel<T, VEC, U, Op>, grid_size(tiles * 32), kThreads, stream,
         static_cast<const T*>(x), static_cast<T*>(y), mask, numel, op, layout, lookup);
}

// Picks the vector width, the vectors per lane and the qparam lookup, and
// launches.
template <typename T, typename Op>
void launch_blockwise(const void* x, void* y, uint32_t* mask, int64_t numel, const Op& op,
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
    if (previous_kernels()) {
      launch_blockwise_vec<T, V, 1>(x, y, mask, numel, op, layout, lookup, stream);
    } else {
      launch_blockwise_vec<T, V, kVectorsPerLane>(x, y, mask, numel, op, layout, lookup, stream);
    }
  } else {
    launch_blockwise_vec<T, 1, 1>(x, y, mask, numel, op, layout,
                                  lookup == BlockLookup::kPerVector ? BlockLookup::kPerElement
                                                                    : lookup,
                                  stream);
  }
}

}  // namespace pt2e_fq::cuda
