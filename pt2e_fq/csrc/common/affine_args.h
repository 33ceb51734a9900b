// Argument checks and qparam preparation shared by the CPU and CUDA entry
// points of the affine op. The Python wrapper validates the same things with
// friendlier messages; these checks keep a direct torch.ops call memory-safe.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "op_names.h"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"

namespace pt2e_fq {

// Checks x's dtype (float32, bfloat16 or float16) and a block_size with one
// entry >= 1 per dimension of x (0 is allowed on a dimension of size 0, where
// it means the whole, empty, dimension: per-tensor `block_size = x.shape`),
// and returns the canonical block layout of x.
// `op` names the operator in error messages.
BlockLayout check_x_and_block_size(const char* op, const at::Tensor& x,
                                   at::IntArrayRef block_size);

// The affine op's inputs after checks, ready for a kernel: contiguous x, the
// canonical block layout, and per-block qparams as contiguous fp32 (zp and
// minval undefined when not given).
struct AffineInputs {
  at::Tensor x;
  BlockLayout layout;
  at::Tensor scale, zero_point, minval;
  // A single-element integer zero point of the CPU op (not the learnable
  // one's): its value, with zero_point left undefined. Reading it on the host
  // spares a conversion to an fp32 tensor (a TensorIterator call, ~1 us).
  bool zp_is_const = false;
  float zp_const = 0.0f;
};

// Checks shapes and dtypes (never values: that would need a host sync on
// CUDA) and prepares the inputs. `op` names the operator in messages.
// float_zero_point: the learnable op also takes a floating zero point (LSQ+
// learns it); the kernels get round_half_even(clamp(zero_point, quant_min,
// quant_max)), computed on the device, so its forward is the static op's
// with that integer zero point.
AffineInputs prepare_affine_inputs(const at::Tensor& x, at::IntArrayRef block_size,
                                   const at::Tensor& scale,
                                   const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
                                   int64_t quant_max, const c10::optional<at::Tensor>& minval,
                                   const char* op = op_names::kAffine,
                                   bool float_zero_point = false);

// Checks the learnable op's grad_factor (a host double: no sync) and gives
// the kernels' view of it: None is LSQ's default per block, which needs
// quant_max >= 1.
GradFactor grad_factor_arg(const char* op, const c10::optional<double>& grad_factor,
                           int64_t quant_max);

// Checks the incoming gradient of the learnable op's backward: x's shape,
// dtype and device.
void check_learnable_grad(const char* op, const at::Tensor& grad, const at::Tensor& x);

// The number of qparam blocks of a canonical layout, prod ceil(size / block).
int64_t num_blocks(const BlockLayout& L);

// Kernel view of the prepared qparams (pointers into `in`, which must outlive it).
AffineQparams affine_qparams(const AffineInputs& in, int64_t quant_min, int64_t quant_max);

// The shape of the per-block qparams, ceil(x.shape / block_size); a block of
// 0 (on a dimension of size 0) is one block.
std::vector<int64_t> reduced_shape(at::IntArrayRef size, at::IntArrayRef block_size);

// Checks a qparam tensor as the Python wrappers do (pt2e_fq.blocks.check_qparam):
// on x's device, a floating dtype unless `floating` is false (zero points are
// checked for an integer dtype by the caller), and the shape `expected`, where
// size-1 dimensions may be omitted. `expected_what` names the expected shape
// in the error message. Returns it as a contiguous fp32 tensor.
// qparam_as_float's checks alone.
void check_qparam(const at::Tensor& x, const at::Tensor& t, const char* name,
                  at::IntArrayRef expected, const char* op,
                  const char* expected_what = "ceil(x.shape / block_size)",
                  bool floating = true);

at::Tensor qparam_as_float(const at::Tensor& x, const at::Tensor& t, const char* name,
                           at::IntArrayRef expected, const char* op,
                           const char* expected_what = "ceil(x.shape / block_size)",
                           bool floating = true);

// Checks on the host that every value of a scale tensor is finite and > 0 (CPU only: reading
// the values of a CUDA tensor would sync).
void check_scale_values(const char* op, const char* name, const at::Tensor& scale);

// Allocates the packed mask with room for whole 32-bit words (the CUDA kernel
// writes words) and returns a view of exactly ceil(numel / 8) bytes.
at::Tensor new_packed_mask(const at::Tensor& x);

// Checks the arguments of ste_grad.
void check_ste_args(const at::Tensor& grad, const at::Tensor& mask);

}  // namespace pt2e_fq
