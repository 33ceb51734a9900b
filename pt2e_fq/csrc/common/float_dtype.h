// The three dtypes the kernels take, float32, bfloat16 and float16: the
// argument check of the CPU and CUDA entry points, and the dispatch to the
// C++ type.
#pragma once

#include <ATen/ATen.h>

namespace pt2e_fq {

// Checks that t has one of the three dtypes. `op` names the operator and
// `what` the argument in the error message.
inline void check_float_dtype(const char* op, const char* what, const at::Tensor& t) {
  const auto dt = t.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op, ": ", what,
                   " must be float32, bfloat16 or float16, got ", dt);
}

// Calls fn(T{}) with T the C++ type of a float32 / bfloat16 / float16 tensor
// (callers have already checked the dtype).
template <typename Fn>
void dispatch_float_dtype(at::ScalarType dtype, const Fn& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(float{});
    case at::kBFloat16:
      return fn(c10::BFloat16{});
    case at::kHalf:
      return fn(c10::Half{});
    default:
      TORCH_CHECK_TYPE(false, "pt2e_fq: expected float32, bfloat16 or float16, got ", dtype);
  }
}

}  // namespace pt2e_fq
