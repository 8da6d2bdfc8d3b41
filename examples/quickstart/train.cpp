// A complete training program for fsdprun: a classifier under FSDP with fsdp::Trainer.
//   fsdprun --nproc_per_node 2 ./train [OUT_DIR]
#include <ATen/Functions.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <string>

#include "fsdp/worker/errors.hpp"
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/trainer.hpp"

// Points in 20 dimensions, labelled (4 classes) by a fixed random teacher.
fsdp::TensorDataset makeData(std::int64_t n, std::uint64_t seed) {
  const auto x = at::randn({n, 20}, at::detail::createCPUGenerator(seed));
  const auto teacher = at::randn({20, 4}, at::detail::createCPUGenerator(7));
  return fsdp::TensorDataset(x, x.matmul(teacher).argmax(1));
}

int train(const std::string& out) {
  auto rt = fsdp::init();  // the job fsdprun started: ranks, the store, Gloo (NCCL on GPUs)
  torch::manual_seed(0);   // the same initial weights on every rank
  torch::nn::Sequential net(torch::nn::Linear(20, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                            torch::nn::ReLU(), torch::nn::Linear(256, 4));
  net->to(rt->device());   // the CPU, or this rank's GPU under NCCL
  fsdp::FullyShardedDataParallel model(net, rt->comm(),
                                       {.autoWrap = fsdp::AutoWrapPolicy::minParams(10'000)});
  torch::optim::Adam optimizer(model->parameters(), 1e-3);  // this rank's shards only
  fsdp::Trainer trainer(*rt, model, optimizer, fsdp::Trainer::crossEntropy(),
                        {.epochs = 3,
                         .globalBatch = 128,
                         .accuracy = true,
                         .metricsFile = out + "/metrics.jsonl",
                         .checkpointDir = out + "/checkpoints",  // resumes from here
                         .checkpointEvery = 50});
  const auto trainData = makeData(8192, 1), testData = makeData(2048, 2);
  const auto result = trainer.fit(trainData, &testData);
  if (rt->rank() == 0) {
    std::printf("test accuracy %.3f after %lld steps\n", result.eval.accuracy,
                static_cast<long long>(result.steps));
  }
  return 0;
}

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : ".";
  return fsdp::runMain("train", [&] { return train(out); });
}
