// Launchers of the CUDA kernels. Plain C++ and CUDA runtime types only: the
// .cu files include no torch header, so `nvcc -c` checks them on machines
// without a CUDA build of torch. binding.cpp adapts them to torch tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"
#include "pt2e_fq/observe.h"

namespace pt2e_fq::cuda {

enum class ElemType { kFloat32, kBFloat16, kFloat16 };

// y = fake_quantize_affine(x); mask_words receives ceil(numel / 32) 32-bit
// words of the packed clamp mask (bits past numel are 0).
cudaError_t launch_fake_quantize_affine(ElemType type, const void* x, void* y,
                                        uint32_t* mask_words, int64_t numel,
                                        const AffineQparams& qparams, const BlockLayout& layout,
                                        cudaStream_t stream);

// dx = packed mask bit ? dy : 0.
cudaError_t launch_ste_grad(ElemType type, const void* dy, const uint8_t* mask, void* dx,
                            int64_t numel, cudaStream_t stream);

// The backward of the learnable affine op (LSQ / LSQ+): dx, and per block
// of `layout` (fp32, scale's layout) d scale and d offset (minval's when
// minval_offset, else a zero point's), times grad_factor's factor for the
// block (see GradFactor), summed in an order
// fixed by the sizes. `scratch` holds learnable_backward_scratch_floats(layout)
// floats of device memory.
int64_t learnable_backward_scratch_floats(const BlockLayout& layout);
cudaError_t launch_fake_quantize_affine_learnable_backward(
    ElemType type, const void* x, const void* dy, void* dx, int64_t numel,
    const AffineQparams& qparams, const BlockLayout& layout, bool minval_offset,
    const GradFactor& grad_factor, float* scratch, float* dscale, float* doffset,
    cudaStream_t stream);

// y = fake_quantize_float(x) with fp32 `scale` per block of `layout`; mask
// as for the affine op.
cudaError_t launch_fake_quantize_float(ElemType type, ElemFormat format, const void* x, void* y,
                                       uint32_t* mask_words, int64_t numel, const float* scale,
                                       const BlockLayout& layout, cudaStream_t stream);

// MX: per block of `blocks`, E8M0 scale into `scales` ([outer, nblocks,
// inner], fp32) and fake-quantized elements into y. The mask bits are OR-ed
// into mask_words, which the caller zeroes.
cudaError_t launch_fake_quantize_mx(ElemType type, ElemFormat format, const void* x, void* y,
                                    uint32_t* mask_words, float* scales, const AxisBlocks& blocks,
                                    cudaStream_t stream);

// NVFP4 (E2M1, blocks of 16): `global_scale` is one fp32 on the device. With
// amax_scratch (one zeroed device word) it is first computed from x's amax;
// with nullptr it is read as given. Mask as for MX.
cudaError_t launch_fake_quantize_nvfp4(ElemType type, const void* x, void* y,
                                       uint32_t* mask_words, float* scales, float* global_scale,
                                       uint32_t* amax_scratch, const AxisBlocks& blocks,
                                       cudaStream_t stream);

// The fused observe-and-fake-quantize ops: updates the running range
// min_val / max_val (fp32, nblocks each, the blocks of `layout`), writes the
// qparams (scale, and the int32 zero_point or the fp32 minval; ioff: nblocks
// fp32 of device scratch for the zero point as the kernel takes it), adds
// the non-finite count to *nonfinite, and fake-quantizes x into y / the
// mask as launch_fake_quantize_affine does. `scratch`: observe_scratch_words
// 32-bit words of device memory, 8-byte aligned.
int64_t observe_scratch_words(int64_t nblocks);
cudaError_t launch_fake_quantize_affine_observe(
    ElemType type, const void* x, void* y, uint32_t* mask_words, int64_t numel,
    const BlockLayout& layout, int64_t nblocks, const RangeUpdate& update,
    const AffineRangeParams& params, float* min_val, float* max_val, float* scale,
    int32_t* zero_point, float* minval, float* ioff, int64_t* nonfinite, uint32_t* scratch,
    cudaStream_t stream);
// The same for the float formats (launch_fake_quantize_float).
cudaError_t launch_fake_quantize_float_observe(ElemType type, ElemFormat format, const void* x,
                                               void* y, uint32_t* mask_words, int64_t numel,
                                               const BlockLayout& layout, int64_t nblocks,
                                               const RangeUpdate& update, float* min_val,
                                               float* max_val, float* scale, int64_t* nonfinite,
                                               uint32_t* scratch, cudaStream_t stream);

}  // namespace pt2e_fq::cuda
