// Every operator schema of the pt2e_fq library, and the Python module stub
// that loads them (`import pt2e_fq._C`). The CPU and CUDA implementations
// register in cpu/ and cuda/ (TORCH_LIBRARY_IMPL).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// An empty module: importing it runs the static TORCH_LIBRARY registrations.
// Limited API only (PyModule_Create), so _C is one abi3 module for CPython 3.10+.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(pt2e_fq, m) {
  // Returns (y, packed clamp mask of ceil(numel / 8) bytes).
  m.def(
      "fake_quantize_affine(Tensor x, SymInt[] block_size, Tensor scale, Tensor? zero_point, "
      "int quant_min, int quant_max, Tensor? minval=None) -> (Tensor, Tensor)");
  // Straight-through estimator: grad where the packed mask bit is set, else 0.
  m.def("ste_grad(Tensor grad, Tensor mask) -> Tensor");

  // Learnable ranges (LSQ / LSQ+). Forward: y of fake_quantize_affine, bit
  // for bit (zero_point may also be floating: it is rounded half to even
  // after clamping to [quant_min, quant_max]). The backward op recomputes
  // the mask from x and returns (dx, d scale, d offset), the last two fp32
  // of shape ceil(x.shape / block_size), summed per block in a fixed order
  // and times grad_factor; d offset is minval's derivative when minval is
  // given, else a floating zero point's. grad_factor None: LSQ's per block,
  // 1 / sqrt(n * quant_max) with n the block's own element count.
  m.def(
      "fake_quantize_affine_learnable(Tensor x, SymInt[] block_size, Tensor scale, "
      "Tensor? zero_point, int quant_min, int quant_max, float? grad_factor, "
      "Tensor? minval=None) -> Tensor");
  m.def(
      "fake_quantize_affine_learnable_backward(Tensor grad, Tensor x, SymInt[] block_size, "
      "Tensor scale, Tensor? zero_point, int quant_min, int quant_max, float? grad_factor, "
      "Tensor? minval=None) -> (Tensor, Tensor, Tensor)");

  // Fused observe-and-fake-quantize (a static point's training step while
  // its observer is on): per block of block_size, folds the batch's finite
  // range into the running range min_val / max_val (averaging_constant None:
  // running min / max, MinMaxObserver; else the moving average of
  // MovingAverageMinMaxObserver), adds the count of non-finite values to
  // nonfinite, writes the range's qparams into scale and offset, and returns
  // (y, packed mask) of the static op on them. All in place on x's device,
  // no host sync. scheme: "symmetric" | "symmetric_no_clip" | "asymmetric"
  // (offset: the int32 zero point) | "minval" (offset: the fp32 minval); ranges are clamped to
  // [-range_limit, range_limit] first (qparams.int_range_limit).
  m.def(
      "fake_quantize_affine_observe(Tensor x, SymInt[] block_size, Tensor(a!) min_val, "
      "Tensor(b!) max_val, Tensor(c!) scale, Tensor(d!) offset, Tensor(e!) nonfinite, "
      "int quant_min, int quant_max, str scheme, float range_limit, "
      "float? averaging_constant=None) -> (Tensor, Tensor)");
  // The same for the float formats with static scales (fake_quantize_float).
  m.def(
      "fake_quantize_float_observe(Tensor x, SymInt[] block_size, Tensor(a!) min_val, "
      "Tensor(b!) max_val, Tensor(c!) scale, Tensor(d!) nonfinite, str fmt, "
      "float? averaging_constant=None) -> (Tensor, Tensor)");

  // HistogramObserver's binning: per block of block_size, the count of x's
  // finite values in each of `bins` equal bins over [lo, hi] (fp32, one
  // per block), bin floor((v - lo) / (hi - lo) * bins) computed in float64
  // (the last bin takes v = hi; a one-point range puts every value in bin
  // 0; values outside the range go to the end bins; NaN / Inf in no bin, so
  // a block with the empty range (+inf, -inf) counts nothing; hi <= lo bins
  // with width 1 from lo). Returns (counts: float64 of shape
  // ceil(x.shape / block_size) + (bins,), the number of NaN / Inf values of
  // x as a 0-dim int64). CPU only: on CUDA the observer bins with ATen ops
  // (observers.py says why).
  m.def(
      "block_histogram(Tensor x, SymInt[] block_size, Tensor lo, Tensor hi, int bins) "
      "-> (Tensor, Tensor)");
  // Its range pass: per block, the fp32 min and max of x's finite values
  // ((+inf, -inf) for a block with none). CPU only, as block_histogram.
  m.def("block_finite_range(Tensor x, SymInt[] block_size) -> (Tensor, Tensor)");

  // The float-format ops (FP8, FP4, MX, NVFP4). Element formats are named by
  // strings ("e4m3", "e5m2", "e2m1") rather than ScalarType:
  // torch.export.save cannot serialize torch.float4_e2m1fn_x2.

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
