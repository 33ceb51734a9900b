// CPU implementation of pt2e_fq::ste_grad: dx = mask bit ? dy : 0.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_loops.h"
#include "dtype_dispatch.h"
#include "qparams.h"

namespace pt2e_fq::cpu {
namespace {

// A select, not a multiply: NaN or Inf in dy at a clamped position gives 0.
template <typename T>
PT2E_FQ_CLONES void ste_run(const T* __restrict__ dy, const uint8_t* __restrict__ mask,
                            T* __restrict__ dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = ((mask[i >> 3] >> (i & 7)) & 1) ? dy[i] : T(0);
  }
}

at::Tensor ste_grad_cpu(const at::Tensor& grad_in, const at::Tensor& mask_in) {
  check_ste_args(grad_in, mask_in);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  at::Tensor dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  const int64_t numel = grad.numel();
  dispatch_float_dtype(grad.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* g = grad.data_ptr<scalar_t>();
    const uint8_t* m = mask.data_ptr<uint8_t>();
    scalar_t* d = dx.data_ptr<scalar_t>();
    // Split on whole mask bytes so no two threads touch the same byte.
    at::parallel_for(0, (numel + 7) / 8, kChunk / 8, [&](int64_t b0, int64_t b1) {
      const int64_t begin = 8 * b0, end = std::min(numel, 8 * b1);
      ste_run(g + begin, m + b0, d + begin, end - begin);
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, CPU, m) { m.impl("ste_grad", &ste_grad_cpu); }

}  // namespace pt2e_fq::cpu
