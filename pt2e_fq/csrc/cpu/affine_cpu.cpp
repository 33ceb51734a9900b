// CPU implementation of pt2e_fq::fake_quantize_affine.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_loops.h"
#include "dtype_dispatch.h"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"
#include "qparams.h"

namespace pt2e_fq::cpu {
namespace {

// Blocks shorter than this along the last dimension are processed with
// per-element qparams gathered into scratch arrays instead of one run each.
constexpr int64_t kMinRun = 16;

// The hot loop over n elements. kPerElement: qparams are arrays of n values
// (small blocks); otherwise one value each for the whole run.
template <typename T, bool kPerElement>
PT2E_FQ_CLONES void affine_run(const T* __restrict__ x, T* __restrict__ y,
                               uint8_t* __restrict__ flags, int64_t n,
                               const float* __restrict__ scale, const float* __restrict__ ioff,
                               const float* __restrict__ foff, float qmin, float qmax) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = kPerElement ? i : 0;
    bool in_range;
    y[i] = store_as<T>(
        fake_quantize_affine_one(load_f32(x[i]), scale[k], ioff[k], foff[k], qmin, qmax, in_range));
    flags[i] = in_range;
  }
}

template <typename T>
void affine_chunk(const T* x, T* y, uint8_t* flags, int64_t begin, int64_t end,
                  const BlockLayout& L, const AffineQparams& qp) {
  const int64_t len = L.size[L.ndim - 1];
  const int64_t blk = L.block[L.ndim - 1];
  alignas(64) float s_buf[kChunk], i_buf[kChunk], f_buf[kChunk];
  int64_t i = begin;
  while (i < end) {
    const int64_t row = i / len;
    int64_t col = i - row * len;
    const int64_t base = row_scale_offset(L, row);
    const int64_t row_end = std::min(end, (row + 1) * len);
    if (blk >= kMinRun) {
      while (i < row_end) {
        const int64_t b = base + col / blk;
        const int64_t n = std::min(row_end - i, blk - col % blk);
        const float s = qp.scale[b], io = qp.ioff_at(b), fo = qp.foff_at(b);
        affine_run<T, false>(x + i, y + i, flags + (i - begin), n, &s, &io, &fo, qp.qmin, qp.qmax);
        i += n;
        col += n;
      }
    } else {
      const int64_t n = row_end - i;
      int64_t b = base + col / blk, r = col % blk;
      for (int64_t k = 0; k < n; ++k) {
        s_buf[k] = qp.scale[b];
        i_buf[k] = qp.ioff_at(b);
        f_buf[k] = qp.foff_at(b);
        if (++r == blk) {
          r = 0;
          ++b;
        }
      }
      affine_run<T, true>(x + i, y + i, flags + (i - begin), n, s_buf, i_buf, f_buf, qp.qmin, qp.qmax);
      i = row_end;
    }
  }
}

// Value checks are cheap on the host, so the CPU path makes them; the CUDA
// path cannot without a host sync (see README, "Bad qparams on CUDA").
void check_qparam_values(const at::Tensor& scale, const at::Tensor& zp, const at::Tensor& minval,
                         int64_t quant_min, int64_t quant_max) {
  const float* s = scale.data_ptr<float>();
  for (int64_t b = 0; b < scale.numel(); ++b) {
    TORCH_CHECK_VALUE(s[b] > 0.0f && s[b] <= std::numeric_limits<float>::max(),
                      "pt2e_fq.fake_quantize_affine: scale must be finite and > 0, got scale[", b,
                      "] (flat index) = ", s[b]);
  }
  if (zp.defined()) {
    const float* z = zp.data_ptr<float>();
    for (int64_t b = 0; b < zp.numel(); ++b) {
      TORCH_CHECK_VALUE(z[b] >= quant_min && z[b] <= quant_max,
                        "pt2e_fq.fake_quantize_affine: zero_point must lie in [quant_min, "
                        "quant_max] = [",
                        quant_min, ", ", quant_max, "], got zero_point[", b,
                        "] (flat index) = ", static_cast<int64_t>(z[b]));
    }
  }
  if (minval.defined()) {
    const float* m = minval.data_ptr<float>();
    for (int64_t b = 0; b < minval.numel(); ++b) {
      TORCH_CHECK_VALUE(std::isfinite(m[b]),
                        "pt2e_fq.fake_quantize_affine: minval must be finite, got minval[", b,
                        "] (flat index) = ", m[b]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> fake_quantize_affine_cpu(
    const at::Tensor& x_in, at::IntArrayRef block_size, const at::Tensor& scale_in,
    const c10::optional<at::Tensor>& zero_point, int64_t quant_min, int64_t quant_max,
    const c10::optional<at::Tensor>& minval) {
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale_in, zero_point,
                                                quant_min, quant_max, minval);
  check_qparam_values(in.scale, in.zero_point, in.minval, quant_min, quant_max);
  const at::Tensor& x = in.x;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = new_packed_mask(x);
  if (x.numel() == 0) return {y, mask};

  const AffineQparams qp = affine_qparams(in, quant_min, quant_max);
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_each_chunk(x.numel(), mask.data_ptr<uint8_t>(),
                   [&](int64_t begin, int64_t end, uint8_t* flags) {
                     affine_chunk(xp, yp, flags, begin, end, in.layout, qp);
                   });
  });
  return {y, mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) {
  m.impl("fake_quantize_affine", &fake_quantize_affine_cpu);
}

}  // namespace pt2e_fq::cpu
