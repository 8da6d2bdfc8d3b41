// The FSDP differential test: generated models under generated options, trained a few steps on
// 1-4 ranks (threads, real Gloo over loopback), against one process that trains the same model
// the same way. Every parameter must match (fp32: rtol 1e-5, atol 1e-6; bf16 against a bf16
// reference: rtol 2e-2, atol 2e-3), and every rank's buffers must match its replica's.
//
// The reference holds one replica per rank in one process: each runs its rank's examples and
// micro-batches, gradients are averaged over replicas, then every replica steps. Without
// BatchNorm this is one process on the global batch; with it, each replica's batch
// statistics are its rank's, as data-parallel training defines them.
//
//   FSDP_DIFF_SEED=<seed>      replay one case
//   FSDP_DIFF_CASES=<n>        cases from FSDP_DIFF_BASE (default 1) on (default 300)
//   FSDP_DIFF_SECONDS=<s>      keep drawing cases from a random base for s seconds
#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <unordered_set>

#include "fsdp/common/error.hpp"
#include "model_gen.hpp"
#include "torch_ranks.hpp"

namespace fsdp::testing::diff {
namespace {

using Params = std::vector<std::pair<std::string, at::Tensor>>;

struct Outcome {
  Params params;                                 // rank 0's full parameters / replica 0's
  std::vector<std::vector<at::Tensor>> buffers;  // per rank
};

struct Data {
  at::Tensor x, y;  // [steps, global batch, in/out]
};

Data makeData(const CaseSpec& c) {
  std::int64_t global = 0;
  for (const auto n : c.localBatch) global += n;
  auto gen = at::detail::createCPUGenerator(c.seed ^ 0x5eedULL);
  return {at::randn({c.steps, global, c.model.in}, gen), at::randn({c.steps, global, c.model.out}, gen)};
}

std::int64_t globalBatch(const CaseSpec& c) {
  std::int64_t n = 0;
  for (const auto b : c.localBatch) n += b;
  return n;
}

// Rank r's micro-batches of step s.
std::vector<std::pair<at::Tensor, at::Tensor>> microBatches(const CaseSpec& c, const Data& d, int s, int r) {
  std::int64_t first = 0;
  for (int k = 0; k < r; ++k) first += c.localBatch[static_cast<std::size_t>(k)];
  const auto n = c.localBatch[static_cast<std::size_t>(r)];
  const auto xs = d.x[s].narrow(0, first, n).tensor_split(c.microBatches);
  const auto ys = d.y[s].narrow(0, first, n).tensor_split(c.microBatches);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (std::size_t m = 0; m < xs.size(); ++m) out.emplace_back(xs[m], ys[m]);
  return out;
}

// Squared error summed, scaled so that averaging over ranks gives the global batch's mean.
at::Tensor lossOf(const CaseSpec& c, const at::Tensor& out, const at::Tensor& y) {
  const double scale = static_cast<double>(c.world) / static_cast<double>(globalBatch(c) * c.model.out);
  return (out.to(at::kFloat) - y).pow(2).sum() * scale;
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const CaseSpec& c, std::vector<at::Tensor> params) {
  if (c.optimizer == OptimizerKind::kSgd) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  // eps above rounding noise: a gradient that is zero in exact arithmetic (a bias followed by
  // BatchNorm) is rounding noise, which Adam's division by its own size turns into a full step.
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01).eps(1e-3));
}

const at::Tensor& tensorOf(const at::Tensor& t) { return t; }
const at::Tensor& tensorOf(const std::pair<std::string, at::Tensor>& item) { return item.second; }

// A module used twice lists its tensors twice: each tensor once, at its first name.
template <typename Items>
Items unique(Items items) {
  std::unordered_set<const c10::TensorImpl*> seen;
  Items out;
  for (auto& item : items) {
    if (seen.insert(tensorOf(item).unsafeGetTensorImpl()).second) out.push_back(std::move(item));
  }
  return out;
}

