// FSDP against single-process training: 1-4 ranks as threads of this process, real Gloo
// collectives over a real store server on loopback.
#include "fsdp/worker/fsdp.hpp"

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include <map>
#include <mutex>

#include "fsdp/common/error.hpp"
#include "torch_ranks.hpp"

namespace fsdp::worker {
namespace {

using namespace std::chrono_literals;

// A block that declares a unit inside itself (nested wrapping).
class NestedImpl : public torch::nn::Module {
 public:
  NestedImpl(int in, int out) {
    inner = register_module("inner", Unit(torch::nn::Linear(in, out)));
    outer = register_module("outer", torch::nn::Linear(out, out));
  }
  torch::Tensor forward(torch::Tensor x) { return outer(torch::tanh(inner(x))); }
  Unit inner{nullptr};
  torch::nn::Linear outer{nullptr};
};
TORCH_MODULE(Nested);

// A parameter on a device Gloo does not serve.
class MetaNetImpl : public torch::nn::Module {
 public:
  MetaNetImpl() {
    weight = register_parameter("weight", at::empty({3, 4}, at::TensorOptions().device(at::kMeta)));
  }
  torch::Tensor forward(torch::Tensor x) { return x; }
  torch::Tensor weight;
};
TORCH_MODULE(MetaNet);

enum class ModelKind { kUneven, kFrozen, kNested };

// The same values on every rank, whatever the global generator did: every parameter is
// overwritten from a fixed function of its position.
torch::nn::Sequential makeModel(ModelKind kind) {
  torch::nn::Sequential model;
  model->push_back("fc1", torch::nn::Linear(13, 37));
  model->push_back("act1", torch::nn::Tanh());
  if (kind == ModelKind::kNested) {
    model->push_back("block", Nested(37, 29));
  } else {
    model->push_back("fc2", torch::nn::Linear(37, 29));
  }
  model->push_back("act2", torch::nn::Tanh());
  model->push_back("fc3", torch::nn::Linear(29, 5));
  at::NoGradGuard noGrad;
  double k = 0.1;
  for (auto& p : model->parameters()) {
    p.copy_(at::sin(at::arange(p.numel(), at::kFloat).mul(0.37).add(k)).reshape(p.sizes()).mul(0.3));
    k += 0.7;
  }
  if (kind == ModelKind::kFrozen) {
    model->named_parameters()["fc2.bias"].set_requires_grad(false);
    model->named_parameters()["fc1.weight"].set_requires_grad(false);
  }
  return model;
}

struct Data {
  at::Tensor x, y;
};
Data makeData(int steps, int batch) {
  auto gen = at::detail::createCPUGenerator(1234);
  return {at::randn({steps, batch, 13}, gen), at::randn({steps, batch, 5}, gen)};
}

constexpr int kSteps = 20;
constexpr int kBatch = 12;  // global batch, split over the ranks

using Params = std::vector<std::pair<std::string, at::Tensor>>;

// The reference: one process, the whole batch.
Params trainSingle(ModelKind kind, const Data& data, double clip = 0) {
  auto model = makeModel(kind);
  std::vector<at::Tensor> trainable;
  for (auto& p : model->parameters()) {
    if (p.requires_grad()) trainable.push_back(p);
  }
  torch::optim::SGD opt(trainable, torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto loss = torch::nn::functional::mse_loss(model->forward(data.x[s]), data.y[s]);
    loss.backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(trainable, clip);
    opt.step();
  }
  Params result;
  for (const auto& item : model->named_parameters()) {
    result.emplace_back(item.key(), item.value().detach().clone());
  }
  return result;
}

using fsdp::testing::RankContext;
using fsdp::testing::runRanks;

struct Case {
  ShardingStrategy strategy;
  int world;
  ModelKind kind;
  bool autoWrap = true;
  BackwardPrefetch prefetch = BackwardPrefetch::kPre;
  bool forwardPrefetch = false;
  bool checkpointing = false;
  double clip = 0;
};

std::string caseName(const Case& c) {
  static const char* kinds[] = {"Uneven", "Frozen", "Nested"};
  std::string name = std::string(toString(c.strategy)) + "_" + std::to_string(c.world) + "ranks_" +
                     kinds[static_cast<int>(c.kind)];
  std::erase(name, '_');
  if (!c.autoWrap) name += "RootOnly";
  if (c.prefetch == BackwardPrefetch::kPost) name += "PostPrefetch";
  if (c.prefetch == BackwardPrefetch::kNone) name += "NoPrefetch";
  if (c.forwardPrefetch) name += "ForwardPrefetch";
  if (c.checkpointing) name += "Checkpointed";
  if (c.clip > 0) name += "Clipped";
  return name;
}

// Trains the case on its ranks; returns rank 0's gathered full parameters.
Params trainSharded(const Case& c, const Data& data) {
  Params result;
  std::mutex mutex;
  runRanks(c.world, [&](RankContext& ctx) {
    FsdpOptions options{.strategy = c.strategy,
                        .backwardPrefetch = c.prefetch,
                        .forwardPrefetch = c.forwardPrefetch,
                        .activationCheckpointing = c.checkpointing};
    if (c.autoWrap) options.autoWrap = AutoWrapPolicy::minParams(100);
    HybridGroups groups;
    if (c.strategy == ShardingStrategy::kHybridShard) {
      groups = makeHybridGroups(ctx.store, {.rank = ctx.rank,
                                            .worldSize = ctx.world,
                                            .localWorldSize = ctx.world / 2,
                                            .timeout = 30s});
      options.shardGroup = groups.shard.get();
      options.replicateGroup = groups.replicate.get();
    }
    FullyShardedDataParallel model(makeModel(c.kind), ctx.comm, options);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    model->checkOptimizer(opt);
    const int local = kBatch / ctx.world;
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto x = data.x[s].narrow(0, ctx.rank * local, local);
      auto y = data.y[s].narrow(0, ctx.rank * local, local);
      auto loss = torch::nn::functional::mse_loss(model->forward(x), y);
      loss.backward();
      if (c.clip > 0) model->clipGradNorm(c.clip);
      opt.step();
    }
    auto full = model->fullParameters();
    if (ctx.rank == 0) {
      std::scoped_lock lock(mutex);
      result = std::move(full);
    }
  });
  return result;
}

void expectSameParameters(const Params& expected, const Params& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(expected[i].first, actual[i].first);
    ASSERT_EQ(expected[i].second.sizes(), actual[i].second.sizes()) << expected[i].first;
    EXPECT_TRUE(at::allclose(actual[i].second, expected[i].second, 1e-5, 1e-6))
        << expected[i].first << ": max difference "
        << (actual[i].second - expected[i].second).abs().max().item<double>();
  }
}

