#include "observe_args.h"

#include <cmath>
#include <limits>

#include "affine_args.h"

namespace pt2e_fq {

namespace {
// A dtype as Python prints it (torch.float32), as the wrappers' messages say.
std::string torch_name(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}
}  // namespace

void check_state(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                 at::IntArrayRef block_size, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": ", name, " must be a ", torch_name(dtype),
                   " tensor (updated in place), got ", torch_name(t.scalar_type()));
  // Device and shape, with the wording of the qparam checks.
  qparam_as_float(x, t, name, reduced_shape(x.sizes(), block_size), op,
                  "ceil(x.shape / block_size)", /*floating=*/false);
}

ObserveInputs check_observe_args(const char* op, const at::Tensor& x, at::IntArrayRef block_size,
                                 const at::Tensor& min_val, const at::Tensor& max_val,
                                 const at::Tensor& scale, const at::Tensor& nonfinite,
                                 const c10::optional<double>& averaging_constant) {
  ObserveInputs in;
  in.layout = check_x_and_block_size(op, x, block_size);
  check_state(op, "min_val", min_val, x, block_size, at::kFloat);
  check_state(op, "max_val", max_val, x, block_size, at::kFloat);
  check_state(op, "scale", scale, x, block_size, at::kFloat);
  TORCH_CHECK_TYPE(nonfinite.scalar_type() == at::kLong && nonfinite.numel() == 1, op,
                   ": nonfinite must be a one-element int64 tensor (a counter, added to in place), "
                   "got ", torch_name(nonfinite.scalar_type()), " of shape ", nonfinite.sizes());
  TORCH_CHECK(nonfinite.device() == x.device(), op, ": nonfinite is on ", nonfinite.device(),
              " but x is on ", x.device());
  in.update = RangeUpdate{false, 0.0f};
  if (averaging_constant.has_value()) {
    const double c = *averaging_constant;
    TORCH_CHECK_VALUE(c > 0.0 && c <= 1.0, op,
                      ": averaging_constant must be in (0, 1] (None: running min / max), got ", c);
    in.update = RangeUpdate{true, static_cast<float>(c)};
  }
  in.x = x.contiguous();
  in.nblocks = min_val.numel();
  return in;
}

AffineRangeParams check_affine_observe_args(const char* op, const at::Tensor& x,
                                            at::IntArrayRef block_size, const at::Tensor& offset,
                                            int64_t quant_min, int64_t quant_max,
                                            const std::string& scheme, double range_limit) {
  constexpr int64_t kMin = std::numeric_limits<int16_t>::min();
  constexpr int64_t kMax = std::numeric_limits<int16_t>::max();
  TORCH_CHECK_VALUE(quant_min < quant_max && quant_min >= kMin && quant_max <= kMax, op,
                    ": need ", kMin, " <= quant_min < quant_max <= ", kMax,
                    ", got quant_min=", quant_min, ", quant_max=", quant_max);
  TORCH_CHECK_VALUE(std::isfinite(range_limit) && range_limit > 0.0, op,
                    ": range_limit must be finite and > 0, got ", range_limit);
  AffineRangeParams p{AffineScheme::kSymmetric, static_cast<int32_t>(quant_min),
                      static_cast<int32_t>(quant_max), static_cast<float>(range_limit)};
  if (scheme == "symmetric") {
    p.scheme = AffineScheme::kSymmetric;
  } else if (scheme == "symmetric_no_clip") {
    p.scheme = AffineScheme::kSymmetricNoClip;
  } else if (scheme == "asymmetric") {
    p.scheme = AffineScheme::kAsymmetric;
  } else if (scheme == "minval") {
    p.scheme = AffineScheme::kMinval;
  } else {
    TORCH_CHECK_VALUE(false, op,
                      ": scheme must be one of 'symmetric', 'symmetric_no_clip', 'asymmetric', 'minval', got '",
                      scheme, "'");
  }
  const bool minval = p.scheme == AffineScheme::kMinval;
  check_state(op, minval ? "offset (minval)" : "offset (zero_point)", offset, x, block_size,
              minval ? at::kFloat : at::kInt);
  return p;
}

at::Tensor writable(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

void finish_write(const at::Tensor& t, const at::Tensor& written) {
  if (!t.is_same(written)) t.copy_(written);
}

}  // namespace pt2e_fq