Params namedParams(const torch::nn::Module& m) {
  Params out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
  return unique(std::move(out));
}

std::vector<at::Tensor> floatBuffers(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& b : unique(m.buffers())) out.push_back(b.detach().to(at::kFloat).clone());
  return out;
}

// ---- The reference: one process, one replica per rank ---------------------------------------

Outcome trainReference(const CaseSpec& c, const Data& data) {
  std::vector<Model> master, compute;
  std::vector<std::vector<at::Tensor>> trainable;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  for (int r = 0; r < c.world; ++r) {
    master.push_back(buildModel(c.model));
    std::vector<at::Tensor> t;
    for (auto& [name, p] : namedParams(master.back().module())) {
      if (p.requires_grad()) t.push_back(p);
    }
    opts.push_back(makeOptimizer(c, t));
    trainable.push_back(std::move(t));
    if (c.bf16) {
      compute.push_back(buildModel(c.model));
      compute.back().module().to(at::kBFloat16);
    }
  }
  if (c.dropout()) torch::manual_seed(c.seed);
  for (int s = 0; s < c.steps; ++s) {
    for (int r = 0; r < c.world; ++r) {
      opts[static_cast<std::size_t>(r)]->zero_grad();
      auto& run = c.bf16 ? compute[static_cast<std::size_t>(r)] : master[static_cast<std::size_t>(r)];
      if (c.bf16) {
        at::NoGradGuard noGrad;
        auto from = unique(master[static_cast<std::size_t>(r)].module().parameters());
        auto to = unique(run.module().parameters());
        for (std::size_t i = 0; i < from.size(); ++i) {
          to[i].copy_(from[i]);
          to[i].mutable_grad() = at::Tensor();
        }
      }
      for (auto& [x, y] : microBatches(c, data, s, r)) {
        lossOf(c, run.forward(c.bf16 ? x.to(at::kBFloat16) : x), y).backward();
      }
      if (c.bf16) {
        auto from = unique(run.module().parameters());
        auto to = unique(master[static_cast<std::size_t>(r)].module().parameters());
        for (std::size_t i = 0; i < from.size(); ++i) {
          if (from[i].grad().defined()) to[i].mutable_grad() = from[i].grad().clone();  // bf16
        }
      }
    }
    // Average over replicas (what the reduce-scatter does, in its dtype), then every replica
    // steps alike. A bf16 reduction sums in bf16 over Gloo; shared memory sums in fp32 and
    // rounds once.
    at::NoGradGuard noGrad;
    const bool bf16Sum = c.bf16Reduce && !fsdp::testing::testsUseSharedMemory();
    for (std::size_t i = 0; i < trainable[0].size(); ++i) {
      at::Tensor sum;
      for (int r = 0; r < c.world; ++r) {
        auto g = trainable[static_cast<std::size_t>(r)][i].grad();
        if (!g.defined()) continue;
        g = g.to(c.bf16Reduce ? at::kBFloat16 : at::kFloat).to(bf16Sum ? at::kBFloat16 : at::kFloat);
        sum = sum.defined() ? sum + g : g.clone();
      }
      if (!sum.defined()) continue;
      sum = sum.div_(c.world);
      if (c.bf16Reduce) sum = sum.to(at::kBFloat16);
      sum = sum.to(at::kFloat);
      for (int r = 0; r < c.world; ++r) trainable[static_cast<std::size_t>(r)][i].mutable_grad() = sum.clone();
    }
    for (int r = 0; r < c.world; ++r) {
      if (c.clip > 0) torch::nn::utils::clip_grad_norm_(trainable[static_cast<std::size_t>(r)], c.clip);
      opts[static_cast<std::size_t>(r)]->step();
    }
  }
  Outcome out;
  for (const auto& [name, p] : namedParams(master[0].module())) out.params.emplace_back(name, p.detach().clone());
  for (int r = 0; r < c.world; ++r) {
    out.buffers.push_back(floatBuffers((c.bf16 ? compute : master)[static_cast<std::size_t>(r)].module()));
  }
  return out;
}

