// CPU implementation of pt2e_fq::fake_quantize_affine_learnable (forward:
// the affine op's kernel) and its backward, LSQ / LSQ+ in one pass over x.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "affine_args.h"
#include "affine_cpu.h"
#include "cpu_loops.h"
#include "float_dtype.h"
#include "op_names.h"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"

namespace pt2e_fq::cpu {
namespace {

at::Tensor fake_quantize_affine_learnable_cpu(const at::Tensor& x, at::IntArrayRef block_size,
                                              const at::Tensor& scale,
                                              const c10::optional<at::Tensor>& zero_point,
                                              int64_t quant_min, int64_t quant_max,
                                              c10::optional<double> grad_factor,
                                              const c10::optional<at::Tensor>& minval) {
  grad_factor_arg(op_names::kLearnable, grad_factor, quant_max);
  const AffineInputs in = prepare_affine_inputs(x, block_size, scale, zero_point, quant_min,
                                                quant_max, minval, op_names::kLearnable,
                                                /*float_zero_point=*/true);
  check_qparam_values(op_names::kLearnable, in, zero_point, quant_min, quant_max);
  return std::get<0>(affine_forward(in, quant_min, quant_max));
}

// dx of n elements, and each element's terms of the block sums: its d scale
// and its dy outside the range. kPerElement: qparams are arrays of n values
// (small blocks); otherwise one value each for the whole run. The sums are
// taken after, from dscale / outside: a reduction inside this loop kept it
// from vectorising (a scalar loop with a branch per select).
template <typename T, bool kPerElement>
PT2E_FQ_CLONES void lsq_elements(const T* __restrict__ x, const T* __restrict__ dy,
                                 T* __restrict__ dx, int64_t n, const float* __restrict__ scale,
                                 const float* __restrict__ ioff, const float* __restrict__ foff,
                                 float qmin, float qmax, float* __restrict__ dscale,
                                 float* __restrict__ outside) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = kPerElement ? i : 0;
    dx[i] = store_as<T>(lsq_grads_one(load_f32(x[i]), load_f32(dy[i]), scale[k], ioff[k], foff[k],
                                      qmin, qmax, dscale[i], outside[i]));
  }
}

// The sum of n floats in a fixed order: 8 interleaved partial sums (one
// vector register's worth) combined pairwise, then the last n % 8 in order.
// (Adding the tail into the lanes by index kept them in memory, unvectorised.)
PT2E_FQ_CLONES inline float sum_run(const float* __restrict__ p, int64_t n) {
  float l[8] = {};
  const int64_t full = n / 8 * 8;
  for (int64_t i = 0; i < full; i += 8) {
    for (int j = 0; j < 8; ++j) l[j] += p[i + j];
  }
  float tail = 0.0f;
  for (int64_t i = full; i < n; ++i) tail += p[i];
  return (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) + tail;
}

// Elements [begin, end) of one reduction group: dx, and the group's
// per-block sums added to acc_scale / acc_outside, chunk by chunk: per run
// inside one block its 8-lane sum, per element where blocks are shorter
// than kMinRun along the row.
template <typename T>
void lsq_group(const T* x, const T* dy, T* dx, int64_t begin, int64_t end, const BlockLayout& L,
               const AffineQparams& qp, float* acc_scale, float* acc_outside) {
  alignas(64) float s_buf[kChunk], i_buf[kChunk], f_buf[kChunk], ds_buf[kChunk], out_buf[kChunk];
  for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
    const int64_t c1 = std::min(end, c0 + kChunk);
    // As the forward (affine_chunk): one qparam per run, or gathered.
    for_each_qparam_run(L, c0, c1, [&](const QparamRun& run, bool one_block) {
      const int64_t k = run.i - c0, i = run.i;
      if (one_block) {
        const float s = qp.scale[run.b], io = qp.ioff_at(run.b), fo = qp.foff_at(run.b);
        lsq_elements<T, false>(x + i, dy + i, dx + i, run.n, &s, &io, &fo, qp.qmin, qp.qmax,
                               ds_buf + k, out_buf + k);
        return;
      }
      gather_qparams(run, [&](int64_t b) { return qp.scale[b]; }, s_buf);
      gather_qparams(run, [&](int64_t b) { return qp.ioff_at(b); }, i_buf);
      gather_qparams(run, [&](int64_t b) { return qp.foff_at(b); }, f_buf);
      lsq_elements<T, true>(x + i, dy + i, dx + i, run.n, s_buf, i_buf, f_buf, qp.qmin, qp.qmax,
                            ds_buf + k, out_buf + k);
    });
    for_each_qparam_run(L, c0, c1, [&](const QparamRun& run, bool one_block) {
      const int64_t k = run.i - c0;
      if (one_block) {
        acc_scale[run.b] += sum_run(ds_buf + k, run.n);
        acc_outside[run.b] += sum_run(out_buf + k, run.n);
        return;
      }
      int64_t b = run.b, r = run.r;
      for (int64_t e = k; e < k + run.n; ++e) {
        acc_scale[b] += ds_buf[e];
        acc_outside[b] += out_buf[e];
        if (++r == run.blk) {
          r = 0;
          ++b;
        }
      }
    });
  }
}