class FsdpExactness : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpExactness, TwentyStepsMatchOneProcessWithTheSameGlobalBatch) {
  const Case& c = GetParam();
  const auto data = makeData(kSteps, kBatch);
  const auto expected = trainSingle(c.kind, data, c.clip);
  const auto actual = trainSharded(c, data);
  expectSameParameters(expected, actual);
  // Frozen parameters never move.
  if (c.kind == ModelKind::kFrozen) {
    const auto initial = makeModel(c.kind)->named_parameters();
    for (const auto& [name, value] : actual) {
      if (name == "fc2.bias" || name == "fc1.weight") {
        EXPECT_TRUE(at::equal(value, initial[name]));
      }
    }
  }
}

std::vector<Case> exactnessCases() {
  std::vector<Case> cases;
  for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                              ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
    for (const int world : {2, 4}) {
      for (const auto kind : {ModelKind::kUneven, ModelKind::kFrozen, ModelKind::kNested}) {
        cases.push_back({strategy, world, kind});
      }
    }
  }
  cases.push_back({ShardingStrategy::kFullShard, 2, ModelKind::kUneven, false});
  cases.push_back({ShardingStrategy::kFullShard, 3, ModelKind::kUneven});
  cases.push_back({ShardingStrategy::kFullShard, 2, ModelKind::kNested, true,
                   BackwardPrefetch::kPost, true});
  cases.push_back({ShardingStrategy::kFullShard, 4, ModelKind::kUneven, true,
                   BackwardPrefetch::kNone});
  cases.push_back({ShardingStrategy::kFullShard, 2, ModelKind::kUneven, true,
                   BackwardPrefetch::kPre, false, true});
  cases.push_back({ShardingStrategy::kFullShard, 2, ModelKind::kFrozen, true,
                   BackwardPrefetch::kPre, false, false, 0.05});
  cases.push_back({ShardingStrategy::kHybridShard, 4, ModelKind::kUneven, true,
                   BackwardPrefetch::kPre, false, false, 0.05});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpExactness, ::testing::ValuesIn(exactnessCases()),
                         [](const auto& info) { return caseName(info.param); });

