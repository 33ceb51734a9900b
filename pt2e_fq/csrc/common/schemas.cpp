// Operator schemas of the pt2e_fq library and the Python module stub that
// loads them (`import pt2e_fq._C`).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// An empty module: importing it runs the static TORCH_LIBRARY registrations.
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
}
