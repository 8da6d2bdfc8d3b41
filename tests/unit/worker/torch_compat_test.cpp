// torch_compat.hpp: each LibTorch 1.13/2.x branch against what it stands for. The branch this
// LibTorch selects runs against LibTorch's own types; the other runs against a stand-in shaped
// like that version's (a state map keyed by void* and filled as 2.x's Adam fills it, stores
// that inherit or override watchKey), so both compile and both are checked on every build.
#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <c10/util/flat_hash_map.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fsdp/worker/torch_compat.hpp"

namespace {

namespace compat = fsdp::worker::compat;

std::vector<at::Tensor> leaves() {
  return {at::randn({3, 2}).requires_grad_(true), at::randn({5}).requires_grad_(true),
          at::randn({1}).requires_grad_(true)};
}

void giveGradients(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) p.mutable_grad() = at::ones_like(p);
}

// Every parameter's state is found under the key torch_compat makes, and each under its own.
template <typename Optimizer>
void expectEveryStateFound(Optimizer& optimizer, const std::vector<at::Tensor>& params) {
  const auto& states = optimizer.state();
  ASSERT_EQ(states.size(), params.size());
  std::set<const void*> found;
  for (const auto& p : params) {
    const auto it = states.find(compat::optimizerStateKey(states, p));
    ASSERT_TRUE(it != states.end()) << "no state under the key of a " << p.sizes() << " tensor";
    found.insert(it->second.get());
  }
  EXPECT_EQ(found.size(), params.size());
}

// One step of `Optimizer` over fresh parameters, then every state found.
template <typename Optimizer, typename Options>
void expectEveryStateFoundAfterAStep(const Options& options) {
  auto params = leaves();
  Optimizer optimizer(params, options);
  giveGradients(params);
  optimizer.step();
  expectEveryStateFound(optimizer, params);
}

// The branch this LibTorch selects (text keys on 1.13, void* keys on 2.x) finds the state that
// LibTorch's own optimizers created, for every optimizer whose state a checkpoint saves.
TEST(TorchCompat, StateKeyFindsWhatThisLibTorchsOptimizersCreated) {
  namespace optim = torch::optim;
  expectEveryStateFoundAfterAStep<optim::Adam>(optim::AdamOptions(1e-3).amsgrad(true));
  expectEveryStateFoundAfterAStep<optim::AdamW>(optim::AdamWOptions(1e-3));
  expectEveryStateFoundAfterAStep<optim::SGD>(optim::SGDOptions(1e-2).momentum(0.9));
  expectEveryStateFoundAfterAStep<optim::RMSprop>(optim::RMSpropOptions(1e-2));
  auto params = leaves();
  optim::Adagrad adagrad(params, optim::AdagradOptions(1e-2));  // state at birth, before any step
  expectEveryStateFound(adagrad, params);
}

// Shaped like 2.x's torch::optim::Optimizer where keys matter: state() is keyed by void*, and a
// step creates and finds the state as 2.x's Adam::step does, under p.unsafeGetTensorImpl().
class VoidKeyedOptimizer {
 public:
  using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

  explicit VoidKeyedOptimizer(std::vector<at::Tensor> params) : params_(std::move(params)) {}

  void step() {
    for (const auto& p : params_) {
      if (state_.find(p.unsafeGetTensorImpl()) == state_.end()) {
        auto state = std::make_unique<torch::optim::AdamParamState>();
        state->exp_avg(at::zeros_like(p));
        state_[p.unsafeGetTensorImpl()] = std::move(state);
      }
      auto& state = static_cast<torch::optim::AdamParamState&>(*state_[p.unsafeGetTensorImpl()]);
      state.step(state.step() + 1);
    }
  }

  StateMap& state() { return state_; }

 private:
  std::vector<at::Tensor> params_;
  StateMap state_;
};

