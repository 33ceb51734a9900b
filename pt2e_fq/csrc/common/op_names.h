// The qualified name of each pt2e_fq operator, as its CPU and CUDA entry
// points and the argument checks name it in error messages. The schemas
// themselves are in schemas.cpp.
#pragma once

namespace pt2e_fq::op_names {

constexpr const char* kAffine = "pt2e_fq.fake_quantize_affine";
constexpr const char* kSteGrad = "pt2e_fq.ste_grad";
constexpr const char* kLearnable = "pt2e_fq.fake_quantize_affine_learnable";
constexpr const char* kLearnableBackward = "pt2e_fq.fake_quantize_affine_learnable_backward";
constexpr const char* kFloat = "pt2e_fq.fake_quantize_float";
constexpr const char* kMx = "pt2e_fq.fake_quantize_mx";
constexpr const char* kNvfp4 = "pt2e_fq.fake_quantize_nvfp4";
constexpr const char* kAffineObserve = "pt2e_fq.fake_quantize_affine_observe";
constexpr const char* kFloatObserve = "pt2e_fq.fake_quantize_float_observe";
constexpr const char* kBlockHistogram = "pt2e_fq.block_histogram";
constexpr const char* kBlockFiniteRange = "pt2e_fq.block_finite_range";

}  // namespace pt2e_fq::op_names
