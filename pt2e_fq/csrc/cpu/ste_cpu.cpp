// CPU implementation of pt2e_fq::ste_grad: dx = mask bit ? dy : 0.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <type_traits>

#include "affine_args.h"
#include "cpu_loops.h"
#include "float_dtype.h"

namespace pt2e_fq::cpu {
namespace {

// The select on the elements' bits: AND with all ones keeps dy, AND with
// zero gives +0, so a NaN or Inf in dy at a clamped position gives 0 (a
// multiply would give NaN). One mask byte covers 8 elements; spelling that
// out as a fixed inner loop of 8 lets the compiler vectorise (broadcast the
// byte, test the lane's bit, AND), where indexing mask[i >> 3] per element
// left a branchy scalar loop. n is a multiple of 8 except in the last run.
template <typename U>
PT2E_FQ_CLONES void ste_run(const U* __restrict__ dy, const uint8_t* __restrict__ mask,
                            U* __restrict__ dx, int64_t n) {
  const int64_t full = n / 8;
  for (int64_t b = 0; b < full; ++b) {
    const uint32_t m = mask[b];
    for (int j = 0; j < 8; ++j) {
      dx[8 * b + j] = dy[8 * b + j] & static_cast<U>(0u - ((m >> j) & 1u));
    }
  }
  for (int64_t i = 8 * full; i < n; ++i) {
    dx[i] = dy[i] & static_cast<U>(0u - ((mask[full] >> (i - 8 * full)) & 1u));
  }
}

// The unsigned integer type of a float dtype's width.
template <typename T>
using bits_of = std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>;

at::Tensor ste_grad_cpu(const at::Tensor& grad_in, const at::Tensor& mask_in) {
  check_ste_args(grad_in, mask_in);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor mask = mask_in.contiguous();
  at::Tensor dx = at::empty_like(grad, at::MemoryFormat::Contiguous);
  const int64_t numel = grad.numel();
  dispatch_float_dtype(grad.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using U = bits_of<scalar_t>;
    const U* g = reinterpret_cast<const U*>(grad.data_ptr<scalar_t>());
    const uint8_t* m = mask.data_ptr<uint8_t>();
    U* d = reinterpret_cast<U*>(dx.data_ptr<scalar_t>());
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
