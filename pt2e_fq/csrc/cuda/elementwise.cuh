// Device helpers shared by the CUDA kernels: element types held as raw bits,
// 16-byte vector loads and stores, the launch shape, and warp-ballot packing
// of the clamp mask.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"
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

}  // namespace pt2e_fq::cuda
