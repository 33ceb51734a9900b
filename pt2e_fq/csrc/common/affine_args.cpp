#include "affine_args.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "float_dtype.h"
#include "op_names.h"
#include "pt2e_fq/mask_bits.h"

namespace pt2e_fq {

namespace {
constexpr int64_t kInt16Min = std::numeric_limits<int16_t>::min();
constexpr int64_t kInt16Max = std::numeric_limits<int16_t>::max();
}  // namespace

std::vector<int64_t> reduced_shape(at::IntArrayRef size, at::IntArrayRef block_size) {
  std::vector<int64_t> r(size.size());
  for (size_t d = 0; d < size.size(); ++d) {
    r[d] = block_size[d] == 0 ? 1 : (size[d] + block_size[d] - 1) / block_size[d];
  }
  return r;
}

namespace {
// "(2, 3)", as Python prints a shape tuple.
std::string shape_str(at::IntArrayRef s) {
  std::string out = "(";
  for (size_t d = 0; d < s.size(); ++d) {
    out += (d ? ", " : "") + std::to_string(s[d]);
  }
  return out + (s.size() == 1 ? ",)" : ")");
}

std::vector<int64_t> squeezed(at::IntArrayRef s) {
  std::vector<int64_t> out;
  for (const int64_t v : s) {
    if (v != 1) out.push_back(v);
  }
  return out;
}

// The value of a one-element CPU tensor of an integer dtype as fp32 (as
// t.to(kFloat) rounds it); false, and nothing read, for other dtypes.
bool read_int_scalar(const at::Tensor& t, float& out) {
  bool ok = false;
  AT_DISPATCH_INTEGRAL_TYPES(t.scalar_type(), "read_int_scalar", [&] {
    out = static_cast<float>(*t.const_data_ptr<scalar_t>());
    ok = true;
  });
  return ok;
}
}  // namespace

BlockLayout check_x_and_block_size(const char* op, const at::Tensor& x,
                                   at::IntArrayRef block_size) {
  check_float_dtype(op, "x", x);
  TORCH_CHECK_VALUE(static_cast<int64_t>(block_size.size()) == x.dim(), op,
                    ": block_size needs one entry per dimension of x (", x.dim(), "), got ",
                    block_size.size());
  for (size_t d = 0; d < block_size.size(); ++d) {
    TORCH_CHECK_VALUE(block_size[d] >= 1 || (block_size[d] == 0 && x.size(d) == 0), op,
                      ": block_size[", d,
                      "] must be >= 1 (or 0 on a dimension of size 0), got ", block_size[d]);
  }
  BlockLayout L;
  TORCH_CHECK_VALUE(make_block_layout(x.sizes().data(), block_size.data(),
                                      static_cast<int>(x.dim()), L),
                    op, ": this block layout has more than ", kMaxLayoutDims,
                    " non-mergeable dimensions");
  return L;
}

AffineInputs prepare_affine_inputs(const at::Tensor& x, at::IntArrayRef block_size,
                                   const at::Tensor& scale,
                                   const c10::optional<at::Tensor>& zero_point, int64_t quant_min,
                                   int64_t quant_max, const c10::optional<at::Tensor>& minval,
                                   const char* op, bool float_zero_point) {
  const BlockLayout L = check_x_and_block_size(op, x, block_size);
  TORCH_CHECK_VALUE(quant_min <= quant_max && quant_min >= kInt16Min && quant_max <= kInt16Max,
                    op, ": need ", kInt16Min, " <= quant_min <= quant_max <= ", kInt16Max,
                    ", got quant_min=", quant_min, " quant_max=", quant_max);
  TORCH_CHECK_VALUE(!(zero_point.has_value() && minval.has_value()), op,
                    ": give zero_point (ZP formulation) or minval (MINVAL formulation), not both");
  const bool zp_is_float = zero_point.has_value() && at::isFloatingType(zero_point->scalar_type());
  if (zero_point.has_value() && !(float_zero_point && zp_is_float)) {
    TORCH_CHECK_TYPE(!zp_is_float && !at::isComplexType(zero_point->scalar_type()) &&
                         zero_point->scalar_type() != at::kBool,
                     op, ": zero_point must have ",
                     float_zero_point ? "an integer or floating dtype" : "an integer dtype",
                     ", got ", zero_point->scalar_type());
  }
  const std::vector<int64_t> expected = reduced_shape(x.sizes(), block_size);
  AffineInputs in;
  in.x = x.contiguous();
  in.layout = L;
  in.scale = qparam_as_float(x, scale, "scale", expected, op);
  if (zero_point && !float_zero_point && x.device().is_cpu() && zero_point->numel() == 1 &&
      read_int_scalar(*zero_point, in.zp_const)) {
    // Checks as qparam_as_float does, without its conversion.
    check_qparam(x, *zero_point, "zero_point", expected, op, "ceil(x.shape / block_size)",
                 /*floating=*/false);
    in.zp_is_const = true;
  } else if (zero_point) {
    in.zero_point = qparam_as_float(x, *zero_point, "zero_point", expected, op,
                                    "ceil(x.shape / block_size)", /*floating=*/false);
    if (zp_is_float) {
      in.zero_point = at::round(in.zero_point.clamp(static_cast<double>(quant_min),
                                                    static_cast<double>(quant_max)));
    }
  }
  if (minval) in.minval = qparam_as_float(x, *minval, "minval", expected, op);
  return in;
}

GradFactor grad_factor_arg(const char* op, const c10::optional<double>& grad_factor,
                           int64_t quant_max) {
  if (!grad_factor) {
    TORCH_CHECK_VALUE(quant_max >= 1, op,
                      ": the default grad_factor, LSQ's 1 / sqrt(block_numel * quant_max), needs "
                      "quant_max >= 1 (positive levels), got quant_max=", quant_max,
                      "; pass grad_factor explicitly");
    return {true, 0.0f, quant_max};
  }
  TORCH_CHECK_VALUE(std::isfinite(*grad_factor) && *grad_factor > 0.0, op,
                    ": grad_factor must be finite and > 0, got ", *grad_factor);
  return {false, static_cast<float>(*grad_factor), quant_max};
}

void check_learnable_grad(const char* op, const at::Tensor& grad, const at::Tensor& x) {
  TORCH_CHECK_VALUE(grad.sizes() == x.sizes(), op, ": grad must have x's shape ",
                    shape_str(x.sizes()), ", got ", shape_str(grad.sizes()));
  TORCH_CHECK_TYPE(grad.scalar_type() == x.scalar_type(), op, ": grad must have x's dtype ",
                   x.scalar_type(), ", got ", grad.scalar_type());
  TORCH_CHECK(grad.device() == x.device(), op, ": grad is on ", grad.device(), " but x is on ",
              x.device());
}

int64_t num_blocks(const BlockLayout& L) {
  int64_t n = 1;
  for (int d = 0; d < L.ndim; ++d) n *= (L.size[d] + L.block[d] - 1) / L.block[d];
  return n;
}

AffineQparams affine_qparams(const AffineInputs& in, int64_t quant_min, int64_t quant_max) {
  const auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  AffineQparams qp = make_affine_qparams(ptr(in.scale), ptr(in.zero_point), ptr(in.minval),
                                         quant_min, quant_max);
  if (in.zp_is_const) qp.ioff_const = in.zp_const;
  return qp;
}

void check_qparam(const at::Tensor& x, const at::Tensor& t, const char* name,
                  at::IntArrayRef expected, const char* op, const char* expected_what,
                  bool floating) {
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but x is on ",
              x.device());
  TORCH_CHECK_VALUE(squeezed(t.sizes()) == squeezed(expected), op, ": ", name,
                    " must have shape ", shape_str(expected), " (", expected_what,
                    "; size-1 dimensions may be omitted), got ", shape_str(t.sizes()));
  TORCH_CHECK_TYPE(!floating || at::isFloatingType(t.scalar_type()), op, ": ", name,
                   " must be a floating-point tensor, got ", t.scalar_type());
}

