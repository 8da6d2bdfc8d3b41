// mnist: ShallowNet / DeepNet on Fashion-MNIST under FSDP, over the ranks fsdprun started.
// Every rank takes its slice of each global batch; FSDP averages the gradients over the
// ranks, so N ranks train like one process with the same global batch.
//
//   fsdprun --standalone --nproc_per_node 2 build/bin/mnist --epochs 1 --sharding FULL_SHARD
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "fashion_mnist.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/runtime.hpp"
#include "../common/example_utils.hpp"
#include "models.hpp"

namespace {

using fsdp::examples::Dataset;
using Clock = std::chrono::steady_clock;

struct Flags {
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string model = "shallow";
  int epochs = 1;
  long long maxSteps = 0;
  int batchSize = 256;
  double lr = 1e-3;
  long long seed = 0;
  int logEvery = 50;
  std::string metricsFile;
  std::string sharding = "FULL_SHARD";
  long long minParams = 20000;  // the seed notebook's min_num_params
  std::string mixedPrecision = "no";
  bool noDropout = false;
  bool noEval = false;
};

torch::nn::Sequential makeModel(const Flags& flags) {
  const fsdp::examples::NetOptions options{.dropout = !flags.noDropout};
  return flags.model == "shallow" ? fsdp::examples::makeShallowNet(options)
                                  : fsdp::examples::makeDeepNet(options);
}

struct Eval {
  double loss = 0;
  double accuracy = 0;
};

// Each rank scores its chunk of the test set; sums are all-reduced.
Eval evaluate(fsdp::FullyShardedDataParallel& model, const Dataset& test, fsdp::Runtime& rt) {
  torch::NoGradGuard noGrad;
  model->eval();
  const auto counts = fsdp::worker::chunkSizes(test.images.size(0), rt.worldSize());
  std::int64_t begin = 0;
  for (int r = 0; r < rt.rank(); ++r) begin += counts[r];
  const std::int64_t end = begin + counts[rt.rank()];
  double lossSum = 0;
  double correct = 0;
  for (std::int64_t i = begin; i < end; i += 1000) {
    const auto n = std::min<std::int64_t>(1000, end - i);
    const auto out = model->forward(test.images.narrow(0, i, n)).to(torch::kFloat);
    const auto labels = test.labels.narrow(0, i, n);
    lossSum += torch::nn::functional::nll_loss(
                   out, labels, torch::nn::functional::NLLLossFuncOptions().reduction(torch::kSum))
                   .item<double>();
    correct += out.argmax(1).eq(labels).sum().item<double>();
  }
  auto sums = torch::tensor({lossSum, correct, static_cast<double>(end - begin)}, torch::kDouble);
  rt.comm().allReduce(sums).wait();
  model->train();
  return {sums[0].item<double>() / sums[2].item<double>(), sums[1].item<double>() / sums[2].item<double>()};
}

int run(const Flags& flags) {
  // Data first: a bad --data fails on every rank on its own, before anyone waits for peers.
  const Dataset train = fsdp::examples::loadFashionMnist(flags.data, true);
  const Dataset test = fsdp::examples::loadFashionMnist(flags.data, false);
  auto rt = fsdp::init();
  const int rank = rt->rank();
  const int world = rt->worldSize();
  if (flags.batchSize < world) {
    throw fsdp::ConfigError("--batch_size " + std::to_string(flags.batchSize) +
                            ": must be at least the world size " + std::to_string(world));
  }

  torch::manual_seed(static_cast<std::uint64_t>(flags.seed));
  fsdp::FsdpOptions options{.strategy = fsdp::worker::parseShardingStrategy(flags.sharding),
                            .mixedPrecision = fsdp::MixedPrecision::parse(flags.mixedPrecision),
                            // Rank 0's initial weights everywhere (they agree by seed already;
                            // this makes it a contract).
                            .syncModuleStates = true};
  if (flags.minParams > 0) options.autoWrap = fsdp::AutoWrapPolicy::minParams(flags.minParams);
  fsdp::worker::HybridGroups groups;
  if (options.strategy == fsdp::ShardingStrategy::kHybridShard) {
    groups = fsdp::worker::makeHybridGroups(*rt);
    options.shardGroup = groups.shard.get();
    options.replicateGroup = groups.replicate.get();
  }
  fsdp::FullyShardedDataParallel model(makeModel(flags), rt->comm(), options);
  // Dropout differs per rank, like it differs per sample in one process.
  torch::manual_seed(static_cast<std::uint64_t>(flags.seed) * 1000003u + 1 + rank);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(flags.lr));

