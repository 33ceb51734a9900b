// CPU implementation of pt2e_fq::fake_quantize_affine.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "affine_args.h"
#include "affine_cpu.h"
#include "cpu_loops.h"
#include "op_names.h"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace pt2e_fq::cpu {
namespace {

// The hot loop computes tiles of 16 elements and writes their 16 mask bits
// (two bytes) straight from the comparisons: one AVX-512 vector, no byte
// flags to pack afterwards. Chunks are whole tiles but the last.
constexpr int64_t kTile = 16;

// One tile: y[j] and the mask bits of x[j], j < kTile, with qparams q[k]
// (k = j per element, else 0).
template <typename T, bool kPerElement>
__attribute__((always_inline)) inline uint32_t affine_tile(const T* __restrict__ x,
                                                           T* __restrict__ y, const float* scale,
                                                           const float* ioff, const float* foff,
                                                           float qmin, float qmax) {
  uint32_t bits = 0;
  for (int j = 0; j < kTile; ++j) {
    const int k = kPerElement ? j : 0;
    bool in_range;
    y[j] = store_as<T>(
        fake_quantize_affine_one(load_f32(x[j]), scale[k], ioff[k], foff[k], qmin, qmax, in_range));
    bits |= static_cast<uint32_t>(in_range) << j;
  }
  return bits;
}

// Elements [0, n) of a chunk and its mask bytes, with one qparam value per
// element (blocks that tiles straddle; `affine_blocks` takes the others).
template <typename T>
PT2E_FQ_CLONES void affine_tiles(const T* __restrict__ x, T* __restrict__ y,
                                 uint8_t* __restrict__ mask, int64_t n, const float* scale,
                                 const float* ioff, const float* foff, float qmin, float qmax) {
  const int64_t tiles = n / kTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t q = t * kTile;
    const uint32_t bits =
        affine_tile<T, true>(x + q, y + q, scale + q, ioff + q, foff + q, qmin, qmax);
    mask[2 * t] = static_cast<uint8_t>(bits);
    mask[2 * t + 1] = static_cast<uint8_t>(bits >> 8);
  }
  const int64_t rest = n - tiles * kTile;
  if (rest == 0) return;
  // The last partial tile, through a padded copy (the qparam arrays hold
  // whole tiles); bits past n stay 0.
  T xt[kTile] = {}, yt[kTile];
  std::copy(x + tiles * kTile, x + n, xt);
  const int64_t q = tiles * kTile;
  const uint32_t bits = affine_tile<T, true>(xt, yt, scale + q, ioff + q, foff + q, qmin,
                                             qmax) & ((1u << rest) - 1u);
  std::copy(yt, yt + rest, y + tiles * kTile);
  for (int64_t b = 0; b < (rest + 7) / 8; ++b) mask[2 * tiles + b] = static_cast<uint8_t>(bits >> (8 * b));
}

