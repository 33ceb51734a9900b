// Building blocks of the CPU kernels: element loads and stores in fp32
// registers, mask packing, and the chunked parallel loop.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "float_dtype.h"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"
#include "pt2e_fq/float_ops.h"

// Compile hot loops for several instruction sets and pick one at load time,
// so one binary runs everywhere and still uses AVX2/AVX-512 where present.
// The AVX-512 clone is x86-64-v4 (F, BW, DQ, VL: every AVX-512 CPU but Xeon
// Phi), not plain avx512f: without BW and VL, GCC keeps loops that also
// store bytes (the mask) or 16-bit values (bf16, fp16) on 256-bit vectors.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PT2E_FQ_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
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

// The hot loop of the single-scale kernels: y[i] = Q::one(x[i], scale, flag)
// with one scale for the run, or scale[i] per element (kPerElement).
template <typename Q, typename T, bool kPerElement>
PT2E_FQ_CLONES void scaled_run(const T* __restrict__ x, T* __restrict__ y,
                               uint8_t* __restrict__ flags, int64_t n,
                               const float* __restrict__ scale) {
  for (int64_t i = 0; i < n; ++i) {
    bool in_range;
    y[i] = store_as<T>(Q::one(load_f32(x[i]), scale[kPerElement ? i : 0], in_range));
    flags[i] = in_range;
  }
}

// The element quantizer of scaled_run for the float formats.
template <ElemFormat F>
struct FloatElem {
  static float one(float x, float scale, bool& in_range) {
    return fake_quantize_float_one<F>(x, scale, in_range);
  }
};

// The bits of max |x[i]| over n elements (see abs_bits / amax_from_bits).
template <typename T>
PT2E_FQ_CLONES uint32_t max_abs_bits(const T* __restrict__ x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = abs_bits(load_f32(x[i]));
    m = a > m ? a : m;
  }
  return m;
}

// Packs n 0/1 bytes into ceil(n / 8) bytes, least significant bit first.
// Eight flags read as one little-endian word w hold flag j in bit 8j; the
// product w * 0x0102040810204080 sums flag j into bit 56 + j without carries
// (every partial product lands on its own bit), so its top byte is the
// packed byte: one multiply per 8 elements instead of 8 shifts and ORs.
PT2E_FQ_CLONES inline void pack_bits(const uint8_t* flags, int64_t n, uint8_t* out) {
  const int64_t full = n / 8;
  for (int64_t b = 0; b < full; ++b) {
    uint64_t w;
    memcpy(&w, flags + 8 * b, 8);
    out[b] = static_cast<uint8_t>((w * 0x0102040810204080ull) >> 56);
  }
  if (n % 8) {
    uint8_t last = 0;
    for (int64_t i = 8 * full; i < n; ++i) last |= flags[i] << (i - 8 * full);
    out[full] = last;
  }
}

// Calls fn(begin, end) for chunks [begin, end) of [0, numel) in parallel.
template <typename Fn>
void parallel_chunks(int64_t numel, const Fn& fn) {
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  at::parallel_for(0, nchunks, 4, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) fn(c * kChunk, std::min(numel, (c + 1) * kChunk));
  });
}

// Calls fn(begin, end, flags) for chunks [begin, end) of [0, numel) in
// parallel; fn fills flags[0 .. end-begin) with 0/1 and the flags are packed
// into mask bytes begin/8 onwards.
template <typename Fn>
void for_each_chunk(int64_t numel, uint8_t* mask, const Fn& fn) {
  parallel_chunks(numel, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t flags[kChunk];
    fn(begin, end, flags);
    pack_bits(flags, end - begin, mask + begin / 8);
  });
}

// The driver of the elementwise kernels: with T the C++ type of x's dtype,
// calls fn(const T* x, T* y, flags, begin, end) for the chunks of x (see
// for_each_chunk), x and y contiguous.
template <typename Fn>
void for_each_typed_chunk(const at::Tensor& x, at::Tensor& y, at::Tensor& mask, const Fn& fn) {
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    for_each_chunk(x.numel(), mask.data_ptr<uint8_t>(),
                   [&](int64_t begin, int64_t end, uint8_t* flags) {
                     fn(xp, yp, flags, begin, end);
                   });
  });
}

