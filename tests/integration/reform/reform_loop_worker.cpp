// A hand-written training loop that survives failures in process as reform.hpp's example does
// (run under fsdprun by reform_test.cpp):
//   reform_loop_worker OUT_DIR STEPS KILL_STEP [--second_model] [--misuse] [--store_wait]
// The model has a frozen first layer (a unit of its own), a BatchNorm (buffers) and trains with
// Adam through a Snapshotter; its initial weights are seeded by the restart count, so a new
// process's own weights differ from the job's until its restore. Rank 1 SIGKILLs itself after
// step KILL_STEP on the first attempt (0: never). --second_model: a frozen teacher, a second
// FSDP model over the runtime's communicator, which no re-formation can carry. --misuse: after
// step 3 of the first attempt every rank calls reformDone() and reform() with no failure
// anywhere, as a loop that calls them on its own errors would, and says on stderr what came back.
// --store_wait: after step KILL_STEP of the first attempt the other ranks wait on the runtime's
// store for a key no rank writes (60 s), through a reference taken before the loop, and say on
// stderr how that wait ended.
// Each rank writes OUT_DIR/start_<rank>_<restart> (its pid) when it starts and, at the end,
// OUT_DIR/final_<rank>: a hash of its shards, optimizer state and buffers, and its pid.
#include <ATen/Functions.h>
#include <signal.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <utility>

#include "fsdp/worker/reform.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/snapshot.hpp"
#include "state_hash.hpp"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: reform_loop_worker OUT_DIR STEPS KILL_STEP [--second_model] [--misuse] [--store_wait]\n");
    return 2;
  }
  const std::string out = argv[1];
  const int steps = std::stoi(argv[2]);
  const int killStep = std::stoi(argv[3]);
  bool secondModel = false, misuse = false, storeWait = false;
  for (int i = 4; i < argc; ++i) {
    secondModel = secondModel || std::string(argv[i]) == "--second_model";
    misuse = misuse || std::string(argv[i]) == "--misuse";
    storeWait = storeWait || std::string(argv[i]) == "--store_wait";
  }
  auto rt = fsdp::init();
  const int rank = rt->rank();
  const int restart = rt->env().restartCount;
  std::ofstream(out + "/start_" + std::to_string(rank) + "_" + std::to_string(restart))
      << ::getpid() << "\n";

  torch::manual_seed(7 + restart);
  torch::nn::Sequential net(torch::nn::Linear(24, 48), torch::nn::BatchNorm1d(48),
                            torch::nn::ReLU(), torch::nn::Linear(48, 40), torch::nn::Tanh(),
                            torch::nn::Linear(40, 3));
  for (auto& p : net[0]->parameters()) p.set_requires_grad(false);
  fsdp::FsdpOptions options{.syncModuleStates = true};
  options.autoWrap = fsdp::AutoWrapPolicy::minParams(1);
  fsdp::FullyShardedDataParallel model(net, rt->comm(), options);
  std::optional<fsdp::FullyShardedDataParallel> teacher;
  if (secondModel) {
    torch::manual_seed(11);
    torch::nn::Sequential t(torch::nn::Linear(24, 3));
    for (auto& p : t->parameters()) p.set_requires_grad(false);
    teacher.emplace(t, rt->comm(), fsdp::FsdpOptions{.syncModuleStates = true});
  }
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto snapshots = std::make_unique<fsdp::Snapshotter>(*rt);
  std::int64_t step = 0;
  if (const auto resumed = snapshots->restore(model, &optimizer)) step = resumed->step;

  fsdp::ReformScope scope(*rt, model);
  auto& store = rt->store();
  bool waitedOnStore = false;
  for (;;) {
    try {
      while (step < steps) {
        torch::manual_seed(100 + 1000 * rank + step);  // each step's input from the step alone
        const auto x = at::randn({8, 24});
        optimizer.zero_grad();
        auto y = model->forward(x);
        if (teacher) y = y - (*teacher)->forward(x);
        y.pow(2).mean().backward();
        snapshots->step(model, optimizer);
        ++step;
        snapshots->save(model, &optimizer, {.step = step});
        if (step == killStep && rank == 1 && restart == 0) ::kill(::getpid(), SIGKILL);
        if (storeWait && step == killStep && rank != 1 && restart == 0 && !std::exchange(waitedOnStore, true)) {
          try {
            store.get("reform_loop/never", std::chrono::seconds(60));
          } catch (const fsdp::CommAborted& e) {
            std::fprintf(stderr, "rank %d: the store wait ended: CommAborted: %s\n", rank, e.what());
            throw;
          } catch (const std::exception& e) {
            std::fprintf(stderr, "rank %d: the store wait ended otherwise: %s\n", rank, e.what());
            throw;
          }
        }
        if (misuse && step == 3 && restart == 0) {
          fsdp::reformDone(*rt);
          try {
            fsdp::reform(*rt, model);
            std::fprintf(stderr, "rank %d: reform() without a failure returned\n", rank);
          } catch (const fsdp::ReformError& e) {
            std::fprintf(stderr, "rank %d: misuse refused: %s\n", rank, e.what());
          }
        }
      }
      break;
    } catch (const std::exception& e) {
      if (!fsdp::reformPending(*rt)) throw;
      snapshots->wait();
      fsdp::reform(*rt, model);
      snapshots->rejoin();
      const auto resumed = snapshots->restore(model, &optimizer);
      if (!resumed) throw;
      step = resumed->step;
      fsdp::reformDone(*rt);
    }
  }
  snapshots->wait();
  std::ofstream(out + "/final_" + std::to_string(rt->rank()))
      << fsdp::testing::adamStateHash(model, optimizer) << " " << ::getpid() << "\n";
  return 0;
}