// One row run of whole tiles but maybe the last, when no tile straddles two
// blocks: its blocks are `blk` long but the first, `first` long, and block b
// of the run uses scale[b], ioff[b * istride], foff[b * fstride] (a stride
// of 0 for a constant). The qparams are loaded once per block and broadcast,
// with no scratch arrays to fill (for blocks of 32 those fills cost a quarter
// of the time). The mask of the run starts on a byte.
template <typename T>
PT2E_FQ_CLONES void affine_blocks(const T* __restrict__ x, T* __restrict__ y,
                                  uint8_t* __restrict__ mask, int64_t n, int64_t first,
                                  int64_t blk, const float* scale, const float* ioff,
                                  int64_t istride, const float* foff, int64_t fstride,
                                  float qmin, float qmax) {
  int64_t k = 0, b = 0, len = first;
  while (k < n) {
    const int64_t m = std::min(len, n - k);
    const float s = scale[b], io = ioff[b * istride], fo = foff[b * fstride];
    const int64_t tiles = m / kTile;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t e = k + t * kTile;
      const uint32_t bits = affine_tile<T, false>(x + e, y + e, &s, &io, &fo, qmin, qmax);
      mask[e / 8] = static_cast<uint8_t>(bits);
      mask[e / 8 + 1] = static_cast<uint8_t>(bits >> 8);
    }
    const int64_t rest = m - tiles * kTile;
    if (rest) {  // the run's last, partial, tile through a padded copy; bits past n stay 0
      const int64_t e = k + tiles * kTile;
      T xt[kTile] = {}, yt[kTile];
      std::copy(x + e, x + e + rest, xt);
      const uint32_t bits =
          affine_tile<T, false>(xt, yt, &s, &io, &fo, qmin, qmax) & ((1u << rest) - 1u);
      std::copy(yt, yt + rest, y + e);
      for (int64_t j = 0; j < (rest + 7) / 8; ++j) mask[e / 8 + j] = static_cast<uint8_t>(bits >> (8 * j));
    }
    k += m;
    ++b;
    len = blk;
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PT2E_FQ_HAVE_V4 1
#define PT2E_FQ_V4 __attribute__((target("arch=x86-64-v4")))

// affine_blocks in AVX-512 intrinsics, for fp32 and bf16: GCC's clone of the
// generic loop ORs the mask bits together across lanes (a 9-shuffle
// reduction per tile) instead of moving the compare's mask register, and
// converts bf16 lane by lane. Bit for bit the generic math: same operations
// in the same order (no FMA), rint in the current (nearest-even) mode, the
// clamp as clamp_keep_nan's two selects, bf16 rounding as float_to_bf16_bits.
PT2E_FQ_V4 inline __m512 v4_load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
PT2E_FQ_V4 inline __m512 v4_load(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
PT2E_FQ_V4 inline void v4_store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
PT2E_FQ_V4 inline void v4_store(c10::BFloat16* p, __m512 v, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

template <typename T>
PT2E_FQ_V4 __attribute__((always_inline)) inline uint32_t v4_tile(
    const T* x, T* y, __mmask16 m, __m512 s, __m512 io, __m512 fo, __m512 lo, __m512 hi) {
  const __m512 v = _mm512_div_ps(_mm512_sub_ps(v4_load(x, m), fo), s);
  const __m512 q = _mm512_add_ps(_mm512_roundscale_ps(v, _MM_FROUND_CUR_DIRECTION), io);
  const __mmask16 in =
      _mm512_cmp_ps_mask(q, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(q, hi, _CMP_LE_OQ) & m;
  __m512 c = _mm512_mask_mov_ps(q, _mm512_cmp_ps_mask(q, hi, _CMP_GT_OQ), hi);
  c = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(q, lo, _CMP_LT_OQ), lo);
  v4_store(y, _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(c, io), s), fo), m);
  return static_cast<uint32_t>(in);
}

template <typename T>
PT2E_FQ_V4 void affine_blocks_v4(const T* __restrict__ x, T* __restrict__ y,
                                 uint8_t* __restrict__ mask, int64_t n, int64_t first,
                                 int64_t blk, const float* scale, const float* ioff,
                                 int64_t istride, const float* foff, int64_t fstride,
                                 float qmin, float qmax) {
  const __m512 lo = _mm512_set1_ps(qmin), hi = _mm512_set1_ps(qmax);
  int64_t k = 0, b = 0, len = first;
  while (k < n) {
    const int64_t m = std::min(len, n - k);
    const __m512 s = _mm512_set1_ps(scale[b]), io = _mm512_set1_ps(ioff[b * istride]),
                 fo = _mm512_set1_ps(foff[b * fstride]);
    const int64_t tiles = m / kTile;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t e = k + t * kTile;
      const uint16_t bits = static_cast<uint16_t>(v4_tile(x + e, y + e, 0xFFFF, s, io, fo, lo, hi));
      memcpy(mask + e / 8, &bits, 2);
    }
    const int64_t rest = m - tiles * kTile;
    if (rest) {  // the run's last, partial, tile; masked loads read zeros past n
      const int64_t e = k + tiles * kTile;
      const uint32_t bits = v4_tile(x + e, y + e, static_cast<__mmask16>((1u << rest) - 1u), s, io, fo, lo, hi);
      for (int64_t j = 0; j < (rest + 7) / 8; ++j) mask[e / 8 + j] = static_cast<uint8_t>(bits >> (8 * j));
    }
    k += m;
    ++b;
    len = blk;
  }
}