// The reduction splits x into contiguous groups whose number depends on the
// sizes only, never on the thread count, so the sums are the same bits for
// any number of threads: at most 64 groups of at least 16384 elements, and
// their per-block partial sums (2 floats per block and group) within numel
// bytes. Many small blocks thus give one group (a serial loop) rather than
// a temporary the size of x.
int64_t num_groups(int64_t numel, int64_t nblocks) {
  const int64_t g = std::min<int64_t>({64, numel / 16384, numel / (8 * nblocks)});
  return std::max<int64_t>(g, 1);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quantize_affine_learnable_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, at::IntArrayRef block_size,
    const at::Tensor& scale, const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
    int64_t quant_max, c10::optional<double> grad_factor,
    const c10::optional<at::Tensor>& minval) {
  const GradFactor factor = grad_factor_arg(op_names::kLearnableBackward, grad_factor, quant_max);
  const AffineInputs in = prepare_affine_inputs(x_in, block_size, scale, zero_point, quant_min,
                                                quant_max, minval, op_names::kLearnableBackward,
                                                /*float_zero_point=*/true);
  check_learnable_grad(op_names::kLearnableBackward, grad_in, x_in);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor& x = in.x;
  const std::vector<int64_t> qshape = reduced_shape(x.sizes(), block_size);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dscale = at::zeros(qshape, f32);
  at::Tensor doffset = at::zeros(qshape, f32);
  const int64_t numel = x.numel();
  if (numel == 0) return {dx, dscale, doffset};

  const AffineQparams qp = affine_qparams(in, quant_min, quant_max);
  const int64_t nb = num_blocks(in.layout);
  const int64_t groups = num_groups(numel, nb);
  // acc[g]: group g's sums, scale's then the outside ones, nb floats each.
  at::Tensor acc = at::zeros({groups, 2, nb}, f32);
  float* accp = acc.data_ptr<float>();
  dispatch_float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* gp = grad.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        lsq_group(xp, gp, dxp, numel * g / groups, numel * (g + 1) / groups, in.layout, qp,
                  accp + 2 * g * nb, accp + (2 * g + 1) * nb);
      }
    });
  });
  // Groups in order, then the factors: d offset is minval's (y moves with
  // it outside the range) or a zero point's (y moves by -scale per step).
  float* ds = dscale.data_ptr<float>();
  float* dof = doffset.data_ptr<float>();
  for (int64_t b = 0; b < nb; ++b) {
    const float gf = factor.for_block(block_numel_at(in.layout, b));
    float s_sum = 0.0f, o_sum = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      s_sum += accp[2 * g * nb + b];
      o_sum += accp[(2 * g + 1) * nb + b];
    }
    ds[b] = gf * s_sum;
    dof[b] = gf * (in.minval.defined() ? o_sum : -qp.scale[b] * o_sum);
  }
  return {dx, dscale, doffset};
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) {
  m.impl("fake_quantize_affine_learnable", &fake_quantize_affine_learnable_cpu);
  m.impl("fake_quantize_affine_learnable_backward", &fake_quantize_affine_learnable_backward_cpu);
}

}  // namespace pt2e_fq::cpu
