#pragma once
// The one place that knows LibTorch's version differences: Debian's 1.13 (CPU) on our machines,
// a PyTorch 2.x wheel's LibTorch on GPU machines. Each difference is told apart by what LibTorch
// declares (a type trait or a requires-expression), never by a version number, and each branch
// is a template that tests/unit/worker/torch_compat_test.cpp compiles and runs here, against the
// real 1.13 types and against stand-ins shaped like 2.x's.
//
// Where one spelling compiles against both there is no branch: e.g. a generic lambda takes
// watchKey's c10::optional (1.13) or std::optional (2.x) arguments alike.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace fsdp::worker::compat {

// ---- Optimizer state keys -------------------------------------------------------------------
// Optimizer::state() maps a parameter to its state. 1.13 keys it by the parameter's TensorImpl
// address as text (c10::guts::to_string: an ostream's rendering of the pointer); 2.x keys it by
// the address itself (`state_[p.unsafeGetTensorImpl()]`, a void*), and c10::guts::to_string is
// gone. The map's key_type says which.
template <typename Key>
Key optimizerStateKeyAs(const at::Tensor& param) {
  c10::TensorImpl* const impl = param.unsafeGetTensorImpl();
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;  // what c10::guts::to_string does for a pointer
    text << static_cast<const void*>(impl);
    return text.str();
  } else if constexpr (std::is_same_v<Key, void*>) {
    return impl;
  } else {
    static_assert(sizeof(Key) == 0, "an optimizer state map keyed neither by text nor by void*");
  }
}

// The key of `param`'s entry in `states` (an Optimizer::state(), or anything shaped like one).
template <typename StateMap>
typename std::remove_cvref_t<StateMap>::key_type optimizerStateKey(const StateMap& /*states*/,
                                                                   const at::Tensor& param) {
  return optimizerStateKeyAs<typename std::remove_cvref_t<StateMap>::key_type>(param);
}

// ---- Gradient accumulators ------------------------------------------------------------------
// What torch::autograd::impl::grad_accumulator returns: std::shared_ptr<Node> in 1.13 and up to
// at least 2.11, c10::intrusive_ptr<Node> after autograd moved Node to intrusive counting. Both
// offer get() and ->; holding whichever it returns keeps the accumulator alive (autograd itself
// keeps only a weak reference).
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// ---- c10d::Store::watchKey ------------------------------------------------------------------
namespace detail {
template <typename MemberPointer>
struct MemberClass {};
template <typename Class, typename Member>
struct MemberClass<Member Class::*> {
  using type = Class;
};
}  // namespace detail

// Whether `Store` itself implements watchKey. 1.13's c10d::TCPStore does; in 2.x only the base
// c10d::Store declares it, deprecated, and it throws. (`&Store::watchKey` names the class that
// declares the member, so an inherited one is told from an own one.)
template <typename Store>
constexpr bool implementsWatchKey() {
  if constexpr (requires { &Store::watchKey; }) {
    return std::is_same_v<typename detail::MemberClass<decltype(&Store::watchKey)>::type, Store>;
  } else {
    return false;
  }
}

}  // namespace fsdp::worker::compat
