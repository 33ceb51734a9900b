#include "histogram_args.h"

#include "affine_args.h"

namespace pt2e_fq {

HistogramInputs check_histogram_args(const char* op, const at::Tensor& x,
                                     at::IntArrayRef block_size, const at::Tensor& lo,
                                     const at::Tensor& hi, int64_t bins) {
  HistogramInputs in;
  in.layout = check_x_and_block_size(op, x, block_size);
  const std::vector<int64_t> reduced = reduced_shape(x.sizes(), block_size);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"lo", lo}, {"hi", hi}}) {
    check_qparam(x, t, name, reduced, op);
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name,
                     " must be a torch.float32 tensor (the running range), got ", t.scalar_type());
  }
  TORCH_CHECK_VALUE(bins >= 1 && bins <= kMaxHistogramBins, op, ": bins must be in [1, ",
                    kMaxHistogramBins, "], got ", bins);
  in.x = x.contiguous();
  in.lo = lo.contiguous();
  in.hi = hi.contiguous();
  in.nblocks = lo.numel();
  in.counts_shape = reduced;
  in.counts_shape.push_back(bins);
  return in;
}

}  // namespace pt2e_fq
