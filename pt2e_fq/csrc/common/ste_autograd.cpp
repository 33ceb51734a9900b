// The Autograd kernel of every straight-through op: fake_quantize_affine,
// fake_quantize_float, fake_quantize_mx, fake_quantize_nvfp4, the fused
// observe ops and ste_grad.
//
// Written as ATen's generated autograd kernels are (a Node with the mask
// saved, set_history on y, the tangent set on y for forward mode), so no
// Python runs on the call: a Python autograd.Function cost ~70 us per call.
// Being an ordinary Autograd kernel, it also composes with torch.func at
// every level (hessian, jacfwd(jacrev(f))), as ATen ops do.
//
// One boxed kernel serves every op, reading the op's schema:
// - x is argument 0; its derivative is the select `mask bit ? dy : 0`
//   (ste_grad, the op that computes it, so the STE is differentiable
//   again: d/dx sum(d(y^2)/dx) = 2 * mask, as ATen's fake-quant gives);
// - an op with several returns returns (y, packed mask, *statistics of x);
//   ste_grad returns y alone and takes the mask as argument 1;
// - every other tensor argument (a qparam) gets no gradient; one that
//   requires grad is a likely mistake, which Python warns about
//   (pt2e_fq/ops.py, _warn_qparam_grad) at the caller's line;
// - an argument the schema marks written (Tensor(a!): the observer state
//   of the fused observe ops) has its version counter bumped, as ATen's
//   ADInplaceOrView kernels do, so autograd can tell a saved tensor that
//   was changed since.
#include <Python.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "autograd_node.h"

namespace pt2e_fq {
namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

at::Tensor ste_grad(const at::Tensor& grad, const at::Tensor& mask) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pt2e_fq::ste_grad", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(grad.contiguous(), mask);
}

// dx = mask bit ? dy : 0, from the packed mask the node saves (nothing
// else: not x, not a bool mask).
struct SteBackward : public torch::autograd::TraceableFunction {
  explicit SteBackward(std::string name) : name_(std::move(name)) {}

  variable_list apply(variable_list&& grads) override {
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return {at::Tensor()};
    // No graph to build (backward without create_graph): straight to the
    // kernel, past ste_grad's own Autograd kernel (~3 us of a 30 us step).
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    if (!torch::autograd::GradMode::is_enabled()) below.emplace();
    return {ste_grad(dy, mask_.unpack())};
  }

  std::string name() const override { return name_; }
  void release_variables() override { mask_.reset_data(); }

  SavedVariable mask_;
  std::string name_;
};

// "pt2e_fq::fake_quantize_affine" -> "FakeQuantizeAffineBackward", as ATen
// names its nodes.
std::string node_name(const std::string& op) {
  std::string out;
  bool upper = true;
  for (char c : op.substr(op.find("::") + 2)) {
    if (c == '_') {
      upper = true;
      continue;
    }
    out += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(c))) : c;
    upper = false;
  }
  return out + "Backward";
}

// Calls pt2e_fq.ops._warn_qparam_grad(op, name), which warns once per
// process at the first frame outside pt2e_fq and torch. A warning turned
// into an error (-W error) comes back as this op's error.
void warn_qparam_grad(const std::string& op, const std::string& name) {
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* module = PyImport_ImportModule("pt2e_fq.ops");
  PyObject* result = module == nullptr ? nullptr
                                       : PyObject_CallMethod(module, "_warn_qparam_grad", "ss",
                                                             op.c_str(), name.c_str());
  Py_XDECREF(module);
  std::string error;
  if (result == nullptr) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* text = value == nullptr ? nullptr : PyObject_Str(value);
    const char* utf8 = text == nullptr ? nullptr : PyUnicode_AsUTF8AndSize(text, nullptr);
    error = utf8 == nullptr ? "pt2e_fq: the qparam warning failed" : utf8;
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    PyErr_Clear();
  }
  Py_XDECREF(result);
  PyGILState_Release(gil);
  TORCH_CHECK(error.empty(), error);
}

void ste_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const auto args = torch::jit::last(*stack, num_args);
  const at::Tensor x = args[0].toTensor();
  const bool mask_is_input = schema.returns().size() == 1;  // ste_grad
  const bool record = torch::autograd::compute_requires_grad(x);
  if (torch::autograd::GradMode::is_enabled()) {
    for (size_t i = 1; i < num_args; ++i) {
      if (args[i].isTensor() && args[i].toTensor().requires_grad()) {
        warn_qparam_grad(schema.name(), schema.arguments()[i].name());
        break;
      }
    }
  }
  const bool forward_ad = x._fw_grad(/*level=*/0).defined();
  const at::Tensor input_mask = mask_is_input ? args[1].toTensor() : at::Tensor();
  std::vector<at::Tensor> written;
  for (size_t i = 1; i < num_args; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) written.push_back(args[i].toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& t : written) torch::autograd::impl::bump_version(t);
  if (!record && !forward_ad) return;
  const size_t num_returns = schema.returns().size();
  const at::Tensor y = (*stack)[stack->size() - num_returns].toTensor();
  const at::Tensor mask =
      mask_is_input ? input_mask : (*stack)[stack->size() - num_returns + 1].toTensor();
  if (record) {
    auto node = make_node<SteBackward>(node_name(schema.name()));
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    node->mask_ = SavedVariable(mask, /*is_output=*/false);
    torch::autograd::set_history(y, node);
  }
  if (forward_ad) {
    y._set_fw_grad(ste_grad(x._fw_grad(0), mask), /*level=*/0, /*is_inplace_op=*/false);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, Autograd, m) {
  for (const char* name :
       {"fake_quantize_affine", "fake_quantize_float", "fake_quantize_mx", "fake_quantize_nvfp4",
        "fake_quantize_affine_observe", "fake_quantize_float_observe", "ste_grad"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&ste_autograd>());
  }
}

}  // namespace pt2e_fq
