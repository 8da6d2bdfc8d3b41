// FSDP on the shapes of model users bring, each against one process: a LoRA-style frozen base
// read in backward, activation checkpointing of a block with a real Dropout, auto-wrap on an
// ordinary module and on nested Sequentials, a backward that throws, and fsdp::Trainer with
// micro-batches that do not split evenly. Ranks are threads with real Gloo over loopback.
#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <mutex>
#include <stdexcept>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/trainer.hpp"
#include "torch_ranks.hpp"

namespace fsdp::worker {
namespace {

using fsdp::testing::RankContext;
using fsdp::testing::runRanks;
using fsdp::testing::fillDeterministic;
using fsdp::testing::runRuntimes;
using Params = std::vector<std::pair<std::string, at::Tensor>>;

Params namedParams(torch::nn::Module& model) {
  Params out;
  for (const auto& item : model.named_parameters()) out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

void expectSame(const Params& expected, const Params& actual, double rtol = 1e-5, double atol = 1e-6) {
  ASSERT_EQ(expected.size(), actual.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(expected[i].first, actual[i].first);
    ASSERT_EQ(expected[i].second.sizes(), actual[i].second.sizes()) << expected[i].first;
    EXPECT_TRUE(at::allclose(actual[i].second, expected[i].second, rtol, atol))
        << expected[i].first << ": max difference "
        << (actual[i].second - expected[i].second).abs().max().item<double>();
  }
}

std::vector<at::Tensor> trainable(torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

// ---- LoRA: a frozen base layer read in backward, trainable adapters beside it ----------------

class LoraLinearImpl : public torch::nn::Module {
 public:
  LoraLinearImpl(int dim, int rank) {
    base = register_module("base", torch::nn::Linear(dim, dim));
    down = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(dim, rank).bias(false)));
    up = register_module("up", torch::nn::Linear(torch::nn::LinearOptions(rank, dim).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) {
    // In this order: the base's backward runs after the adapters' gradients have landed.
    auto frozen = base(x);
    return frozen + up(down(x));
  }
  torch::nn::Linear base{nullptr}, down{nullptr}, up{nullptr};
};
TORCH_MODULE(LoraLinear);

// A frozen embedding layer (a whole frozen unit), two LoRA layers whose bases are frozen, and
// a trainable head. Only the second LoRA layer's input requires grad, so only its frozen base
// is read in backward after its adapters' gradients have landed.
torch::nn::Sequential makeLoraModel() {
  torch::nn::Sequential m;
  m->push_back("embed", torch::nn::Linear(12, 24));
  m->push_back("act0", torch::nn::Tanh());
  m->push_back("lora1", LoraLinear(24, 3));
  m->push_back("act1", torch::nn::Tanh());
  m->push_back("lora2", LoraLinear(24, 3));
  m->push_back("act2", torch::nn::Tanh());
  m->push_back("head", torch::nn::Linear(24, 5));
  fillDeterministic(*m);
  for (auto& item : m->named_parameters()) {
    if (item.key().starts_with("embed.") || item.key().find(".base.") != std::string::npos) {
      item.value().set_requires_grad(false);
    }
  }
  return m;
}

AutoWrapPolicy loraPolicy() {
  return {[](const torch::nn::Module&, const std::string& path, std::int64_t) {
    return path == "embed" || path == "lora1" || path == "lora2";
  }};
}

struct Batches {
  at::Tensor x, y;
};
Batches makeBatches(int steps, int batch, int in, int out, std::uint64_t seed = 1234) {
  auto gen = at::detail::createCPUGenerator(seed);
  return {at::randn({steps, batch, in}, gen), at::randn({steps, batch, out}, gen)};
}

constexpr int kShapeSteps = 6;
constexpr int kShapeBatch = 12;

Params trainLoraSingle(const Batches& data) {
  auto model = makeLoraModel();
  torch::optim::Adam opt(trainable(*model), torch::optim::AdamOptions(0.01));
  for (int s = 0; s < kShapeSteps; ++s) {
    opt.zero_grad();
    torch::nn::functional::mse_loss(model->forward(data.x[s]), data.y[s]).backward();
    opt.step();
  }
  return namedParams(*model);
}

class FsdpLora : public ::testing::TestWithParam<int> {};

TEST_P(FsdpLora, FrozenBasesAndTrainableAdaptersMatchOneProcessAndHoldGradientsForAdaptersOnly) {
  const int world = GetParam();
  const auto data = makeBatches(kShapeSteps, kShapeBatch, 12, 5);
  const auto expected = trainLoraSingle(data);
  Params actual;
  std::mutex mutex;
  runRanks(world, [&](RankContext& ctx) {
    FullyShardedDataParallel model(makeLoraModel(), ctx.comm, {.autoWrap = loraPolicy()});
    std::vector<std::string> paths;
    for (const auto& u : model->units()) paths.push_back(u.path);
    ASSERT_EQ(paths, (std::vector<std::string>{"", "embed", "lora1", "lora2"}));
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    const int local = kShapeBatch / world;
    for (int s = 0; s < kShapeSteps; ++s) {
      opt.zero_grad();
      auto x = data.x[s].narrow(0, ctx.rank * local, local);
      auto y = data.y[s].narrow(0, ctx.rank * local, local);
      torch::nn::functional::mse_loss(model->forward(x), y).backward();
      // Gradient memory after backward: the trainable shards' gradients and nothing else.
      for (const auto& u : model->units()) {
        const std::int64_t trainableShard = (u.trainableNumel + world - 1) / world;
        EXPECT_EQ(u.gradBytes, trainableShard * 4) << "unit '" << u.path << "' step " << s;
        EXPECT_EQ(u.gradReductions, u.trainableNumel > 0 ? s + 1 : 0) << "unit '" << u.path << "'";
      }
      opt.step();
    }
    const auto units = model->units();
    EXPECT_EQ(units[1].trainableNumel, 0);  // embed: a whole frozen unit
    EXPECT_EQ(units[2].trainableNumel, 24 * 3 * 2);
    EXPECT_EQ(units[2].numel, 24 * 24 + 24 + 24 * 3 * 2);
    auto full = model->fullParameters();
    if (ctx.rank == 0) {
      std::scoped_lock lock(mutex);
      actual = std::move(full);
    }
  });
  expectSame(expected, actual);
  const auto initial = namedParams(*makeLoraModel());
  for (std::size_t i = 0; i < initial.size(); ++i) {
    if (initial[i].first.starts_with("embed.") || initial[i].first.find(".base.") != std::string::npos) {
      EXPECT_TRUE(at::equal(initial[i].second, actual[i].second)) << initial[i].first << " moved";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpLora, ::testing::Values(2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "Ranks"; });

// One loss over two forwards of the same model: the backward must count both forwards' calls.
TEST(FsdpLoraTwoForwards, ALossOverTwoForwardsMatchesOneProcessWithAndWithoutCheckpointing) {
  const auto data = makeBatches(kShapeSteps, kShapeBatch, 12, 5);
  const auto lossOf = [](const std::function<at::Tensor(at::Tensor)>& f, const at::Tensor& x, const at::Tensor& y) {
    const auto half = x.size(0) / 2;
    return torch::nn::functional::mse_loss(f(x.narrow(0, 0, half)), y.narrow(0, 0, half)) +
           torch::nn::functional::mse_loss(f(x.narrow(0, half, half)), y.narrow(0, half, half));
  };
  auto reference = makeLoraModel();
  torch::optim::SGD refOpt(trainable(*reference), 0.05);
  for (int s = 0; s < kShapeSteps; ++s) {
    refOpt.zero_grad();
    lossOf([&](at::Tensor x) { return reference->forward(x); }, data.x[s], data.y[s]).backward();
    refOpt.step();
  }
  const auto expected = namedParams(*reference);
  for (const bool checkpointing : {false, true}) {
    runRanks(2, [&](RankContext& ctx) {
      FullyShardedDataParallel model(makeLoraModel(), ctx.comm,
                                     {.autoWrap = loraPolicy(), .activationCheckpointing = checkpointing});
      torch::optim::SGD opt(model->parameters(), 0.05);
      for (int s = 0; s < kShapeSteps; ++s) {
        opt.zero_grad();
        lossOf([&](at::Tensor x) { return model->forward(x); }, data.x[s].narrow(0, ctx.rank * 6, 6),
               data.y[s].narrow(0, ctx.rank * 6, 6))
            .backward();
        opt.step();
      }
      SCOPED_TRACE(checkpointing ? "checkpointed" : "not checkpointed");
      expectSame(expected, model->fullParameters());
    });
  }
}

// The pattern that crashed: one explicit unit, frozen base first, trainable layer after it,
// in a unit whose input requires grad.
TEST(FsdpFrozen, AFrozenLayerBeforeATrainableOneInANonFirstUnitIsReadInBackward) {
  const auto build = [] {
    torch::nn::Sequential block(torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16));
    torch::nn::Sequential m;
    m->push_back("fc0", torch::nn::Linear(8, 16));
    m->push_back("act", torch::nn::Tanh());
    m->push_back("block", Unit(block));
    m->push_back("head", torch::nn::Linear(16, 4));
    fillDeterministic(*m);
    m->named_parameters()["block.module.0.weight"].set_requires_grad(false);
    m->named_parameters()["block.module.0.bias"].set_requires_grad(false);
    return m;
  };
  const auto data = makeBatches(kShapeSteps, kShapeBatch, 8, 4);
  auto reference = build();
  torch::optim::SGD refOpt(trainable(*reference), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int s = 0; s < kShapeSteps; ++s) {
    refOpt.zero_grad();
    torch::nn::functional::mse_loss(reference->forward(data.x[s]), data.y[s]).backward();
    refOpt.step();
  }
  const auto expected = namedParams(*reference);
  runRanks(2, [&](RankContext& ctx) {
    FullyShardedDataParallel model(build(), ctx.comm);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < kShapeSteps; ++s) {
      opt.zero_grad();
      auto x = data.x[s].narrow(0, ctx.rank * 6, 6);
      auto y = data.y[s].narrow(0, ctx.rank * 6, 6);
      torch::nn::functional::mse_loss(model->forward(x), y).backward();
      opt.step();
    }
    expectSame(expected, model->fullParameters());
  });
}

// ---- Activation checkpointing of a block with a real Dropout ---------------------------------

torch::nn::Sequential makeDropoutModel() {
  torch::nn::Sequential block(torch::nn::Linear(10, 32), torch::nn::Tanh(), torch::nn::Dropout(0.5),
                              torch::nn::Linear(32, 10));
  torch::nn::Sequential m;
  m->push_back("fc0", torch::nn::Linear(6, 10));
  m->push_back("block", Unit(block));
  m->push_back("drop", torch::nn::Dropout(0.3));
  m->push_back("head", torch::nn::Linear(10, 3));
  fillDeterministic(*m);
  return m;
}

TEST(FsdpCheckpointing, ABlockWithDropoutDrawsTheSameMasksWhenRecomputedAndMatchesThePlainModule) {
  const auto data = makeBatches(kShapeSteps, 8, 6, 3);
  torch::manual_seed(77);
  auto reference = makeDropoutModel();
  torch::optim::SGD refOpt(reference->parameters(), 0.1);
  for (int s = 0; s < kShapeSteps; ++s) {
    refOpt.zero_grad();
    torch::nn::functional::mse_loss(reference->forward(data.x[s]), data.y[s]).backward();
    refOpt.step();
  }
  const auto expected = namedParams(*reference);
  for (const bool checkpointing : {false, true}) {
    runRanks(1, [&](RankContext& ctx) {
      torch::manual_seed(77);
      FullyShardedDataParallel model(makeDropoutModel(), ctx.comm,
                                     {.activationCheckpointing = checkpointing});
      torch::optim::SGD opt(model->parameters(), 0.1);
      for (int s = 0; s < kShapeSteps; ++s) {
        opt.zero_grad();
        torch::nn::functional::mse_loss(model->forward(data.x[s]), data.y[s]).backward();
        opt.step();
      }
      SCOPED_TRACE(checkpointing ? "checkpointed" : "not checkpointed");
      expectSame(expected, model->fullParameters());
    });
  }
}

// ---- Auto-wrap --------------------------------------------------------------------------------

class PlainNetImpl : public torch::nn::Module {
 public:
  PlainNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(13, 37));
    fc2 = register_module("fc2", torch::nn::Linear(37, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(PlainNet);

TEST(FsdpAutoWrap, AnOrdinaryModuleWhoseMembersThePolicyPicksIsRefusedNamingTheMemberAndTheFix) {
  runRanks(1, [](RankContext& ctx) {
    try {
      FullyShardedDataParallel model(PlainNet(), ctx.comm, {.autoWrap = AutoWrapPolicy::minParams(100)});
      FAIL() << "auto-wrap on an ordinary module silently made " << model->units().size() << " unit(s)";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'fc1'"), std::string::npos) << what;
      EXPECT_NE(what.find("fsdp::Unit"), std::string::npos) << what;
      EXPECT_NE(what.find("Sequential"), std::string::npos) << what;
    }
    // Without a policy the same module is one root unit, as asked.
    FullyShardedDataParallel whole(PlainNet(), ctx.comm);
    EXPECT_EQ(whole->units().size(), 1u);
  });
}

TEST(FsdpAutoWrap, ReachesTheChildrenOfASequentialInsideAUnit) {
  runRanks(2, [](RankContext& ctx) {
    // LibTorch cannot hold a Sequential in a Sequential; a Unit can hold one.
    torch::nn::Sequential inUnit(torch::nn::Linear(37, 29), torch::nn::Tanh(), torch::nn::Linear(29, 29));
    torch::nn::Sequential m;
    m->push_back("stem", torch::nn::Linear(13, 37));
    m->push_back("block", Unit(inUnit));
    m->push_back("head", torch::nn::Linear(29, 5));
    FullyShardedDataParallel model(m, ctx.comm, {.autoWrap = AutoWrapPolicy::minParams(100)});
    std::vector<std::string> paths;
    for (const auto& u : model->units()) paths.push_back(u.path);
    EXPECT_EQ(paths, (std::vector<std::string>{"", "stem", "block", "block.module.0",
                                               "block.module.2", "head"}));
    auto out = model->forward(at::ones({4, 13}));
    out.sum().backward();
    for (const auto& u : model->units()) EXPECT_EQ(u.fullBytes, 0) << u.path;
  });
}

TEST(FsdpAutoWrap, ARefusalLeavesTheModelAsItWasAndItCanBeWrappedAgain) {
  runRanks(1, [](RankContext& ctx) {
    torch::nn::Sequential inner(torch::nn::Linear(13, 13), torch::nn::Linear(13, 13));
    Unit block(inner);
    torch::nn::Sequential m;
    m->push_back("block", block);
    m->push_back("plain", PlainNet());  // its Linears are members: the policy's picks lift to the root
    EXPECT_THROW(FullyShardedDataParallel(m, ctx.comm, {.autoWrap = AutoWrapPolicy::byTypeName({"Linear"})}),
                 ConfigError);
    EXPECT_EQ(block->inner().get(), inner.ptr().get()) << "the refused wrap rebuilt the unit's Sequential";
    FullyShardedDataParallel model(m, ctx.comm);
    EXPECT_EQ(model->units().size(), 2u);  // the root and the declared unit
  });
}

// ---- A backward that throws -------------------------------------------------------------------

struct ThrowInBackward : public torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, bool armed) {
    ctx->saved_data["armed"] = armed;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (ctx->saved_data["armed"].toBool()) throw std::runtime_error("injected backward failure");
    return {grads[0], torch::Tensor()};
  }
};

class GateImpl : public torch::nn::Module {
 public:
  torch::Tensor forward(torch::Tensor x) { return ThrowInBackward::apply(x, armed); }
  bool armed = false;
};
TORCH_MODULE(Gate);

TEST(FsdpBackwardFailure, AStepWhoseBackwardThrowsIsDroppedAndTheNextStepsMatchOneProcess) {
  const auto build = [] {
    torch::nn::Sequential m;
    m->push_back("fc1", torch::nn::Linear(13, 37));
    m->push_back("act1", torch::nn::Tanh());
    m->push_back("gate", Gate());
    m->push_back("fc2", torch::nn::Linear(37, 29));
    m->push_back("act2", torch::nn::Tanh());
    m->push_back("fc3", torch::nn::Linear(29, 5));
    fillDeterministic(*m);
    return m;
  };
  constexpr int kFailing = 2;
  const auto data = makeBatches(kShapeSteps, kShapeBatch, 13, 5);
  const auto trainLoop = [&](torch::nn::Sequential gateOwner, const std::function<at::Tensor(at::Tensor)>& forward,
                             torch::optim::Optimizer& opt, int rank, int world) {
    const int local = kShapeBatch / world;
    for (int s = 0; s < kShapeSteps; ++s) {
      opt.zero_grad();
      gateOwner[2]->as<GateImpl>()->armed = s == kFailing;
      auto x = data.x[s].narrow(0, rank * local, local);
      auto y = data.y[s].narrow(0, rank * local, local);
      try {
        torch::nn::functional::mse_loss(forward(x), y).backward();
      } catch (const std::exception& e) {
        EXPECT_EQ(s, kFailing) << e.what();
        continue;  // the step is dropped
      }
      opt.step();
    }
  };
  auto reference = build();
  torch::optim::SGD refOpt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  trainLoop(reference, [&](at::Tensor x) { return reference->forward(x); }, refOpt, 0, 1);
  const auto expected = namedParams(*reference);
  runRanks(2, [&](RankContext& ctx) {
    auto net = build();
    FullyShardedDataParallel model(net, ctx.comm, {.autoWrap = AutoWrapPolicy::minParams(100)});
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    trainLoop(net, [&](at::Tensor x) { return model->forward(x); }, opt, ctx.rank, ctx.world);
    expectSame(expected, model->fullParameters());
    for (const auto& u : model->units()) EXPECT_EQ(u.fullBytes, 0) << u.path;
  });
}

// ---- fsdp::Trainer with micro-batches that do not split evenly --------------------------------

TEST(TrainerAccumulation, AGlobalBatchThatDoesNotSplitEvenlyOverRanksAndMicroBatchesMatchesOneProcess) {
  const auto x = at::randn({27, 6}, at::detail::createCPUGenerator(5));
  const auto labels = x.sum(1).gt(0).to(at::kLong);
  const TensorDataset data(x, labels);
  const auto train = [&](int world, int micro) {
    Params out;
    std::mutex mutex;
    runRuntimes(world, [&](Runtime& rt) {
      torch::nn::Sequential net(torch::nn::Linear(6, 11), torch::nn::Tanh(), torch::nn::Linear(11, 2));
      fillDeterministic(*net);
      FullyShardedDataParallel model(net, rt.comm(), {.autoWrap = AutoWrapPolicy::minParams(20)});
      torch::optim::SGD opt(model->parameters(), 0.2);
      Trainer trainer(rt, model, opt, Trainer::crossEntropy(),
                      {.epochs = 1, .globalBatch = 9, .gradAccumulation = micro, .shuffle = false,
                       .evaluateEveryEpoch = false, .logEvery = 0, .progress = ProgressStyle::kNone});
      const auto result = trainer.fit(data);
      EXPECT_EQ(result.steps, 3);
      // The steady rate counts the steps past the first kWarmupSteps: here the third.
      static_assert(kWarmupSteps == 2);
      EXPECT_GT(result.steadySamplesPerSecond, 0);
      auto full = model->fullParameters();
      if (rt.rank() == 0) {
        std::scoped_lock lock(mutex);
        out = std::move(full);
      }
    });
    return out;
  };
  const auto expected = train(1, 1);
  expectSame(expected, train(2, 4));  // 5 + 4 examples per step: 2,1,1,1 and 1,1,1,1
  expectSame(expected, train(3, 2));
}

}  // namespace
}  // namespace fsdp::worker