// Packs the 0/1 flags of elements [begin, begin + n) into their bits of the
// mask, for work units that do not start or end on a byte: bytes shared with
// a neighbouring unit are OR-ed in atomically, so the mask must start zeroed.
inline void pack_bits_at(const uint8_t* flags, int64_t begin, int64_t n, uint8_t* mask) {
  const int64_t end = begin + n;
  const auto or_bit = [&](int64_t i) {
    if (flags[i - begin]) __atomic_fetch_or(mask + i / 8, uint8_t(1u << (i % 8)), __ATOMIC_RELAXED);
  };
  // Up to the first byte boundary, whole bytes (owned by this unit), the tail.
  const int64_t head_end = std::min(end, (begin + 7) / 8 * 8);
  for (int64_t i = begin; i < head_end; ++i) or_bit(i);
  const int64_t whole = (end - head_end) / 8 * 8;
  pack_bits(flags + (head_end - begin), whole, mask + head_end / 8);
  for (int64_t i = head_end + whole; i < end; ++i) or_bit(i);
}

// Blocks shorter than this along the last dimension get per-element qparams
// gathered into scratch arrays instead of one kernel run per block.
constexpr int64_t kMinRun = 16;

// A run [i, i + n) of elements inside one row (one run of the last canonical
// dimension). Its first element uses qparam `b` and sits at offset `r` in its
// block of `blk` elements along the last dimension.
struct QparamRun {
  int64_t i, n, b, r, blk;
};

// Calls fn(run) for the runs of elements [begin, end) of a tensor with
// block layout L that lie in one row each.
template <typename Fn>
void for_each_row_run(const BlockLayout& L, int64_t begin, int64_t end, const Fn& fn) {
  const int64_t len = L.size[L.ndim - 1];
  const int64_t blk = L.block[L.ndim - 1];
  int64_t i = begin;
  while (i < end) {
    const int64_t row = i / len;
    const int64_t col = i - row * len;
    const int64_t row_end = std::min(end, (row + 1) * len);
    fn(QparamRun{i, row_end - i, row_scale_offset(L, row) + col / blk, col % blk, blk});
    i = row_end;
  }
}

// Calls fn(k, m, b) for the pieces [k, k + m) of a run (offsets in the run)
// that lie in one block, b being that block's qparam index.
template <typename Fn>
void for_each_block_piece(const QparamRun& run, const Fn& fn) {
  int64_t b = run.b, k = 0, len = run.blk - run.r;
  while (k < run.n) {
    const int64_t m = std::min(len, run.n - k);
    fn(k, m, b);
    k += m;
    ++b;
    len = run.blk;
  }
}

// Splits elements [begin, end) of a tensor with block layout L into runs for
// a kernel: fn(run, true) for a run inside one block (one qparam for all of
// it) when blocks along the last dimension are at least kMinRun long, else
// fn(run, false) for a run of a row whose qparams change every `blk`
// elements (gather them with gather_qparams).
template <typename Fn>
void for_each_qparam_run(const BlockLayout& L, int64_t begin, int64_t end, const Fn& fn) {
  for_each_row_run(L, begin, end, [&](const QparamRun& run) {
    if (run.blk < kMinRun) {
      fn(run, false);
      return;
    }
    for_each_block_piece(run, [&](int64_t k, int64_t m, int64_t b) {
      fn(QparamRun{run.i + k, m, b, k == 0 ? run.r : 0, run.blk}, true);
    });
  });
}

// out[k] = value(qparam index of element k of the run), k < run.n.
template <typename Value>
void gather_qparams(const QparamRun& run, const Value& value, float* out) {
  int64_t b = run.b, r = run.r;
  for (int64_t k = 0; k < run.n; ++k) {
    out[k] = value(b);
    if (++r == run.blk) {
      r = 0;
      ++b;
    }
  }
}

}  // namespace pt2e_fq::cpu
