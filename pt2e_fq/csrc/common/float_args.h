// Argument checks of the float-format ops, shared by their CPU and CUDA entry
// points (the Python wrappers check the same with friendlier messages).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"

namespace pt2e_fq {

// "e4m3" | "e5m2" | "e2m1" -> the element format; `what` names the argument.
ElemFormat parse_elem_format(const char* op, const char* what, const std::string& name);

// Checks x's dtype, axis in [-x.dim(), x.dim()) and block_size >= 1, and
// returns x's layout as blocks along the axis.
AxisBlocks check_axis_blocks(const char* op, const at::Tensor& x, int64_t block_size,
                             int64_t axis);

// x.shape with the axis replaced by the number of blocks along it.
std::vector<int64_t> block_scale_shape(const at::Tensor& x, int64_t axis, const AxisBlocks& A);

}  // namespace pt2e_fq
