// mnist: ShallowNet / DeepNet on Fashion-MNIST under FSDP, over the ranks fsdprun started,
// with fsdp::Trainer: every rank takes its slice of each global batch, so N ranks train like
// one process with the same global batch; checkpoints and resume with --checkpoint_dir.
//
//   fsdprun --nproc_per_node 2 build/bin/mnist --epochs 1 --sharding FULL_SHARD
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "../common/example_utils.hpp"
#include "fashion_mnist.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/checkpoint.hpp"
#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/trainer.hpp"
#include "models.hpp"

// Test-only hangs (--fault_kind), named so that the hang report's stacks can be checked.
extern "C" __attribute__((noinline)) void fsdp_test_spin_forever() {
  volatile unsigned long spins = 0;
  for (;;) spins = spins + 1;
}

extern "C" __attribute__((noinline)) void fsdp_test_block_in_read() {
  int fds[2];
  if (::pipe(fds) != 0) return;
  char byte;
  while (::read(fds[0], &byte, 1) != 0) {  // nobody writes: blocks for good
  }
}

namespace {

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
  std::string checkpointDir;
  int checkpointEvery = 0;
  int snapshotEvery = 1;
  int keepCheckpoints = 3;
  bool asyncCheckpoint = false;
  std::string fullCheckpoint;
  int gradAccumulation = 1;
  double clipGradNorm = 0;
  std::string progress = "auto";
  std::string summaryFile;
  long long faultKillAtStep = 0;
  int faultKillRank = -1;
  std::string faultKind = "kill";
  bool faultEveryAttempt = false;
  std::string faultMarker;  // written just before the fault: a test's event
};

torch::nn::Sequential makeModel(const Flags& flags) {
  const fsdp::examples::NetOptions options{.dropout = !flags.noDropout};
  return flags.model == "shallow" ? fsdp::examples::makeShallowNet(options)
                                  : fsdp::examples::makeDeepNet(options);
}

fsdp::ProgressStyle parseProgress(const std::string& text) {
  if (text == "bar") return fsdp::ProgressStyle::kBar;
  if (text == "lines") return fsdp::ProgressStyle::kLines;
  if (text == "none") return fsdp::ProgressStyle::kNone;
  return fsdp::ProgressStyle::kAuto;
}