// ---- FSDP on c.world ranks -------------------------------------------------------------------

Outcome trainFsdp(const CaseSpec& c, const Data& data) {
  using namespace std::chrono_literals;
  Outcome out;
  out.buffers.resize(static_cast<std::size_t>(c.world));
  std::mutex mutex;
  runRanks(c.world, [&](RankContext& ctx) {
    Model net = buildModel(c.model);
    if (c.syncModuleStates && ctx.rank != 0) {
      at::NoGradGuard noGrad;  // rank 0's values must win
      for (auto& p : unique(net.module().parameters())) p.add_(0.5);
      for (auto& b : unique(net.module().buffers())) {
        if (at::isFloatingType(b.scalar_type())) b.add_(0.25);
      }
    }
    auto options = fsdpOptions(c);
    worker::HybridGroups groups;
    if (c.strategy == worker::ShardingStrategy::kHybridShard) {
      groups = worker::makeHybridGroups(ctx.store, {.rank = ctx.rank,
                                                    .worldSize = ctx.world,
                                                    .localWorldSize = c.hybridLocal,
                                                    .timeout = 30s,
                                                    .sharedMemoryShard = ctx.sharedMemory});
      options.shardGroup = groups.shard.get();
      options.replicateGroup = groups.replicate.get();
    }
    worker::FullyShardedDataParallel model(net.root(), ctx.comm, options);
    auto opt = makeOptimizer(c, model->parameters());
    model->checkOptimizer(*opt);
    if (c.dropout()) torch::manual_seed(c.seed);
    for (int s = 0; s < c.steps; ++s) {
      opt->zero_grad();
      const auto parts = microBatches(c, data, s, ctx.rank);
      for (std::size_t m = 0; m < parts.size(); ++m) {
        const auto step = [&] { lossOf(c, model->forward(parts[m].first), parts[m].second).backward(); };
        if (m + 1 < parts.size()) {
          auto guard = model->noSync();
          step();
        } else {
          step();
        }
      }
      if (c.clip > 0) model->clipGradNorm(c.clip);
      opt->step();
    }
    for (const auto& u : model->units()) {
      if (u.fullBytes != 0 && c.strategy != worker::ShardingStrategy::kNoShard) {
        throw Error("unit '" + u.path + "' holds " + std::to_string(u.fullBytes) +
                    " bytes of full parameters after the step");
      }
    }
    auto full = model->fullParameters();
    auto buffers = floatBuffers(*model->module());
    std::scoped_lock lock(mutex);
    out.buffers[static_cast<std::size_t>(ctx.rank)] = std::move(buffers);
    if (ctx.rank == 0) out.params = std::move(full);
  });
  return out;
}

