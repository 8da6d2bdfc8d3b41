// detail::stepInto (snapshot.hpp): an Adam or AdamW step written into new memory must give the
// same bits as LibTorch's own optimizer.step(), step after step, for every option that changes
// the arithmetic (weight decay, AMSGrad, decoupled decay), with gradients absent on some steps.
// The reference is the step() of the LibTorch this test is built with (1.13 here, 2.x on a GPU
// machine): each run records which, as the "reference" property and in every failure.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <random>

#include "fsdp/worker/snapshot.hpp"

namespace {

struct Case {
  bool adamw = false;
  double weightDecay = 0;
  bool amsgrad = false;
};

std::unique_ptr<torch::optim::Optimizer> make(const Case& c, std::vector<at::Tensor> params) {
  if (c.adamw) {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(3e-3).weight_decay(c.weightDecay).amsgrad(c.amsgrad).betas({0.8, 0.95}));
  }
  return std::make_unique<torch::optim::Adam>(
      params, torch::optim::AdamOptions(3e-3).weight_decay(c.weightDecay).amsgrad(c.amsgrad).betas({0.8, 0.95}));
}

// Reported, not branched on: which LibTorch's Adam/AdamW step() the bits are compared with.
constexpr const char* kReference = "torch::optim::Adam/AdamW::step() of LibTorch " TORCH_VERSION;

TEST(StepInto, AdamAndAdamWWrittenElsewhereEqualTheirInPlaceStepBitForBit) {
  RecordProperty("reference", kReference);
  SCOPED_TRACE(kReference);
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  const Case cases[] = {{false, 0, false}, {false, 0.01, false}, {false, 0.01, true},
                        {true, 0, false},  {true, 0.05, false},  {true, 0.05, true}};
  for (const auto& c : cases) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", adamw " + std::to_string(c.adamw) + ", weight_decay " +
                 std::to_string(c.weightDecay) + ", amsgrad " + std::to_string(c.amsgrad));
    torch::manual_seed(rng());
    std::vector<at::Tensor> ours, theirs;
    for (int i = 0; i < 3; ++i) {
      const auto n = static_cast<std::int64_t>(1 + rng() % 5000);
      const auto init = torch::randn({n});
      ours.push_back(init.clone().requires_grad_(true));
      theirs.push_back(init.clone().requires_grad_(true));
    }
    auto ourOptimizer = make(c, ours);
    auto theirOptimizer = make(c, theirs);
    std::vector<at::Tensor> kept;  // the memory stepInto wrote into stays alive here
    const auto place = [&kept](const at::Tensor& p, const char*) {
      kept.push_back(at::empty_like(p, p.options().requires_grad(false)));
      return kept.back();
    };
    for (int step = 1; step <= 6; ++step) {
      for (std::size_t i = 0; i < ours.size(); ++i) {
        // Parameter 1 has no gradient on step 3: the step leaves it (and its state) alone.
        const bool absent = i == 1 && step == 3;
        const auto g = torch::randn({ours[i].numel()});
        ours[i].mutable_grad() = absent ? at::Tensor() : g.clone();
        theirs[i].mutable_grad() = absent ? at::Tensor() : g.clone();
      }
      const void* before = ours[0].data_ptr();
      // The first step creates the state: stepInto refuses it and changes nothing.
      const bool wrote = fsdp::worker::detail::stepInto(*ourOptimizer, place);
      EXPECT_EQ(wrote, step > 1);
      if (!wrote) {
        EXPECT_EQ(ours[0].data_ptr(), before);
        ourOptimizer->step();
      } else {
        EXPECT_NE(ours[0].data_ptr(), before) << "the parameter was not moved to the new memory";
      }
      theirOptimizer->step();
      for (std::size_t i = 0; i < ours.size(); ++i) {
        ASSERT_TRUE(torch::equal(ours[i], theirs[i])) << "parameter " << i << " differs after step " << step;
      }
    }
    // The state too: the next in-place step from it agrees as well.
    for (std::size_t i = 0; i < ours.size(); ++i) {
      const auto g = torch::randn({ours[i].numel()});
      ours[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    ourOptimizer->step();
    theirOptimizer->step();
    for (std::size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(torch::equal(ours[i], theirs[i])) << i;
  }
}

TEST(StepInto, OtherOptimizersAreLeftToTheirOwnStep) {
  auto p = torch::randn({10}).requires_grad_(true);
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1).momentum(0.9));
  p.mutable_grad() = torch::ones({10});
  sgd.step();
  const auto before = p.detach().clone();
  EXPECT_FALSE(fsdp::worker::detail::stepInto(sgd, [](const at::Tensor& t, const char*) { return at::empty_like(t); }));
  EXPECT_TRUE(torch::equal(p, before));
}

}  // namespace
