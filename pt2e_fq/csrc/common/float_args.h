// Argument checks and output allocation of the float-format ops, shared by
// their CPU and CUDA entry points (the Python wrappers check the same with
// friendlier messages).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"

namespace pt2e_fq {

// "e4m3" | "e5m2" | "e2m1" -> the element format; `what` names the argument.
ElemFormat parse_elem_format(const char* op, const char* what, const std::string& name);

// Checks x's dtype, axis in [-x.dim(), x.dim()) and block_size >= 1,
// and returns x's layout as blocks along the axis, the block clamped to the
// axis length (same number of blocks).
AxisBlocks check_axis_blocks(const char* op, const at::Tensor& x, int64_t block_size,
                             int64_t axis);

// x.shape with the axis replaced by the number of blocks along it.
std::vector<int64_t> block_scale_shape(const at::Tensor& x, int64_t axis, const AxisBlocks& A);

// The tensors of the block-scaled ops (MX, NVFP4): contiguous x, and y, a
// zeroed mask (the CPU and CUDA kernels OR bits into it) and the fp32 block
// scales of block_scale_shape, allocated.
struct BlockOutputs {
  at::Tensor x, y, mask, scales;
};

BlockOutputs new_block_outputs(const at::Tensor& x_in, int64_t axis, const AxisBlocks& A);

}  // namespace pt2e_fq