int run(const Flags& flags) {
  // Data first: a bad --data fails on every rank on its own, before anyone waits for peers.
  const auto train = fsdp::examples::loadFashionMnist(flags.data, true);
  const auto test = fsdp::examples::loadFashionMnist(flags.data, false);
  const fsdp::TensorDataset trainData(train.images, train.labels);
  const fsdp::TensorDataset testData(test.images, test.labels);
  // The model too, before init(): nothing here depends on the rank, and under fsdprun --standby
  // a spare worker has done it all by the time it is needed.
  torch::manual_seed(static_cast<std::uint64_t>(flags.seed));
  auto net = makeModel(flags);  // initialised on the CPU: the same weights on every device
  auto rt = fsdp::init();

  fsdp::FsdpOptions options{.strategy = fsdp::worker::parseShardingStrategy(flags.sharding),
                            .mixedPrecision = fsdp::MixedPrecision::parse(flags.mixedPrecision),
                            // Rank 0's initial weights everywhere (they agree by seed already;
                            // this makes it a contract).
                            .syncModuleStates = true};
  if (flags.minParams > 0) options.autoWrap = fsdp::AutoWrapPolicy::minParams(flags.minParams);
  const auto groups = fsdp::examples::hybridGroupsFor(*rt, options);
  net->to(rt->device());
  fsdp::FullyShardedDataParallel model(net, rt->comm(), options);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(flags.lr));

  fsdp::Trainer trainer(*rt, model, optimizer, fsdp::Trainer::nllLoss(),
                        {.epochs = flags.epochs,
                         .maxSteps = flags.maxSteps,
                         .globalBatch = flags.batchSize,
                         .gradAccumulation = flags.gradAccumulation,
                         .clipGradNorm = flags.clipGradNorm,
                         .seed = static_cast<std::uint64_t>(flags.seed),
                         .evaluateEveryEpoch = !flags.noEval,
                         .accuracy = true,
                         .logEvery = flags.logEvery,
                         .metricsFile = flags.metricsFile,
                         .progress = parseProgress(flags.progress),
                         .checkpointDir = flags.checkpointDir,
                         .checkpointEvery = flags.checkpointEvery,
                         .keepCheckpoints = flags.keepCheckpoints,
                         .asyncCheckpoint = flags.asyncCheckpoint,
                         .snapshotEvery = flags.snapshotEvery});
  // Test-only fault: the chosen rank SIGKILLs itself after a step (or hangs there: stops itself,
  // spins, blocks in a read), on the first attempt only.
  if (flags.faultKind == "backward" && flags.faultKillAtStep > 0 && rt->env().restartCount == 0) {
    // In the backward of the step after --fault_kill_at_step (first attempt only), the chosen
    // rank SIGKILLs itself and every other rank holds there for 3 s: the agent's notice reaches
    // them inside their backward, between two of its gradients.
    auto done = std::make_shared<std::int64_t>(0);
    trainer.afterStep = [done](std::int64_t step) { *done = step; };
    trainer.forward = [&flags, &rt, done](fsdp::FullyShardedDataParallel& m,
                                          const fsdp::Batch& batch) {
      auto out = m->forward(batch.input);
      if (*done == flags.faultKillAtStep && rt->env().restartCount == 0 && out.requires_grad()) {
        const bool dies = rt->rank() == flags.faultKillRank;
        out.register_hook([dies](const at::Tensor& grad) {
          if (dies) ::kill(::getpid(), SIGKILL);
          std::this_thread::sleep_for(std::chrono::seconds(3));
          return grad;
        });
      }
      return out;
    };
  } else if (flags.faultKillAtStep > 0 && rt->rank() == flags.faultKillRank &&
             (rt->env().restartCount == 0 || flags.faultEveryAttempt)) {
    trainer.afterStep = [&flags](std::int64_t step) {
      if (step != flags.faultKillAtStep) return;
      if (!flags.faultMarker.empty()) std::ofstream(flags.faultMarker) << step << "\n";
      if (flags.faultKind == "stop") ::raise(SIGSTOP);
      if (flags.faultKind == "loop") fsdp_test_spin_forever();
      if (flags.faultKind == "read") fsdp_test_block_in_read();
      ::kill(::getpid(), SIGKILL);
    };
  }
  const auto result = trainer.fit(trainData, flags.noEval ? nullptr : &testData);

  if (!flags.fullCheckpoint.empty()) fsdp::saveFullCheckpoint(*rt, model, flags.fullCheckpoint);
  // Every rank computes its own hash (a collective); rank 0 prints the summary.
  const std::string hash = fsdp::examples::paramsSha256(model);
  if (rt->rank() == 0) {
    nlohmann::json summary = {
        {"model", flags.model},
        {"sharding", flags.sharding},
        {"mixed_precision", flags.mixedPrecision},
        {"world_size", rt->worldSize()},
        {"device", rt->device().str()},
        {"backend", rt->comm().backendName()},
        {"steps", result.steps},
        {"resumed_from_step", result.resumedFrom ? nlohmann::json(*result.resumedFrom) : nlohmann::json(nullptr)},
        {"resumed_source", result.resumedFrom ? nlohmann::json(result.resumedSource) : nlohmann::json(nullptr)},
        {"train_loss", result.trainLoss},
        {"test_accuracy", result.eval.accuracy},
        {"test_loss", result.eval.loss},
        {"train_samples_per_s", result.samplesPerSecond},
        {"train_samples_per_s_steady", result.steadySamplesPerSecond},
        {"peak_rss_mb", fsdp::examples::peakRssMb()},
        {"params_sha256", hash},
    };
    if (!flags.metricsFile.empty()) summary["metrics_file"] = flags.metricsFile;
    std::cout << summary.dump() << std::endl;
    if (!flags.summaryFile.empty()) {
      std::ofstream out(flags.summaryFile);
      out << summary.dump() << '\n';
      if (!out) throw fsdp::Error("--summary_file '" + flags.summaryFile + "': cannot write it");
    }
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
  app.add_option("--log_every,--log-every", flags.logEvery, "Metrics every N steps (0 = never)")
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
  fsdp::examples::addCheckpointFlags(app, flags.checkpointDir, flags.checkpointEvery);
  fsdp::examples::addSnapshotFlag(app, flags.snapshotEvery);
  app.add_option("--keep_checkpoints,--keep-checkpoints", flags.keepCheckpoints, "Checkpoints kept (0 = all)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--async_checkpoint,--async-checkpoint", flags.asyncCheckpoint,
               "Write checkpoints on a background thread");
  app.add_option("--full_checkpoint,--full-checkpoint", flags.fullCheckpoint,
                 "At the end, write the full weights here as a {name: tensor} pickle (torch.load)");
  app.add_option("--grad_accumulation,--grad-accumulation", flags.gradAccumulation,
                 "Micro-batches per optimizer step")
      ->check(CLI::PositiveNumber);
  app.add_option("--clip_grad_norm,--clip-grad-norm", flags.clipGradNorm, "Clip the gradient norm (0 = off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--summary_file,--summary-file", flags.summaryFile,
                 "Also write the summary JSON (the last line) to this file");
  app.add_option("--progress", flags.progress, "auto (a bar on a terminal), bar, lines or none")
      ->check(CLI::IsMember({"auto", "bar", "lines", "none"}));
  app.add_option("--fault_kill_at_step", flags.faultKillAtStep,
                 "Testing only: --fault_kill_rank SIGKILLs itself after this step, first attempt only")
      ->group("");
  app.add_option("--fault_kill_rank", flags.faultKillRank, "Testing only")->group("");
  app.add_option("--fault_kind", flags.faultKind,
                 "Testing only: kill, stop, loop, read or backward")
      ->check(CLI::IsMember({"kill", "stop", "loop", "read", "backward"}))
      ->group("");
  app.add_flag("--fault_every_attempt", flags.faultEveryAttempt, "Testing only: the fault on every attempt")
      ->group("");
  app.add_option("--fault_marker", flags.faultMarker, "Testing only: a file written just before the fault")
      ->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0; every usage error exits 2, as with every tool of ours.
    return app.exit(e) == 0 ? 0 : 2;
  }
  return fsdp::runMain("mnist", [&] { return run(flags); });
}