TEST(TorchCompat, VoidKeyBranchFindsStateKeyedAs2xOptimizersKeyIt) {
  static_assert(std::is_same_v<decltype(compat::optimizerStateKey(
                                   std::declval<VoidKeyedOptimizer&>().state(), at::Tensor())),
                               void*>);
  const auto params = leaves();
  VoidKeyedOptimizer optimizer(params);
  optimizer.step();
  expectEveryStateFound(optimizer, params);
  // The state a checkpoint writes back under the key is the one the next step finds.
  auto& states = optimizer.state();
  auto restored = std::make_unique<torch::optim::AdamParamState>();
  restored->step(41).exp_avg(at::zeros_like(params[0]));
  states[compat::optimizerStateKey(states, params[0])] = std::move(restored);
  optimizer.step();
  const auto& state = static_cast<const torch::optim::AdamParamState&>(
      *states.at(compat::optimizerStateKey(states, params[0])));
  EXPECT_EQ(state.step(), 42);
  EXPECT_EQ(states.size(), params.size());
}

// Keys follow the TensorImpl in both branches: a copy of the handle shares the key, a view of
// the same memory does not (LibTorch keys state by parameter, not by storage).
TEST(TorchCompat, BothKeyBranchesIdentifyTheTensorNotItsMemory) {
  const auto p = at::randn({4});
  const at::Tensor handle = p;  // NOLINT: the copy is the point
  const auto view = p.view({2, 2});
  EXPECT_EQ(compat::optimizerStateKeyAs<std::string>(p),
            compat::optimizerStateKeyAs<std::string>(handle));
  EXPECT_NE(compat::optimizerStateKeyAs<std::string>(p),
            compat::optimizerStateKeyAs<std::string>(view));
  EXPECT_EQ(compat::optimizerStateKeyAs<void*>(p), compat::optimizerStateKeyAs<void*>(handle));
  EXPECT_NE(compat::optimizerStateKeyAs<void*>(p), compat::optimizerStateKeyAs<void*>(view));
}

// The handle torch_compat holds (std::shared_ptr<Node> or c10::intrusive_ptr<Node>, whatever
// grad_accumulator returns) is the accumulator backward runs: its post hook fires once a step.
class CountingHook : public torch::autograd::FunctionPostHook {
 public:
  explicit CountingHook(int& calls) : calls_(calls) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    ++calls_;
    return outputs;
  }

 private:
  int& calls_;
};

TEST(TorchCompat, HeldGradAccumulatorIsTheOneBackwardRuns) {
  auto p = at::randn({3}).requires_grad_(true);
  int calls = 0;
  compat::GradAccumulatorPtr accumulator = torch::autograd::impl::grad_accumulator(p);
  ASSERT_NE(accumulator.get(), nullptr);
  const auto key = accumulator->add_post_hook(std::make_unique<CountingHook>(calls));
  (p * 2).sum().backward();
  (p * 3).sum().backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(torch::autograd::impl::grad_accumulator(p).get(), accumulator.get());
  EXPECT_TRUE(accumulator->del_post_hook(key));
}

// Stand-ins for c10d's stores: 2.x's base Store declares watchKey (deprecated, throws) and
// TCPStore inherits it; 1.13's TCPStore overrides it; a later Store may have none at all.
struct BaseStore {
  virtual ~BaseStore() = default;
  virtual void watchKey(const std::string&, int) {}
};
struct InheritsWatchKey : BaseStore {};
struct OverridesWatchKey : BaseStore {
  void watchKey(const std::string&, int) override {}
};
struct DeclaresWatchKey {
  void watchKey(const std::string&, int) {}
};
struct HasNoWatchKey {};

TEST(TorchCompat, WatchKeyCountsOnlyWhereTheStoreItselfImplementsIt) {
  EXPECT_TRUE(compat::implementsWatchKey<OverridesWatchKey>());
  EXPECT_TRUE(compat::implementsWatchKey<DeclaresWatchKey>());
  EXPECT_FALSE(compat::implementsWatchKey<InheritsWatchKey>());
  EXPECT_FALSE(compat::implementsWatchKey<HasNoWatchKey>());
}

}  // namespace
