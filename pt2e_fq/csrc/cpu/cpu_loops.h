// Building blocks of the CPU kernels: element loads and stores in fp32
// registers, mask packing, and the chunked parallel loop.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "pt2e_fq/float_ops.h"

// Compile hot loops for several instruction sets and pick one at load time,
// so one binary runs everywhere and still uses AVX2/AVX-512 where present.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PT2E_FQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PT2E_FQ_CLONES
#endif

namespace pt2e_fq::cpu {

// Elements per chunk: the unit of parallel work and of the scratch buffers.
// A multiple of 8, so each chunk owns whole bytes of the packed mask.
constexpr int64_t kChunk = 4096;

inline float load_f32(float v) { return v; }
inline float load_f32(c10::BFloat16 v) { return bf16_bits_to_float(v.x); }
inline float load_f32(c10::Half v) { return half_bits_to_float(v.x); }

template <typename T>
inline T store_as(float v);
template <>
inline float store_as<float>(float v) { return v; }
template <>
inline c10::BFloat16 store_as<c10::BFloat16>(float v) {
  return c10::BFloat16(float_to_bf16_bits(v), c10::BFloat16::from_bits());
}
template <>
inline c10::Half store_as<c10::Half>(float v) {
  return c10::Half(float_to_half_bits(v), c10::Half::from_bits());
}

// Packs n 0/1 bytes into ceil(n / 8) bytes, least significant bit first.
PT2E_FQ_CLONES inline void pack_bits(const uint8_t* flags, int64_t n, uint8_t* out) {
  const int64_t full = n / 8;
  for (int64_t b = 0; b < full; ++b) {
    const uint8_t* f = flags + 8 * b;
    out[b] = static_cast<uint8_t>(f[0] | f[1] << 1 | f[2] << 2 | f[3] << 3 | f[4] << 4 |
                                  f[5] << 5 | f[6] << 6 | f[7] << 7);
  }
  if (n % 8) {
    uint8_t last = 0;
    for (int64_t i = 8 * full; i < n; ++i) last |= flags[i] << (i - 8 * full);
    out[full] = last;
  }
}

// Calls fn(begin, end, flags) for chunks [begin, end) of [0, numel) in
// parallel; fn fills flags[0 .. end-begin) with 0/1 and the flags are packed
// into mask bytes begin/8 onwards.
template <typename Fn>
void for_each_chunk(int64_t numel, uint8_t* mask, const Fn& fn) {
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  at::parallel_for(0, nchunks, 4, [&](int64_t c0, int64_t c1) {
    alignas(64) uint8_t flags[kChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * kChunk;
      const int64_t end = std::min(numel, begin + kChunk);
      fn(begin, end, flags);
      pack_bits(flags, end - begin, mask + begin / 8);
    }
  });
}

}  // namespace pt2e_fq::cpu
