// Operator schemas of the float-format fake-quant ops (FP8, FP4, MX, NVFP4).
// Element formats are named by strings ("e4m3", "e5m2", "e2m1") rather than
// ScalarType: torch.export.save cannot serialize torch.float4_e2m1fn_x2.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(pt2e_fq, m) {
  // Static scales of shape ceil(x.shape / block_size). Returns (y, packed mask).
  m.def(
      "fake_quantize_float(Tensor x, SymInt[] block_size, Tensor scale, str fmt) "
      "-> (Tensor, Tensor)");
  // E8M0 scales computed per block of `block_size` along `axis`. Returns
  // (y, packed mask, block scales as fp32 of x.shape with the axis cut to
  // ceil(size / block_size)).
  m.def(
      "fake_quantize_mx(Tensor x, str elem_fmt, int block_size, int axis) "
      "-> (Tensor, Tensor, Tensor)");
  // E2M1 in blocks of 16 along `axis` with E4M3 block scales under an fp32
  // global scale (computed from x's amax when None). Returns (y, packed mask,
  // E4M3 block scales as fp32, global scale as a 0-dim fp32 tensor).
  m.def(
      "fake_quantize_nvfp4(Tensor x, Tensor? global_scale, int axis) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}
