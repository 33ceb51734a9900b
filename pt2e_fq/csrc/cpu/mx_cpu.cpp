// CPU implementations of pt2e_fq::fake_quantize_mx and fake_quantize_nvfp4:
// block-scaled formats whose scales come from the data, one pass per block
// (block amax, block scale, quantize) inside the kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "affine_args.h"
#include "cpu_loops.h"
#include "float_args.h"
#include "float_dtype.h"
#include "op_names.h"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"

namespace pt2e_fq::cpu {
namespace {

// How a format turns a block's amax into the scale it reports and the fp32
// scale its elements are divided by.
template <ElemFormat F>
struct MxScaling {
  using Quantizer = FloatElem<F>;
  float block_scale(float amax) const { return mx_block_scale<F>(amax); }
  float element_scale(float block_scale) const { return block_scale; }
};

struct Nvfp4Scaling {
  using Quantizer = FloatElem<ElemFormat::kE2M1>;
  float global_scale;
  float block_scale(float amax) const { return nvfp4_block_scale(amax, global_scale); }
  float element_scale(float block_scale) const {
    return nvfp4_element_scale(block_scale, global_scale);
  }
};

// Blocks along the last dimension (inner == 1): each block is a contiguous
// run. A unit of parallel work is a run of whole blocks, about kChunk
// elements; its mask bits need not start on a byte, hence pack_bits_at.
template <typename T, typename Scaling>
void blocks_contiguous(const T* x, T* y, uint8_t* mask, float* scales, const AxisBlocks& A,
                       const Scaling& sc) {
  using Q = typename Scaling::Quantizer;
  const int64_t k = A.block, nb = A.blocks_per_axis();
  const int64_t nblocks = A.outer * nb;
  const int64_t per_unit = std::max<int64_t>(1, kChunk / k);
  const int64_t nunits = (nblocks + per_unit - 1) / per_unit;
  at::parallel_for(0, nunits, 1, [&](int64_t u0, int64_t u1) {
    std::vector<uint8_t> flags(per_unit * k);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b0 = u * per_unit, b1 = std::min(nblocks, b0 + per_unit);
      const int64_t first = (b0 / nb) * A.len + (b0 % nb) * k;
      int64_t next = first;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t start = (b / nb) * A.len + (b % nb) * k;
        const int64_t n = std::min(k, A.len - (b % nb) * k);
        scales[b] = sc.block_scale(amax_from_bits(max_abs_bits(x + start, n)));
        const float s = sc.element_scale(scales[b]);
        scaled_run<Q, T, false>(x + start, y + start, flags.data() + (start - first), n, &s);
        next = start + n;
      }
      pack_bits_at(flags.data(), first, next - first, mask);
    }
  });
}

// acc[c] = max(acc[c], |x[c]| as bits), c < n (see max_abs_bits).
template <typename T>
PT2E_FQ_CLONES void accumulate_max_abs_bits(const T* __restrict__ x, int64_t n,
                                            uint32_t* __restrict__ acc) {
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t a = abs_bits(load_f32(x[c]));
    acc[c] = a > acc[c] ? a : acc[c];
  }
}

// Blocks along an outer dimension (inner > 1): a block's elements are
// `inner` apart, and the blocks of `inner` neighbouring positions lie side by
// side. A unit of work is one block row (outer index, block index) over a
// tile of up to kTile inner positions: the amaxes of the whole tile are
// accumulated row by row (contiguous, vectorised), then every row of the tile
// is quantized with per-position scales.
constexpr int64_t kTile = 512;