TEST(FsdpMemory, FullParametersAreReleasedAfterForwardAndAfterBackward) {
  runRanks(2, [](RankContext& ctx) {
    FullyShardedDataParallel model(makeModel(ModelKind::kUneven), ctx.comm,
                                   {.autoWrap = AutoWrapPolicy::minParams(100)});
    const auto before = model->units();
    ASSERT_EQ(before.size(), 4u);  // root + fc1, fc2, fc3
    for (const auto& u : before) {
      EXPECT_EQ(u.fullBytes, 0) << u.path;
      EXPECT_EQ(u.shardNumel * 2, (u.numel + 1) / 2 * 2) << u.path;
    }
    auto out = model->forward(at::ones({4, 13}));
    for (const auto& u : model->units()) {
      if (u.path.empty()) continue;  // the root keeps its parameters for the coming backward
      EXPECT_FALSE(u.unsharded) << u.path;
      EXPECT_EQ(u.fullBytes, 0) << u.path << " still holds its full parameters after forward";
    }
    out.sum().backward();
    for (const auto& u : model->units()) {
      EXPECT_FALSE(u.unsharded) << u.path;
      EXPECT_EQ(u.fullBytes, 0) << u.path << " still holds its full parameters after backward";
    }
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
  });
}

TEST(FsdpMemory, ShardGradOpKeepsParametersUntilBackward) {
  runRanks(2, [](RankContext& ctx) {
    FullyShardedDataParallel model(makeModel(ModelKind::kUneven), ctx.comm,
                                   {.strategy = ShardingStrategy::kShardGradOp,
                                    .autoWrap = AutoWrapPolicy::minParams(100)});
    auto out = model->forward(at::ones({4, 13}));
    for (const auto& u : model->units()) {
      if (u.numel > 0) {
        EXPECT_GT(u.fullBytes, 0) << u.path;
      }
    }
    out.sum().backward();
    for (const auto& u : model->units()) EXPECT_EQ(u.fullBytes, 0) << u.path;
  });
}

TEST(FsdpNoSync, AccumulatedMicroBatchesEqualOneBigBatch) {
  const auto data = makeData(1, kBatch);
  // Reference: one step on the whole batch.
  auto reference = makeModel(ModelKind::kUneven);
  torch::nn::functional::mse_loss(reference->forward(data.x[0]), data.y[0]).backward();
  std::vector<at::Tensor> expected;
  {
    torch::optim::SGD opt(reference->parameters(), 0.1);
    opt.step();
    for (const auto& p : reference->parameters()) expected.push_back(p.detach().clone());
  }
  runRanks(2, [&](RankContext& ctx) {
    FullyShardedDataParallel model(makeModel(ModelKind::kUneven), ctx.comm,
                                   {.autoWrap = AutoWrapPolicy::minParams(100)});
    torch::optim::SGD opt(model->parameters(), 0.1);
    // Each rank: 6 samples in two micro-batches of 3; the first accumulates without syncing.
    const auto x = data.x[0].narrow(0, ctx.rank * 6, 6);
    const auto y = data.y[0].narrow(0, ctx.rank * 6, 6);
    {
      auto guard = model->noSync();
      (torch::nn::functional::mse_loss(model->forward(x.narrow(0, 0, 3)), y.narrow(0, 0, 3)) * 0.5)
          .backward();
      for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
    }
    (torch::nn::functional::mse_loss(model->forward(x.narrow(0, 3, 3)), y.narrow(0, 3, 3)) * 0.5)
        .backward();
    opt.step();
    const auto full = model->fullParameters();
    ASSERT_EQ(full.size(), expected.size());
    for (std::size_t i = 0; i < full.size(); ++i) {
      EXPECT_TRUE(at::allclose(full[i].second, expected[i], 1e-5, 1e-6)) << full[i].first;
    }
  });
}

TEST(FsdpMixedPrecision, Bf16ComputeKeepsFp32ShardsAndTracksFp32Training) {
  const auto data = makeData(kSteps, kBatch);
  const auto expected = trainSingle(ModelKind::kUneven, data);
  runRanks(2, [&](RankContext& ctx) {
    FullyShardedDataParallel model(makeModel(ModelKind::kUneven), ctx.comm,
                                   {.autoWrap = AutoWrapPolicy::minParams(100),
                                    .mixedPrecision = MixedPrecision::parse("bf16")});
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto x = data.x[s].narrow(0, ctx.rank * 6, 6);
      auto out = model->forward(x);
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      torch::nn::functional::mse_loss(out.to(at::kFloat), data.y[s].narrow(0, ctx.rank * 6, 6))
          .backward();
      for (const auto& p : model->parameters()) EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
      opt.step();
    }
    const auto full = model->fullParameters();
    for (std::size_t i = 0; i < full.size(); ++i) {
      EXPECT_TRUE(at::allclose(full[i].second, expected[i].second, 0.05, 0.02)) << full[i].first;
    }
  });
}

TEST(FsdpBadUse, WrappingTwiceIsRefused) {
  runRanks(1, [](RankContext& ctx) {
    auto net = makeModel(ModelKind::kUneven);
    FullyShardedDataParallel model(net, ctx.comm);
    try {
      FullyShardedDataParallel again(net, ctx.comm);
      FAIL() << "a second wrap was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("wrapped once"), std::string::npos) << e.what();
    }
    EXPECT_THROW(FullyShardedDataParallel(model, ctx.comm), ConfigError);
  });
}

