// The Autograd kernel of fake_quantize_affine_learnable (LSQ / LSQ+), in C++
// for the reason ste_autograd.cpp gives: a Python autograd.Function cost
// ~70 us per call.
//
// The node saves x (by reference: autograd often holds it already) and the
// qparams, not the mask: the backward op recomputes it from them, bit for
// bit the forward's, and returns (dx, d scale, d offset) per block in fp32.
// Each qparam gets its gradient in its own shape (size-1 dimensions may be
// left out) and dtype; an integer zero point gets none. Reverse mode only:
// a tangent is refused, never dropped.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <vector>

#include "autograd_node.h"
#include "op_names.h"

namespace pt2e_fq {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The op's arguments, by schema position.
enum Arg : size_t {
  kX = 0, kBlockSize, kScale, kZeroPoint, kQuantMin, kQuantMax, kGradFactor, kMinval, kNumArgs
};

struct LearnableBackward : public torch::autograd::TraceableFunction {
  variable_list apply(variable_list&& grads) override {
    // Outputs of this node: the gradients of x, scale, zero_point, minval.
    variable_list out(4);
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    static const auto backward =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("pt2e_fq::fake_quantize_affine_learnable_backward", "")
            .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, const at::Tensor&,
                const std::optional<at::Tensor>&, int64_t, int64_t, std::optional<double>,
                const std::optional<at::Tensor>&)>();
    const at::Tensor x = x_.unpack(), scale = scale_.unpack();
    const at::Tensor zero_point = zero_point_.unpack(), minval = minval_.unpack();
    const auto optional = [](const at::Tensor& t) {
      return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
    };
    auto [dx, dscale, doffset] =
        backward.call(dy.contiguous(), x, block_size_, scale, optional(zero_point), quant_min_,
                      quant_max_, grad_factor_, optional(minval));
    const auto like = [&](const at::Tensor& g, const at::Tensor& t, size_t i) {
      const bool wanted = t.defined() && at::isFloatingType(t.scalar_type()) &&
                          task_should_compute_output(i);
      return wanted ? g.reshape(t.sizes()).to(t.scalar_type()) : at::Tensor();
    };
    if (task_should_compute_output(0)) out[0] = dx;
    out[1] = like(dscale, scale, 1);
    out[2] = like(doffset, zero_point, 2);
    out[3] = like(doffset, minval, 3);
    return out;
  }

  std::string name() const override { return "FakeQuantizeAffineLearnableBackward"; }

  void release_variables() override {
    x_.reset_data();
    scale_.reset_data();
    zero_point_.reset_data();
    minval_.reset_data();
  }

  SavedVariable x_, scale_, zero_point_, minval_;
  std::vector<c10::SymInt> block_size_;
  int64_t quant_min_ = 0, quant_max_ = 0;
  std::optional<double> grad_factor_;  // None: LSQ's per block
};

at::Tensor optional_tensor(const c10::IValue& v) { return v.isNone() ? at::Tensor() : v.toTensor(); }

void learnable_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                        torch::jit::Stack* stack) {
  const auto args = torch::jit::last(*stack, kNumArgs);
  const at::Tensor x = args[kX].toTensor(), scale = args[kScale].toTensor();
  const at::Tensor zero_point = optional_tensor(args[kZeroPoint]);
  const at::Tensor minval = optional_tensor(args[kMinval]);
  for (const at::Tensor* t : {&x, &scale, &zero_point, &minval}) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        !t->defined() || !t->_fw_grad(/*level=*/0).defined(), op_names::kLearnable,
        ": forward-mode AD (jvp, jacfwd) is not supported; its backward is reverse mode only");
  }
  NodePtr<LearnableBackward> node;
  if (torch::autograd::compute_requires_grad(x, scale, zero_point, minval)) {
    node = make_node<LearnableBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, scale, zero_point, minval));
    node->x_ = SavedVariable(x, /*is_output=*/false);
    node->scale_ = SavedVariable(scale, false);
    node->zero_point_ = SavedVariable(zero_point, false);
    node->minval_ = SavedVariable(minval, false);
    node->block_size_ = args[kBlockSize].toSymIntVector();
    node->quant_min_ = args[kQuantMin].toInt();
    node->quant_max_ = args[kQuantMax].toInt();
    node->grad_factor_ = args[kGradFactor].toOptional<double>();
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  if (node) torch::autograd::set_history(stack->back().toTensor(), node);
}

}  // namespace

TORCH_LIBRARY_IMPL(pt2e_fq, Autograd, m) {
  m.impl("fake_quantize_affine_learnable",
         torch::CppFunction::makeFromBoxedFunction<&learnable_autograd>());
}

}  // namespace pt2e_fq