at::Tensor qparam_as_float(const at::Tensor& x, const at::Tensor& t, const char* name,
                           at::IntArrayRef expected, const char* op, const char* expected_what,
                           bool floating) {
  check_qparam(x, t, name, expected, op, expected_what, floating);
  return t.to(at::kFloat).contiguous();
}

void check_scale_values(const char* op, const char* name, const at::Tensor& scale) {
  const float* s = scale.data_ptr<float>();
  for (int64_t b = 0; b < scale.numel(); ++b) {
    // A NaN reads "nan" whatever its sign bit, which the arithmetic that made
    // it (an overflowed range, Inf - Inf) may or may not have set.
    TORCH_CHECK_VALUE(s[b] > 0.0f && s[b] <= std::numeric_limits<float>::max(), op,
                      ": ", name, " must be finite and > 0, got ", name, "[",
                      b, "] (flat index) = ", std::isnan(s[b]) ? std::nanf("") : s[b]);
  }
}

at::Tensor new_packed_mask(const at::Tensor& x) {
  const int64_t bytes = packed_mask_bytes(x.numel());
  const int64_t padded = (x.numel() + 31) / 32 * 4;
  return at::empty({padded}, x.options().dtype(at::kByte)).narrow(0, 0, bytes);
}

void check_ste_args(const at::Tensor& grad, const at::Tensor& mask) {
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kByte,
                   op_names::kSteGrad, ": mask must be uint8 (bit-packed), got ",
                   mask.scalar_type());
  TORCH_CHECK_VALUE(mask.dim() == 1 && mask.numel() == packed_mask_bytes(grad.numel()),
                    op_names::kSteGrad, ": mask must have ceil(grad.numel() / 8) = ",
                    packed_mask_bytes(grad.numel()), " bytes, got shape ", mask.sizes());
  TORCH_CHECK(mask.device() == grad.device(), op_names::kSteGrad, ": mask is on ", mask.device(),
              " but grad is on ", grad.device());
  check_float_dtype(op_names::kSteGrad, "grad", grad);
}

}  // namespace pt2e_fq
