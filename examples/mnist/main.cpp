// mnist: ShallowNet / DeepNet on Fashion-MNIST, data parallel over the ranks fsdprun started.
// Every rank takes its slice of each global batch; gradients are averaged with one
// all-reduce per step, so N ranks train exactly like one process with the same global batch.
//
//   fsdprun --standalone --nproc_per_node 2 build/bin/mnist --epochs 1
#include <sys/resource.h>

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
#include "fsdp/common/sha256.hpp"
#include "fsdp/worker/runtime.hpp"
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
};

struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

Model makeModel(const std::string& name) {
  if (name == "shallow") {
    fsdp::examples::ShallowNet net;
    return {net.ptr(), [net](const torch::Tensor& x) mutable { return net->forward(x); }};
  }
  fsdp::examples::DeepNet net;
  return {net.ptr(), [net](const torch::Tensor& x) mutable { return net->forward(x); }};
}

double peakRssMb() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// SHA-256 over every parameter's name and fp32 bytes, in registration order.
std::string paramsSha256(torch::nn::Module& module) {
  fsdp::Sha256 hash;
  for (const auto& item : module.named_parameters()) {
    hash.update(item.key());
    const auto t = item.value().detach().to(torch::kFloat).contiguous();
    hash.update(std::as_bytes(std::span(static_cast<const float*>(t.data_ptr()),
                                        static_cast<std::size_t>(t.numel()))));
  }
  return hash.hexDigest();
}

struct Eval {
  double loss = 0;
  double accuracy = 0;
};

// Each rank scores its chunk of the test set; sums are all-reduced.
Eval evaluate(Model& model, const Dataset& test, fsdp::Runtime& rt) {
  torch::NoGradGuard noGrad;
  model.module->eval();
  const auto counts = fsdp::worker::chunkSizes(test.images.size(0), rt.worldSize());
  std::int64_t begin = 0;
  for (int r = 0; r < rt.rank(); ++r) begin += counts[r];
  const std::int64_t end = begin + counts[rt.rank()];
  double lossSum = 0;
  double correct = 0;
  for (std::int64_t i = begin; i < end; i += 1000) {
    const auto n = std::min<std::int64_t>(1000, end - i);
    const auto out = model.forward(test.images.narrow(0, i, n));
    const auto labels = test.labels.narrow(0, i, n);
    lossSum += torch::nn::functional::nll_loss(
                   out, labels, torch::nn::functional::NLLLossFuncOptions().reduction(torch::kSum))
                   .item<double>();
    correct += out.argmax(1).eq(labels).sum().item<double>();
  }
  auto sums = torch::tensor({lossSum, correct, static_cast<double>(end - begin)}, torch::kDouble);
  rt.comm().allReduce(sums).wait();
  model.module->train();
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
  Model model = makeModel(flags.model);
  std::vector<torch::Tensor> params = model.module->parameters();
  // Rank 0's initial weights everywhere (they already agree by seed; this makes it a contract).
  {
    torch::NoGradGuard noGrad;
    auto flat = torch::cat([&] {
      std::vector<torch::Tensor> views;
      for (auto& p : params) views.push_back(p.view(-1));
      return views;
    }());
    rt->comm().broadcast(flat, 0).wait();
    std::int64_t offset = 0;
    for (auto& p : params) {
      p.view(-1).copy_(flat.narrow(0, offset, p.numel()));
      offset += p.numel();
    }
  }
  // Dropout differs per rank, like it differs per sample in one process.
  torch::manual_seed(static_cast<std::uint64_t>(flags.seed) * 1000003u + 1 + rank);
  torch::optim::Adam optimizer(params, torch::optim::AdamOptions(flags.lr));
  std::int64_t numel = 0;
  for (auto& p : params) numel += p.numel();
  auto flatGrad = torch::zeros({numel});

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
      const auto out = model.forward(x);
      // Sum over my samples / global batch: the all-reduced sum is the global mean.
      const auto loss = torch::nn::functional::nll_loss(
                            out, y, torch::nn::functional::NLLLossFuncOptions().reduction(torch::kSum)) /
                        static_cast<double>(global);
      loss.backward();
      {
        torch::NoGradGuard noGrad;
        std::int64_t offset = 0;
        for (auto& p : params) {
          flatGrad.narrow(0, offset, p.numel()).copy_(p.grad().view(-1));
          offset += p.numel();
        }
        auto lossCopy = loss.detach().reshape({1}).clone();
        auto gradWork = rt->comm().allReduce(flatGrad);
        auto lossWork = rt->comm().allReduce(lossCopy);
        gradWork.wait();
        offset = 0;
        for (auto& p : params) {
          p.grad().view(-1).copy_(flatGrad.narrow(0, offset, p.numel()));
          offset += p.numel();
        }
        lossWork.wait();
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
    last = evaluate(model, test, *rt);
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
  const std::string hash = paramsSha256(*model.module);
  auto rss = torch::tensor({peakRssMb()}, torch::kDouble);
  if (rank == 0) {
    nlohmann::json summary = {
        {"model", flags.model},
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
  CLI::App app{"Fashion-MNIST training under fsdprun (data parallel)", "mnist"};
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return run(flags);
  } catch (const fsdp::ConfigError& e) {
    // One write per line: several ranks share this stderr.
    std::cerr << "mnist: error: " + std::string(e.what()) + "\n" << std::flush;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "mnist: error: " + std::string(e.what()) + "\n" << std::flush;
    return 1;
  }
}
