// A training program that uses fsdp::Snapshotter directly (no Trainer), run under fsdprun by
// snapshot_test.cpp:
//   snapshot_worker OUT_DIR STEPS KILL_STEP [--other_model] [--copy] [--frozen_unit]
// First attempt: trains STEPS steps (a snapshot after each); rank 1 SIGKILLs itself after
// KILL_STEP. Every rank writes the hash of its parameter shard and optimizer state after each
// step to OUT_DIR/hash_<rank>_<step>. A restarted attempt restores, checks the restored state
// against the hash written for that step, trains to the end, and rank 0 prints one JSON line:
// {"restored": step | null, "matches": bool, "steps": n}. With --other_model the restart builds
// a model of other shapes: the snapshot must be refused (nothing restored). --frozen_unit: each
// Linear is a unit of its own and the first is frozen (no gradient, no optimizer state), and a
// BatchNorm between them is a unit too (its running statistics are in the hash). The optimizer steps
// through snapshots.step() (no copy), or with --copy through optimizer.step() after wait() (the
// snapshot copies). Without --copy, after step 3 the state must be frozen(): views of it kept to
// the end still hold step 3's values ("frozen_held" in the JSON line; null with --copy).
// "restored_in_place": frozen() right after the restore on every rank (the state lies in the
// piece the restore mapped, not copied); "matches" too is every rank's. --kill_again: the second attempt's rank 1 SIGKILLs itself right after its
// first optimizer step, before that step's snapshot: the third attempt restores the step the
// second one did, which that step (in place with --copy) must have left unchanged.
#include <ATen/Functions.h>
#include <signal.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/snapshot.hpp"
#include "state_hash.hpp"


int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: snapshot_worker OUT_DIR STEPS KILL_STEP [--other_model]\n");
    return 2;
  }
  const std::string out = argv[1];
  const int steps = std::stoi(argv[2]);
  const int killStep = std::stoi(argv[3]);
  bool otherModel = false, copy = false, frozenUnit = false, killAgain = false;
  for (int i = 4; i < argc; ++i) {
    killAgain = killAgain || std::string(argv[i]) == "--kill_again";
    otherModel = otherModel || std::string(argv[i]) == "--other_model";
    copy = copy || std::string(argv[i]) == "--copy";
    frozenUnit = frozenUnit || std::string(argv[i]) == "--frozen_unit";
  }
  auto rt = fsdp::init();
  const bool restarted = rt->env().restartCount > 0;
  torch::manual_seed(7);
  torch::nn::Sequential net(torch::nn::Linear(32, 64));
  if (frozenUnit) net->push_back(torch::nn::BatchNorm1d(64));
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Dropout(0.3));
  net->push_back(torch::nn::Linear(64, restarted && otherModel ? 5 : 4));
  fsdp::FsdpOptions options;
  if (frozenUnit) {
    for (auto& p : net[0]->parameters()) p.set_requires_grad(false);
    options.autoWrap = fsdp::AutoWrapPolicy::minParams(1);
  }
  fsdp::FullyShardedDataParallel model(net, rt->comm(), options);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  fsdp::Snapshotter snapshots(*rt);

  std::int64_t step = 0;
  std::optional<std::int64_t> restored;
  bool matches = true;
  bool restoredInPlace = false;
  if (auto progress = snapshots.restore(model, &optimizer)) {
    restoredInPlace = snapshots.frozen(model, optimizer);
    step = progress->step;
    restored = step;
    std::ifstream in(out + "/hash_" + std::to_string(rt->rank()) + "_" + std::to_string(step));
    std::string expected;
    std::getline(in, expected);
    matches = expected == fsdp::testing::adamStateHash(model, optimizer);
    if (!matches) {
      std::fprintf(stderr, "rank %d (restart %d): the restored state differs from step %lld's\n", rt->rank(),
                   rt->env().restartCount, static_cast<long long>(step));
    }
  }
  const std::int64_t checkStep = step + 2;  // this attempt's second step
  bool frozenAtCheck = false;
  std::vector<at::Tensor> held, values;  // at checkStep: the state's memory, and its values then
  for (; step < steps;) {
    // Each step's input and dropout from the step alone: a step done again after a restart from
    // further back is the same step, bit for bit (its hash file is written again; a piece of
    // the first attempt's may still be what a later restore reads).
    torch::manual_seed(100 + 1000 * rt->rank() + step);
    const auto x = at::randn({16, 32});
    optimizer.zero_grad();
    model->forward(x).pow(2).mean().backward();
    if (copy) {
      snapshots.wait();
      optimizer.step();
    } else {
      snapshots.step(model, optimizer);
    }
    ++step;
    if (killAgain && rt->env().restartCount == 1 && rt->rank() == 1 && restored && step == *restored + 1) {
      ::kill(::getpid(), SIGKILL);
    }
    // The state's hash goes to disk before its snapshot can exist, whole (renamed into place): the
    // agent stops this rank as soon as a peer dies, maybe in the middle of this step.
    const std::string hashFile = out + "/hash_" + std::to_string(rt->rank()) + "_" + std::to_string(step);
    std::ofstream(hashFile + ".tmp") << fsdp::testing::adamStateHash(model, optimizer) << "\n";
    std::filesystem::rename(hashFile + ".tmp", hashFile);
    snapshots.save(model, &optimizer, {.step = step});
    // Views of the frozen state (a checkpoint writer's) must not stop the next step from
    // writing into a snapshot again.
    if (step == checkStep + 1) frozenAtCheck = frozenAtCheck && snapshots.frozen(model, optimizer);
    if (step == checkStep) {
      frozenAtCheck = snapshots.frozen(model, optimizer);
      for (const auto& p : model->parameters()) held.push_back(p.detach());
      for (const auto& [key, state] : optimizer.state()) {
        const auto& adam = static_cast<const torch::optim::AdamParamState&>(*state);
        // Views, as a checkpoint plan holds them (the state's own tensors move to the next
        // step's memory).
        held.push_back(adam.exp_avg().detach());
        held.push_back(adam.exp_avg_sq().detach());
      }
      for (const auto& t : held) values.push_back(t.clone());
    }
    if (!restarted && rt->rank() == 1 && step == killStep) {
      snapshots.wait();
      ::kill(::getpid(), SIGKILL);
    }
  }
  snapshots.wait();
  // Every rank's answer, not rank 0's alone (rank 1 is the one killed again).
  auto agreed = at::tensor({matches ? 1.0 : 0.0, restoredInPlace ? 1.0 : 0.0}, at::kDouble);
  rt->cpuComm().allReduce(agreed, fsdp::ReduceOp::kMin).wait();
  matches = agreed[0].item<double>() > 0;
  restoredInPlace = agreed[1].item<double>() > 0;
  // What a checkpoint writer reading the frozen state of checkStep would still see now.
  bool frozenHeld = frozenAtCheck && !held.empty();
  for (std::size_t i = 0; i < held.size(); ++i) frozenHeld = frozenHeld && at::equal(held[i], values[i]);
  if (rt->rank() == 0) {
    std::printf("{\"restored\": %s, \"matches\": %s, \"restored_in_place\": %s, \"steps\": %lld, \"frozen_held\": %s}\n",
                restored ? std::to_string(*restored).c_str() : "null", matches ? "true" : "false",
                restoredInPlace ? "true" : "false",
                static_cast<long long>(step), copy ? (frozenAtCheck ? "\"frozen under --copy\"" : "null")
                                                   : frozenHeld ? "true" : "false");
  }
  return 0;
}