// Empty when equal; else what differs first.
std::string compare(const CaseSpec& c, const Outcome& expected, const Outcome& actual) {
  // Adam divides each gradient by its running magnitude: where a gradient's terms nearly cancel,
  // a last-bit difference in the reduction's summation order (a ring over ranks here, a loop
  // over replicas in the reference) becomes a visible step. SGD cases hold the fp32 bar.
  const bool adam = c.optimizer == OptimizerKind::kAdam;
  const double rtol = c.bf16 ? 2e-2 : (adam ? 1e-4 : 1e-5);
  const double atol = c.bf16 ? 5e-3 : (adam ? 1e-4 : 1e-6);
  std::ostringstream diff;
  if (expected.params.size() != actual.params.size()) {
    diff << expected.params.size() << " parameters expected, " << actual.params.size() << " returned";
    return diff.str();
  }
  for (std::size_t i = 0; i < expected.params.size(); ++i) {
    const auto& [name, want] = expected.params[i];
    const auto& [gotName, got] = actual.params[i];
    if (name != gotName || want.sizes() != got.sizes()) {
      diff << "parameter " << i << ": '" << gotName << "' " << got.sizes() << " where '" << name << "' "
           << want.sizes() << " was expected";
      return diff.str();
    }
    if (!at::allclose(got, want, rtol, atol)) {
      diff << "parameter '" << name << "' differs by up to " << (got - want).abs().max().item<double>();
      return diff.str();
    }
  }
  for (int r = 0; r < c.world; ++r) {
    const auto& want = expected.buffers[static_cast<std::size_t>(r)];
    const auto& got = actual.buffers[static_cast<std::size_t>(r)];
    if (want.size() != got.size()) {
      diff << "rank " << r << ": " << got.size() << " buffers where " << want.size() << " were expected";
      return diff.str();
    }
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (!at::allclose(got[i], want[i], rtol, atol)) {
        diff << "rank " << r << ": buffer " << i << " differs by up to " << (got[i] - want[i]).abs().max().item<double>();
        return diff.str();
      }
    }
  }
  return {};
}

// Runs one case; empty when it passed, else why not.
std::string runCase(std::uint64_t seed) {
  const CaseSpec c = drawCase(seed);
  std::cout << c.describe() << std::endl;  // the last line names a case that hangs
  try {
    const Data data = makeData(c);
    const Outcome expected = trainReference(c, data);
    const Outcome actual = trainFsdp(c, data);
    return compare(c, expected, actual);
  } catch (const std::exception& e) {
    return std::string("threw: ") + e.what();
  }
}

std::uint64_t envNumber(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  return text == nullptr || *text == '\0' ? fallback : std::strtoull(text, nullptr, 10);
}

TEST(FsdpDifferential, GeneratedModelsAndOptionsMatchOneProcess) {
  // Kernels that split their work over threads sum in an order that depends on the thread
  // count; ranks are threads here, so every kernel runs single-threaded, as in the reference.
  at::set_num_threads(1);
  std::vector<std::uint64_t> seeds;
  const char* replay = std::getenv("FSDP_DIFF_SEED");
  const std::uint64_t seconds = envNumber("FSDP_DIFF_SECONDS", 0);
  if (replay != nullptr && *replay != '\0') {
    seeds.push_back(std::strtoull(replay, nullptr, 10));
  } else if (seconds == 0) {
    const std::uint64_t base = envNumber("FSDP_DIFF_BASE", 1);
    const std::uint64_t cases = envNumber("FSDP_DIFF_CASES", FSDP_DIFF_DEFAULT_CASES);
    for (std::uint64_t i = 0; i < cases; ++i) seeds.push_back(base + i);
  }
  int failures = 0;
  std::size_t ran = 0;
  const auto report = [&](std::uint64_t seed, const std::string& why) {
    if (why.empty()) return;
    ++failures;
    ADD_FAILURE() << "FSDP differential case failed: " << drawCase(seed).describe() << "\n  " << why
                  << "\n  replay: FSDP_DIFF_SEED=" << seed << " " << ::testing::internal::GetArgvs()[0]
                  << " --gtest_filter=FsdpDifferential.*";
  };
  const auto start = std::chrono::steady_clock::now();
  for (const auto seed : seeds) {
    report(seed, runCase(seed));
    ++ran;
    if (failures >= 5) break;
  }
  if (seconds > 0) {
    std::mt19937_64 pick(std::random_device{}());
    while (failures < 5 && std::chrono::steady_clock::now() - start < std::chrono::seconds(seconds)) {
      const std::uint64_t seed = pick() % 1'000'000'000ULL;
      report(seed, runCase(seed));
      ++ran;
    }
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "fsdp differential: " << ran << " cases, " << failures << " failed, " << elapsed << " s" << std::endl;
}

}  // namespace
}  // namespace fsdp::testing::diff
