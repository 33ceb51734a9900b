// Argument checks of the fused observe-and-fake-quantize ops, shared by their
// CPU and CUDA entry points (the Python wrappers in observe_ops.py check the
// same with the same messages). Shapes, dtypes and devices only: reading a
// value would sync with the device.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/observe.h"

namespace pt2e_fq {

// The checked inputs common to both ops: contiguous x, its block layout, the
// number of blocks and the range update to apply.
struct ObserveInputs {
  at::Tensor x;
  BlockLayout layout;
  int64_t nblocks;
  RangeUpdate update;
};

// Checks x, block_size, the running range (min_val, max_val: fp32), the
// scale (fp32) and nonfinite (a one-element int64 counter), all on x's
// device, and averaging_constant (None, or in (0, 1]).
ObserveInputs check_observe_args(const char* op, const at::Tensor& x, at::IntArrayRef block_size,
                                 const at::Tensor& min_val, const at::Tensor& max_val,
                                 const at::Tensor& scale, const at::Tensor& nonfinite,
                                 const c10::optional<double>& averaging_constant);

// Checks an in-place per-block state tensor: x's device, dtype `dtype`, the
// shape ceil(x.shape / block_size) up to size-1 dimensions.
void check_state(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                 at::IntArrayRef block_size, at::ScalarType dtype);

// "symmetric" | "asymmetric" | "minval" with the affine op's other scalars
// (quant range, range_limit) and its offset tensor: an int32 zero point for
// the ZP schemes, an fp32 minval for MINVAL.
AffineRangeParams check_affine_observe_args(const char* op, const at::Tensor& x,
                                            at::IntArrayRef block_size, const at::Tensor& offset,
                                            int64_t quant_min, int64_t quant_max,
                                            const std::string& scheme, double range_limit);

// A buffer to write through a pointer: t itself when contiguous, else a
// contiguous copy that `finish_write` copies back.
at::Tensor writable(const at::Tensor& t);
void finish_write(const at::Tensor& t, const at::Tensor& written);

}  // namespace pt2e_fq
