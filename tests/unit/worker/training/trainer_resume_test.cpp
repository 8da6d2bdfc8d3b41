// fsdp::Trainer resumed at an epoch's end: the epoch's evaluation, which the failure may have
// come before (or during), runs before the next epoch's first step.
#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fsdp/worker/data.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/trainer.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"
#include "torch_ranks.hpp"

namespace fsdp::worker {
namespace {

using nlohmann::json;

// 2 ranks, 3 steps an epoch; `withEval`: the test set is evaluated after each epoch. Returns the
// eval lines of the metrics file (rank 0 appends to it on a resume).
std::vector<json> fitEpochs(int epochs, bool withEval, const std::string& dir) {
  const auto x = at::randn({24, 6}, at::detail::createCPUGenerator(3));
  const auto labels = x.sum(1).gt(0).to(at::kLong);
  const TensorDataset train(x, labels);
  const TensorDataset test(x.slice(0, 0, 10), labels.slice(0, 0, 10));
  fsdp::testing::runRuntimes(2, [&](Runtime& rt) {
    torch::nn::Sequential net(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 2));
    fsdp::testing::fillDeterministic(*net);
    FullyShardedDataParallel model(net, rt.comm(), {});
    torch::optim::SGD opt(model->parameters(), 0.1);
    Trainer trainer(rt, model, opt, Trainer::crossEntropy(),
                    {.epochs = epochs, .globalBatch = 8, .shuffle = false, .accuracy = true, .logEvery = 0,
                     .metricsFile = dir + "/metrics.jsonl", .progress = ProgressStyle::kNone,
                     .checkpointDir = dir + "/ckpt", .checkpointEvery = 3,
                     .checkpointSignal = 0,  // a process-wide handler: ranks here are threads of one
                     .snapshotEvery = 0});
    trainer.fit(train, withEval ? &test : nullptr);
  });
  std::vector<json> evals;
  for (const auto& line : fsdp::testing::metricsLines(dir + "/metrics.jsonl")) {
    if (line.value("type", "") == "eval") evals.push_back(line);
  }
  return evals;
}

// The first run ends after epoch 1's last step and its checkpoint, not evaluated (as a run killed
// between the two); the second resumes there with 2 epochs: epoch 1 is evaluated first, then
// epoch 2, each as a run never stopped evaluates it.
TEST(TrainerResume, AResumeAtAnEpochsEndEvaluatesThatEpochFirst) {
  fsdp::testing::TempDir whole, cut;
  const auto reference = fitEpochs(2, true, whole.path());
  ASSERT_EQ(reference.size(), 2u);
  EXPECT_EQ(reference[0].value("step", 0), 3);
  EXPECT_TRUE(fitEpochs(1, false, cut.path()).empty());
  const auto resumed = fitEpochs(2, true, cut.path());
  ASSERT_EQ(resumed.size(), 2u) << "one evaluation per epoch";
  for (std::size_t e = 0; e < 2; ++e) {
    SCOPED_TRACE("epoch " + std::to_string(e + 1));
    for (const char* key : {"epoch", "step", "loss", "accuracy", "samples"}) {
      EXPECT_EQ(resumed[e].value(key, json()), reference[e].value(key, json())) << key;
    }
  }
}

}  // namespace
}  // namespace fsdp::worker
