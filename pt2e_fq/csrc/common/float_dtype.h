// Calls fn(T{}) with T the C++ type of a float32 / bfloat16 / float16 tensor,
// the three dtypes the kernels take (callers have already checked the dtype).
#pragma once

#include <ATen/ATen.h>

namespace pt2e_fq {

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
