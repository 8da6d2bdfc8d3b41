// A fsdp::Trainer program whose rank 1 dies after an epoch's evaluation and before the next
// epoch's first step is saved, or while rank 0 waits for its file in a checkpoint save (run
// under fsdprun by trainer_epochs_test.cpp):
//   trainer_epochs_worker OUT_DIR EXAMPLES [--kill | --snapshots | --kill-in-save | --kill-in-async-save]
// EXAMPLES examples (60: 5 whole global batches of 12 an epoch; 61: the same and a last batch of
// one example, too small for 3 ranks, which every rank leaves out, so that the checkpoint at the
// epoch's end says the epoch goes on), 3 epochs, an evaluation after each, a checkpoint
// (synchronous, on disk) every 5 steps and no in-memory snapshots, so that the resume is that
// checkpoint's, at the epoch's end. --kill: in the first round, rank 1 SIGKILLs itself in the
// first training step after an evaluation (its loss function sees the model training again).
// --snapshots: the same with an in-memory snapshot every step. --kill-in-save: that, and in the
// first round rank 1 is held in its first checkpoint write (the write-delay test hook) until
// rank 0 has written its own file, which it then waits for the other ranks' beside, and dies.
// --kill-in-async-save: the same with asynchronous checkpoints (rank 0 waits on its writer thread).
// Rank 0 writes the metrics to OUT_DIR/metrics.jsonl; every rank writes OUT_DIR/final_<rank>: the
// hash of its shards, Adam state and buffers (state_hash.hpp) and its pid.
#include <signal.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "fsdp/worker/data.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/trainer.hpp"
#include "state_hash.hpp"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: trainer_epochs_worker OUT_DIR EXAMPLES [--kill]\n");
    return 2;
  }
  const std::string out = argv[1];
  const int examples = std::stoi(argv[2]);
  const std::string mode = argc > 3 ? argv[3] : "";
  const bool kill = mode == "--kill";
  const bool asyncSave = mode == "--kill-in-async-save";
  const bool killInSave = mode == "--kill-in-save" || asyncSave;
  const bool snapshots = killInSave || mode == "--snapshots";
  auto rt = fsdp::init();
  if (killInSave && rt->rank() == 1 && rt->env().round == 0) {
    ::setenv("FSDPRUN_TEST_CHECKPOINT_WRITE_DELAY", "1:600000", 1);
    std::thread([rank0 = out + "/ckpt/.step_00000005.tmp.r0/rank_00000.bin"] {
      while (!std::filesystem::exists(rank0)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ::kill(::getpid(), SIGKILL);
    }).detach();
  }
  torch::manual_seed(3);
  const auto x = torch::randn({examples, 6});
  const auto y = x.sum(1).gt(0).to(torch::kLong);
  fsdp::TensorDataset train(x, y), test(x.slice(0, 0, 24), y.slice(0, 0, 24));
  torch::nn::Sequential net(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  fsdp::FullyShardedDataParallel model(net, rt->comm(), {.syncModuleStates = true});
  torch::optim::Adam optimizer(model->parameters(), 1e-2);
  const auto crossEntropy = fsdp::Trainer::crossEntropy();
  bool evaluated = false;
  const auto loss = [&](const at::Tensor& output, const fsdp::Batch& batch) {
    if (!model->is_training()) {
      evaluated = true;
    } else if (kill && evaluated && rt->rank() == 1 && rt->env().round == 0) {
      ::kill(::getpid(), SIGKILL);
    }
    return crossEntropy(output, batch);
  };
  fsdp::Trainer trainer(*rt, model, optimizer, loss,
                        {.epochs = 3, .globalBatch = 12, .accuracy = true, .logEvery = 1,
                         .metricsFile = out + "/metrics.jsonl", .progress = fsdp::ProgressStyle::kNone,
                         .checkpointDir = out + "/ckpt", .checkpointEvery = 5, .asyncCheckpoint = asyncSave,
                         .snapshotEvery = snapshots ? 1 : 0});
  trainer.fit(train, &test);
  std::ofstream(out + "/final_" + std::to_string(rt->rank()))
      << fsdp::testing::adamStateHash(model, optimizer) << " " << ::getpid() << "\n";
  return 0;
}