template <typename T, typename Scaling>
void blocks_strided(const T* x, T* y, uint8_t* mask, float* scales, const AxisBlocks& A,
                    const Scaling& sc) {
  using Q = typename Scaling::Quantizer;
  const int64_t k = A.block, nb = A.blocks_per_axis();
  const int64_t ntiles = (A.inner + kTile - 1) / kTile;
  at::parallel_for(0, A.outer * nb * ntiles, 1, [&](int64_t w0, int64_t w1) {
    alignas(64) uint32_t amax_bits[kTile];
    alignas(64) float s[kTile];
    alignas(64) uint8_t flags[kTile];
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / ntiles, c0 = (w % ntiles) * kTile;  // g = outer * nb + block
      const int64_t j = g % nb;
      const int64_t width = std::min(kTile, A.inner - c0);
      const int64_t n = std::min(k, A.len - j * k);
      const int64_t row0 = ((g / nb) * A.len + j * k) * A.inner + c0;
      std::fill(amax_bits, amax_bits + width, 0u);
      for (int64_t t = 0; t < n; ++t) accumulate_max_abs_bits(x + row0 + t * A.inner, width, amax_bits);
      float* block_scales = scales + g * A.inner + c0;
      for (int64_t c = 0; c < width; ++c) {
        block_scales[c] = sc.block_scale(amax_from_bits(amax_bits[c]));
        s[c] = sc.element_scale(block_scales[c]);
      }
      for (int64_t t = 0; t < n; ++t) {
        const int64_t off = row0 + t * A.inner;
        scaled_run<Q, T, true>(x + off, y + off, flags, width, s);
        pack_bits_at(flags, off, width, mask);
      }
    }
  });
}

template <typename Scaling>
void run_blocks(BlockOutputs& o, const AxisBlocks& A, const Scaling& sc) {
  if (o.x.numel() == 0) return;
  dispatch_float_dtype(o.x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = o.x.data_ptr<scalar_t>();
    scalar_t* yp = o.y.data_ptr<scalar_t>();
    uint8_t* m = o.mask.data_ptr<uint8_t>();
    float* s = o.scales.data_ptr<float>();
    if (A.inner == 1) {
      blocks_contiguous(xp, yp, m, s, A, sc);
    } else {
      blocks_strided(xp, yp, m, s, A, sc);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quantize_mx_cpu(const at::Tensor& x_in,
                                                                    c10::string_view elem_fmt,
                                                                    int64_t block_size,
                                                                    int64_t axis) {
  const AxisBlocks A = check_axis_blocks(op_names::kMx, x_in, block_size, axis);
  const ElemFormat format = parse_elem_format(op_names::kMx, "elem_fmt", std::string(elem_fmt));
  BlockOutputs o = new_block_outputs(x_in, axis, A);
  dispatch_elem_format(format, [&](auto ftag) {
    run_blocks(o, A, MxScaling<decltype(ftag)::value>{});
  });
  return {o.y, o.mask, o.scales};
}

// max |x| over the whole tensor, NaN if x has one.
float tensor_amax(const at::Tensor& x) {
  uint32_t bits = 0;
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    bits = at::parallel_reduce(
        0, x.numel(), kChunk, 0u,
        [&](int64_t b, int64_t e, uint32_t m) { return std::max(m, max_abs_bits(xp + b, e - b)); },
        [](uint32_t a, uint32_t b) { return std::max(a, b); });
  });
  return amax_from_bits(bits);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_nvfp4_cpu(
    const at::Tensor& x_in, const c10::optional<at::Tensor>& global_scale_in, int64_t axis) {
  const AxisBlocks A = check_axis_blocks(op_names::kNvfp4, x_in, 16, axis);
  BlockOutputs o = new_block_outputs(x_in, axis, A);
  float g;
  if (global_scale_in.has_value()) {
    const at::Tensor gs =
        qparam_as_float(x_in, *global_scale_in, "global_scale", {}, op_names::kNvfp4,
                        "a single value");
    check_scale_values(op_names::kNvfp4, "global_scale", gs);
    g = gs.data_ptr<float>()[0];
  } else {
    g = nvfp4_global_scale(tensor_amax(o.x));
  }
  run_blocks(o, A, Nvfp4Scaling{g});
  return {o.y, o.mask, o.scales, at::scalar_tensor(g, o.x.options().dtype(at::kFloat))};
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) {
  m.impl("fake_quantize_mx", &fake_quantize_mx_cpu);
  m.impl("fake_quantize_nvfp4", &fake_quantize_nvfp4_cpu);
}

}  // namespace pt2e_fq::cpu
