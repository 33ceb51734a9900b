// How an autograd Node is owned differs between the torch releases this
// project builds against (pyproject: torch >= 2.11): torch 2.11's Node is
// held by std::shared_ptr (it derives from enable_shared_from_this), newer
// releases hold it by c10::intrusive_ptr. The Autograd kernels create their
// nodes through these two names, so the same source builds against both.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace pt2e_fq {

inline constexpr bool kNodeIsIntrusive =
    std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;

// The owning pointer set_history takes for a node of type T.
template <class T>
using NodePtr = std::conditional_t<kNodeIsIntrusive, c10::intrusive_ptr<T>, std::shared_ptr<T>>;

template <class T, class... Args>
NodePtr<T> make_node(Args&&... args) {
  if constexpr (kNodeIsIntrusive) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

}  // namespace pt2e_fq
