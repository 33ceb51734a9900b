// Stand-in for CUDA's <cuda_fp16.h> in the CUDA simulation harness: __half
// as its 16 bits, converted by the bit conversions the kernels share.
#pragma once
#include "../cuda_sim.h"
#include "pt2e_fq/float_ops.h"

struct __half {
  uint16_t bits;
};

inline float __half2float(__half h) { return pt2e_fq::half_bits_to_float(h.bits); }
inline __half __float2half_rn(float f) { return __half{pt2e_fq::float_to_half_bits(f)}; }
