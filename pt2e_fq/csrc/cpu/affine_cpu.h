// The CPU forward of the affine op, shared by pt2e_fq::fake_quantize_affine
// and pt2e_fq::fake_quantize_affine_learnable (whose y must be the same bits).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "affine_args.h"

namespace pt2e_fq::cpu {

// Checks the values of prepared qparams on the host (cheap on the CPU; the
// CUDA path cannot without a host sync, see README, "Bad qparams on CUDA").
// `zero_point` is the caller's tensor, read only for the error message.
void check_qparam_values(const char* op, const AffineInputs& in,
                         const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
                         int64_t quant_max);

// (y, packed mask) of prepared and checked inputs.
std::tuple<at::Tensor, at::Tensor> affine_forward(const AffineInputs& in, int64_t quant_min,
                                                  int64_t quant_max);

}  // namespace pt2e_fq::cpu