TEST(FsdpBadUse, AnOptimizerBuiltBeforeWrappingIsNamed) {
  runRanks(1, [](RankContext& ctx) {
    auto net = makeModel(ModelKind::kUneven);
    torch::optim::SGD early(net->parameters(), 0.1);
    FullyShardedDataParallel model(net, ctx.comm);
    try {
      model->checkOptimizer(early);
      FAIL() << "an optimizer over the original parameters was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("built before wrapping"), std::string::npos);
    }
    torch::optim::SGD right(model->parameters(), 0.1);
    EXPECT_NO_THROW(model->checkOptimizer(right));
  });
}

TEST(FsdpBadUse, ModelsThatDifferAcrossRanksAreDetectedAtWrapTime) {
  std::atomic<int> refused{0};
  runRanks(2, [&](RankContext& ctx) {
    torch::nn::Sequential net(torch::nn::Linear(4, ctx.rank == 0 ? 3 : 5));
    try {
      FullyShardedDataParallel model(net, ctx.comm);
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1's model differs from rank 0's"),
                std::string::npos)
          << e.what();
      ++refused;
    }
  });
  EXPECT_EQ(refused.load(), 2);  // every rank refuses, none hangs
}

TEST(FsdpBadUse, ParametersOnAnotherDeviceThanTheCommunicatorsAreNamed) {
  // No GPU here: a tensor on the meta device stands for "not what Gloo takes".
  runRanks(1, [](RankContext& ctx) {
    MetaNet net;
    try {
      FullyShardedDataParallel model(net, ctx.comm);
      FAIL();
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'weight' is on meta"), std::string::npos) << what;
      EXPECT_NE(what.find(std::string(ctx.comm.backendName()) + " communicator takes cpu tensors"), std::string::npos)
          << what;
    }
  });
}

TEST(FsdpBadUse, HybridShardWithoutGroupsAndBadOptionsAreConfigErrors) {
  runRanks(1, [](RankContext& ctx) {
    EXPECT_THROW(FullyShardedDataParallel(makeModel(ModelKind::kUneven), ctx.comm,
                                          {.strategy = ShardingStrategy::kHybridShard}),
                 ConfigError);
    EXPECT_THROW(FullyShardedDataParallel(makeModel(ModelKind::kUneven), ctx.comm,
                                          {.limitAllGathers = 0}),
                 ConfigError);
    EXPECT_THROW(parseShardingStrategy("FULL"), ConfigError);
    EXPECT_THROW(MixedPrecision::parse("fp8"), ConfigError);
  });
}

TEST(FsdpWrap, TypeNamePolicyWrapsMatchingChildrenOnly) {
  runRanks(2, [](RankContext& ctx) {
    FullyShardedDataParallel model(makeModel(ModelKind::kNested), ctx.comm,
                                   {.autoWrap = AutoWrapPolicy::byTypeName({"Nested"})});
    std::vector<std::string> paths;
    for (const auto& u : model->units()) paths.push_back(u.path);
    EXPECT_EQ(paths, (std::vector<std::string>{"", "block", "block.inner"}));
    // Parameter names in the optimizer's view: one flat shard per unit.
    EXPECT_EQ(model->parameters().size(), 3u);
  });
}

TEST(FsdpWrap, WhatIsRegisteredOnTheRootSequentialItselfSurvivesAutoWrap) {
  runRanks(2, [](RankContext& ctx) {
    torch::manual_seed(3);
    torch::nn::Sequential net(torch::nn::Linear(6, 8), torch::nn::Functional(torch::relu), torch::nn::Linear(8, 4));
    const at::Tensor mask = at::arange(4, at::kFloat);
    net->register_buffer("mask", mask.clone());
    const at::Tensor scale = at::full({3}, 0.5);  // FSDP takes the registered one's memory: a copy
    net->register_parameter("scale", scale.clone());
    FullyShardedDataParallel model(net, ctx.comm, {.autoWrap = AutoWrapPolicy::byTypeName({"Linear"})});
    EXPECT_EQ(model->units().size(), 3u);  // the root and both Linears
    const auto buffers = model->module()->named_buffers();
    ASSERT_TRUE(buffers.contains("mask"));
    EXPECT_TRUE(buffers["mask"].equal(mask));
    std::map<std::string, at::Tensor> full;
    for (auto& [name, value] : model->fullParameters()) full[name] = value;
    ASSERT_EQ(full.count("scale"), 1u) << "the root Sequential's own parameter left the model";
    EXPECT_TRUE(full["scale"].equal(scale));
  });
}

}  // namespace
}  // namespace fsdp::worker