  std::ofstream metrics;
  if (rank == 0 && !flags.metricsFile.empty()) {
    metrics.open(flags.metricsFile);
    if (!metrics) throw fsdp::ConfigError("--metrics_file '" + flags.metricsFile + "': cannot write");
  }
  const std::int64_t n = train.images.size(0);
  const std::int64_t stepsPerEpoch = (n + flags.batchSize - 1) / flags.batchSize;
  long long step = 0;
  double trainSeconds = 0;
  long long samples = 0;
  Eval last;
  bool done = false;
  for (int epoch = 1; epoch <= flags.epochs && !done; ++epoch) {
    // The same permutation on every rank: seed + epoch.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(flags.seed) + epoch);
    const auto perm = torch::randperm(n, gen, torch::kLong);
    double lossSum = 0;
    long long lossCount = 0;
    const auto epochStart = Clock::now();
    for (std::int64_t s = 0; s < stepsPerEpoch; ++s) {
      if (flags.maxSteps > 0 && step >= flags.maxSteps) {
        done = true;
        break;
      }
      const auto stepStart = Clock::now();
      const std::int64_t begin = s * flags.batchSize;
      const std::int64_t global = std::min<std::int64_t>(flags.batchSize, n - begin);
      const auto counts = fsdp::worker::chunkSizes(global, world);
      std::int64_t mine = begin;
      for (int r = 0; r < rank; ++r) mine += counts[r];
      const auto idx = perm.narrow(0, mine, counts[rank]);
      const auto x = train.images.index_select(0, idx);
      const auto y = train.labels.index_select(0, idx);

      optimizer.zero_grad();
      const auto out = model->forward(x).to(torch::kFloat);
      // FSDP averages gradients over the ranks: sum over my samples * world / global batch
      // makes that average the global batch's mean.
      const auto loss = torch::nn::functional::nll_loss(
                            out, y, torch::nn::functional::NLLLossFuncOptions().reduction(torch::kSum)) *
                        (static_cast<double>(world) / static_cast<double>(global));
      loss.backward();
      {
        auto lossCopy = loss.detach().reshape({1}).to(torch::kDouble).div(world);
        rt->comm().allReduce(lossCopy).wait();
        lossSum += lossCopy.item<double>();
        ++lossCount;
      }
      optimizer.step();
      ++step;
      samples += global;
      trainSeconds += std::chrono::duration<double>(Clock::now() - stepStart).count();
      if (rank == 0 && flags.logEvery > 0 && step % flags.logEvery == 0) {
        std::printf("epoch %d step %lld/%lld loss %.4f (%.1f samples/s)\n", epoch,
                    static_cast<long long>(s + 1), static_cast<long long>(stepsPerEpoch),
                    lossSum / static_cast<double>(lossCount), static_cast<double>(samples) / trainSeconds);
        std::fflush(stdout);
      }
    }
    if (!flags.noEval) last = evaluate(model, test, *rt);
    if (rank == 0) {
      const double epochSeconds = std::chrono::duration<double>(Clock::now() - epochStart).count();
      std::printf("epoch %d: train_loss %.4f test_loss %.4f test_accuracy %.4f (%.1f s)\n", epoch,
                  lossCount > 0 ? lossSum / static_cast<double>(lossCount) : 0.0, last.loss,
                  last.accuracy, epochSeconds);
      std::fflush(stdout);
      if (metrics.is_open()) {
        metrics << nlohmann::json{{"kind", "eval"},
                                  {"epoch", epoch},
                                  {"step", step},
                                  {"train_loss", lossCount > 0 ? lossSum / lossCount : 0.0},
                                  {"test_loss", last.loss},
                                  {"test_accuracy", last.accuracy}}
                       .dump()
                << '\n';
      }
    }
  }

  // Every rank computes its own hash; rank 0 prints the summary.
  const std::string hash = fsdp::examples::paramsSha256(model);
  auto rss = torch::tensor({fsdp::examples::peakRssMb()}, torch::kDouble);
  if (rank == 0) {
    nlohmann::json summary = {
        {"model", flags.model},
        {"sharding", flags.sharding},
        {"mixed_precision", flags.mixedPrecision},
        {"world_size", world},
        {"steps", step},
        {"test_accuracy", last.accuracy},
        {"test_loss", last.loss},
        {"train_samples_per_s", trainSeconds > 0 ? static_cast<double>(samples) / trainSeconds : 0.0},
        {"peak_rss_mb", rss.item<double>()},
        {"params_sha256", hash},
    };
    std::cout << summary.dump() << std::endl;
  }
  rt->comm().barrier().wait();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  CLI::App app{"Fashion-MNIST training under fsdprun (FSDP)", "mnist"};
  app.add_option("--data", flags.data, "Directory with the Fashion-MNIST IDX files");
  app.add_option("--model", flags.model, "shallow or deep")
      ->check(CLI::IsMember({"shallow", "deep"}));
  app.add_option("--epochs", flags.epochs, "Epochs")->check(CLI::PositiveNumber);
  app.add_option("--max_steps,--max-steps", flags.maxSteps, "Stop after this many steps (0 = no limit)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--batch_size,--batch-size", flags.batchSize, "Global batch size")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", flags.lr, "Adam learning rate")->check(CLI::PositiveNumber);
  app.add_option("--seed", flags.seed, "Seed of initialisation, shuffling and dropout");
  app.add_option("--log_every,--log-every", flags.logEvery, "Print a line every N steps (0 = never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--metrics_file,--metrics-file", flags.metricsFile, "JSONL metrics written by rank 0");
  app.add_option("--sharding", flags.sharding, "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD")
      ->check(CLI::IsMember({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}));
  app.add_option("--min_params,--min-params", flags.minParams,
                 "Auto-wrap layers with at least this many parameters as FSDP units (0 = root only)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--mixed_precision,--mixed-precision", flags.mixedPrecision, "no, bf16 or fp16")
      ->check(CLI::IsMember({"no", "bf16", "fp16"}));
  app.add_flag("--no_dropout,--no-dropout", flags.noDropout, "Leave dropout out (benchmarks)");
  app.add_flag("--no_eval,--no-eval", flags.noEval, "Skip the test-set evaluation (benchmarks)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0; every usage error exits 2, as with every tool of ours.
    return app.exit(e) == 0 ? 0 : 2;
  }
  return fsdp::runMain("mnist", [&] { return run(flags); });
}
