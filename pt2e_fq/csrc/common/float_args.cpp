#include "float_args.h"

#include "affine_args.h"
#include "float_dtype.h"

namespace pt2e_fq {

ElemFormat parse_elem_format(const char* op, const char* what, const std::string& name) {
  if (name == "e4m3") return ElemFormat::kE4M3;
  if (name == "e5m2") return ElemFormat::kE5M2;
  if (name == "e2m1") return ElemFormat::kE2M1;
  TORCH_CHECK_VALUE(false, op, ": ", what, " must be one of 'e4m3', 'e5m2', 'e2m1', got '", name,
                    "'");
}

AxisBlocks check_axis_blocks(const char* op, const at::Tensor& x, int64_t block_size,
                             int64_t axis) {
  check_float_dtype(op, "x", x);
  const int64_t ndim = x.dim();
  TORCH_CHECK_VALUE(ndim >= 1, op, ": x must have at least one dimension, got a 0-dim tensor");
  TORCH_CHECK_VALUE(axis >= -ndim && axis < ndim, op, ": axis must be in [", -ndim, ", ", ndim,
                    ") for x of ", ndim, " dimensions, got ", axis);
  TORCH_CHECK_VALUE(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  const int64_t a = axis < 0 ? axis + ndim : axis;
  // A block longer than the axis is one block of the axis: the kernels size
  // their buffers by the block, so they get the axis length, not block_size.
  const int64_t len = x.size(a);
  const int64_t block = block_size < len ? block_size : (len > 0 ? len : 1);
  return make_axis_blocks(x.sizes().data(), static_cast<int>(ndim), static_cast<int>(a), block);
}

std::vector<int64_t> block_scale_shape(const at::Tensor& x, int64_t axis, const AxisBlocks& A) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[axis < 0 ? axis + x.dim() : axis] = A.blocks_per_axis();
  return shape;
}

BlockOutputs new_block_outputs(const at::Tensor& x_in, int64_t axis, const AxisBlocks& A) {
  BlockOutputs o;
  o.x = x_in.contiguous();
  o.y = at::empty_like(o.x, at::MemoryFormat::Contiguous);
  o.mask = new_packed_mask(o.x).zero_();
  o.scales = at::empty(block_scale_shape(o.x, axis, A), o.x.options().dtype(at::kFloat));
  return o;
}

}  // namespace pt2e_fq
