// The CUDA launchers' name of a torch dtype, for the binding files.
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#include "float_dtype.h"
#include "kernels.h"

namespace pt2e_fq::cuda {

// The kernels' name of a dtype the caller has checked.
inline ElemType elem_type(at::ScalarType dtype) {
  ElemType type{};
  dispatch_float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    type = std::is_same_v<T, float>           ? ElemType::kFloat32
           : std::is_same_v<T, c10::BFloat16> ? ElemType::kBFloat16
                                              : ElemType::kFloat16;
  });
  return type;
}

}  // namespace pt2e_fq::cuda
