// Launchers of the CUDA kernels. Plain C++ and CUDA runtime types only: the
// .cu files include no torch header, so `nvcc -c` checks them on machines
// without a CUDA build of torch. binding.cpp adapts them to torch tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "pt2e_fq/affine.h"
#include "pt2e_fq/block_layout.h"

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

}  // namespace pt2e_fq::cuda