// PT2E_FQ_PORTABLE_CPU=1 turns the AVX-512 path off, so the tests can run
// the portable one on a machine that has AVX-512 (tests/ops/test_affine_numerics.py).
bool have_v4() {
  static const bool v = [] {
    const char* portable = std::getenv("PT2E_FQ_PORTABLE_CPU");
    if (portable != nullptr && std::strcmp(portable, "1") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return v;
}
#endif

// Whether every tile of every chunk lies in one block: blocks and rows
// start on tile boundaries (or there is one of them).
bool tiles_in_one_block(const BlockLayout& L) {
  const int64_t len = L.size[L.ndim - 1], blk = L.block[L.ndim - 1];
  return (len % kTile == 0 || len == L.numel) && (blk % kTile == 0 || blk == len);
}

template <typename T>
void affine_chunk(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end,
                  const BlockLayout& L, const AffineQparams& qp, bool per_tile) {
  if (per_tile) {
    // Row runs start on tile boundaries (chunks and rows do), so their masks
    // start on a byte.
    static const float kZero = 0.0f;
    const float* ioff = qp.ioff ? qp.ioff : &qp.ioff_const;
    const float* foff = qp.foff ? qp.foff : &kZero;
    const int64_t istride = qp.ioff ? 1 : 0, fstride = qp.foff ? 1 : 0;
    auto* kernel = &affine_blocks<T>;
#ifdef PT2E_FQ_HAVE_V4
    if constexpr (!std::is_same_v<T, c10::Half>) {
      if (have_v4()) kernel = &affine_blocks_v4<T>;
    }
#endif
    for_each_row_run(L, begin, end, [&](const QparamRun& run) {
      kernel(x + run.i, y + run.i, mask + run.i / 8, run.n, run.blk - run.r, run.blk,
                       qp.scale + run.b, ioff + run.b * istride, istride,
                       foff + run.b * fstride, fstride, qp.qmin, qp.qmax);
    });
    return;
  }
  alignas(64) float s_buf[kChunk], i_buf[kChunk], f_buf[kChunk];
  for_each_row_run(L, begin, end, [&](const QparamRun& run) {
    for_each_block_piece(run, [&](int64_t k, int64_t m, int64_t b) {
      const int64_t first = run.i + k - begin, last = first + m;
      std::fill(s_buf + first, s_buf + last, qp.scale[b]);
      std::fill(i_buf + first, i_buf + last, qp.ioff_at(b));
      std::fill(f_buf + first, f_buf + last, qp.foff_at(b));
    });
  });
  // Defined qparams for the padded last tile (its y is dropped).
  const int64_t n = end - begin, padded = (n + kTile - 1) / kTile * kTile;
  std::fill(s_buf + n, s_buf + padded, 1.0f);
  std::fill(i_buf + n, i_buf + padded, 0.0f);
  std::fill(f_buf + n, f_buf + padded, 0.0f);
  // The mask of a chunk starts on a byte: kChunk is a multiple of 8.
  affine_tiles<T>(x + begin, y + begin, mask + begin / 8, n, s_buf, i_buf, f_buf, qp.qmin, qp.qmax);
}

}  // namespace

// The zero point is checked on its fp32 copy (exact for any value in an int16
// range, and out of range whenever the integer is), but the message reads the
// caller's value: fp32 would round a large integer.
void check_qparam_values(const char* op, const AffineInputs& in,
                         const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
                         int64_t quant_max) {
  check_scale_values(op, "scale", in.scale);
  if (in.zp_is_const) {
    TORCH_CHECK_VALUE(in.zp_const >= quant_min && in.zp_const <= quant_max, op,
                      ": zero_point must lie in [quant_min, quant_max] = [", quant_min, ", ",
                      quant_max, "], got zero_point[0] (flat index) = ",
                      zero_point->reshape(-1)[0].item());
  }
  if (in.zero_point.defined()) {
    const float* z = in.zero_point.data_ptr<float>();
    for (int64_t b = 0; b < in.zero_point.numel(); ++b) {
      // The message (and its item()) is evaluated only when the check fails.
      TORCH_CHECK_VALUE(z[b] >= quant_min && z[b] <= quant_max, op,
                        ": zero_point must lie in [quant_min, quant_max] = [", quant_min, ", ",
                        quant_max, "], got zero_point[", b, "] (flat index) = ",
                        zero_point->reshape(-1)[b].item());
    }
  }
  if (in.minval.defined()) {
    const float* m = in.minval.data_ptr<float>();
    for (int64_t b = 0; b < in.minval.numel(); ++b) {
      TORCH_CHECK_VALUE(std::isfinite(m[b]), op, ": minval must be finite, got minval[", b,
                        "] (flat index) = ", m[b]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> affine_forward(const AffineInputs& in, int64_t quant_min,
                                                  int64_t quant_max) {
  const at::Tensor& x = in.x;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(x);
  if (x.numel() == 0) return {y, mask};

  const AffineQparams qp = affine_qparams(in, quant_min, quant_max);
  const bool per_tile = tiles_in_one_block(in.layout);
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    uint8_t* mp = mask.data_ptr<uint8_t>();
    parallel_chunks(x.numel(), [&](int64_t begin, int64_t end) {
      affine_chunk(xp, yp, mp, begin, end, in.layout, qp, per_tile);
    });
  });
  return {y, mask};
}

namespace {

std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_cpu(
    const at::Tensor& x, at::IntArrayRef block_size, const at::Tensor& scale,
    const c10::optional<at::Tensor>& zero_point, int64_t quant_min, int64_t quant_max,
    const c10::optional<at::Tensor>& minval) {
  const AffineInputs in = prepare_affine_inputs(x, block_size, scale, zero_point, quant_min,
                                                quant_max, minval);
  check_qparam_values(op_names::kAffine, in, zero_point, quant_min, quant_max);
  return affine_forward(in, quant_min, quant_max);
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) {
  m.impl("fake_quantize_affine", &fake_quantize_affine_cpu);
}

}  // namespace pt2e_fq::cpu
