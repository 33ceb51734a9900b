// CUDA kernel of pt2e_fq::fake_quantize_affine. Plain CUDA C++: no torch.
// The tiling, vector loads and ballot-packed mask are blockwise_kernel's
// (elementwise.cuh); this file supplies the affine math per block.
#include "elementwise.cuh"
#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"

namespace pt2e_fq::cuda {
namespace {

struct AffineOp {
  struct Params {
    float scale, ioff, foff;
  };
  AffineQparams q;
  __device__ __forceinline__ Params at(int64_t b) const {
    return {q.scale[b], q.ioff_at(b), q.foff_at(b)};
  }
  __device__ __forceinline__ float apply(float v, const Params& p, bool& in_range) const {
    return fake_quantize_affine_one(v, p.scale, p.ioff, p.foff, q.qmin, q.qmax, in_range);
  }
};

}  // namespace

cudaError_t launch_fake_quantize_affine(ElemType type, const void* x, void* y,
                                        uint32_t* mask_words, int64_t numel,
                                        const AffineQparams& qparams, const BlockLayout& layout,
                                        cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  dispatch_elem_type(type, [&](auto tag) {
    launch_blockwise<decltype(tag)>(x, y, mask_words, numel, AffineOp{qparams}, layout, stream);
  });
  return cudaGetLastError();
}

}  // namespace pt2e_fq::cuda
