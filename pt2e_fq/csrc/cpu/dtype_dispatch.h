// Calls fn(T{}) with T the C++ type of a float32 / bfloat16 / float16 tensor,
// the three dtypes the kernels take (callers have already checked the dtype).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "pt2e_fq/float_formats.h"

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

// Calls fn(std::integral_constant<ElemFormat, F>{}) so kernels are compiled
// once per element format.
template <typename Fn>
void dispatch_elem_format(ElemFormat f, const Fn& fn) {
  switch (f) {
    case ElemFormat::kE4M3:
      return fn(std::integral_constant<ElemFormat, ElemFormat::kE4M3>{});
    case ElemFormat::kE5M2:
      return fn(std::integral_constant<ElemFormat, ElemFormat::kE5M2>{});
    case ElemFormat::kE2M1:
      return fn(std::integral_constant<ElemFormat, ElemFormat::kE2M1>{});
  }
  TORCH_CHECK(false, "pt2e_fq: unknown element format ", static_cast<int>(f));
}

}  // namespace pt2e_fq
