// A hand-written training loop, as a user writes one against libfsdp, that saves a sharded
// checkpoint every few steps and stalls where the hang tests ask (hang/checkpoint_hang_test.cpp):
//   stall_worker --dir D --steps N --save_every K [--snapshots]
//                [--stall_rank R --stall_at save|load|restore --stall_step S]
//                [--crash_rank R --crash_step S] [--metrics FILE]
// The batch of step s on rank r is drawn from seed 1000*s + r alone, so a run resumed from any
// step ends with the same parameters as one never stopped. --stall_at save: rank R spins, on the
// first attempt, after step S (a save step) just before its save, in a function only this
// program has. --stall_at load / restore: on the second attempt, just before loadLatest() / the
// Snapshotter's restore(). --crash_rank: SIGKILLs itself after step S of the first attempt (so
// that a second attempt exists). Every rank writes D/final_<rank> (the hash of its parameter and
// optimizer shards); rank 0 prints one JSON line: {"steps": n, "resumed_step": s|null,
// "resumed_from": "disk"|"memory"|"peer copy"|null, "attempt": a}. --metrics: rank 0 appends a
// JSON line per step ({"type": "train", "step", "unix_time"}) and one on a resume ("resume"), the
// stalling rank one just before it stalls ("stall"): fsdp-bench hang's "save" case reads them.
#include <ATen/Functions.h>
#include <fcntl.h>
#include <signal.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "fsdp/common/error.hpp"
#include "fsdp/worker/checkpoint.hpp"
#include "fsdp/worker/flight_recorder.hpp"
#include "fsdp/worker/runtime.hpp"
#include "fsdp/worker/snapshot.hpp"
#include "state_hash.hpp"

// The user's own code where a rank gets stuck; the hang report's stacks must name them.
extern "C" __attribute__((noinline)) void stall_worker_stuck_before_save() {
  volatile unsigned long spins = 0;
  for (;;) spins = spins + 1;
}
extern "C" __attribute__((noinline)) void stall_worker_stuck_before_load() {
  volatile unsigned long spins = 0;
  for (;;) spins = spins + 1;
}
extern "C" __attribute__((noinline)) void stall_worker_stuck_before_restore() {
  volatile unsigned long spins = 0;
  for (;;) spins = spins + 1;
}

namespace {

struct Flags {
  std::string dir;
  long long steps = 12, saveEvery = 3, stallStep = -1, crashStep = -1;
  int stallRank = -1, crashRank = -1;
  std::string stallAt, metrics;
  bool snapshots = false;
};

Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw fsdp::ConfigError(a + ": expected a value");
      return argv[++i];
    };
    if (a == "--dir") f.dir = value();
    else if (a == "--steps") f.steps = std::stoll(value());
    else if (a == "--save_every") f.saveEvery = std::stoll(value());
    else if (a == "--snapshots") f.snapshots = true;
    else if (a == "--stall_rank") f.stallRank = std::stoi(value());
    else if (a == "--stall_at") f.stallAt = value();
    else if (a == "--stall_step") f.stallStep = std::stoll(value());
    else if (a == "--crash_rank") f.crashRank = std::stoi(value());
    else if (a == "--crash_step") f.crashStep = std::stoll(value());
    else if (a == "--metrics") f.metrics = value();
    else throw fsdp::ConfigError("unknown flag " + a);
  }
  if (f.dir.empty()) throw fsdp::ConfigError("--dir is required");
  return f;
}

// Appends one JSON line (one write, O_APPEND: lines of several ranks never interleave).
void metricsLine(const Flags& f, const std::string& type, long long step) {
  if (f.metrics.empty()) return;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  char line[160];
  const int n = std::snprintf(line, sizeof(line), "{\"type\": \"%s\", \"step\": %lld, \"unix_time\": %.3f}\n",
                              type.c_str(), step, now);
  const int fd = ::open(f.metrics.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  [[maybe_unused]] const auto written = ::write(fd, line, static_cast<std::size_t>(n));
  ::close(fd);
}

int run(const Flags& f) {
  auto rt = fsdp::init();
  const int rank = rt->rank();
  const int attempt = rt->env().restartCount;
  const bool stalls = rank == f.stallRank;
  torch::manual_seed(7);
  torch::nn::Sequential net(torch::nn::Linear(16, 48), torch::nn::ReLU(), torch::nn::Linear(48, 48),
                            torch::nn::ReLU(), torch::nn::Linear(48, 4));
  fsdp::FullyShardedDataParallel model(net, rt->comm(), {.autoWrap = fsdp::AutoWrapPolicy::minParams(500)});
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  fsdp::Checkpointer checkpoints(*rt, {.dir = f.dir + "/ckpt"});
  std::optional<fsdp::Snapshotter> snapshots;
  if (f.snapshots) snapshots.emplace(*rt);

  std::optional<fsdp::TrainingProgress> resumed;
  std::string from;
  if (snapshots) {
    if (stalls && f.stallAt == "restore" && attempt == 1) {
      metricsLine(f, "stall", 0);
      stall_worker_stuck_before_restore();
    }
    resumed = snapshots->restore(model, &optimizer);
    if (resumed) from = snapshots->restoredFrom();
  }
  if (!resumed) {
    if (stalls && f.stallAt == "load" && attempt == 1) {
      metricsLine(f, "stall", 0);
      stall_worker_stuck_before_load();
    }
    resumed = checkpoints.loadLatest(model, &optimizer);
    if (resumed) from = "disk";
  }
  long long step = resumed ? resumed->step : 0;
  if (resumed && rank == 0) metricsLine(f, "resume", step);
  while (step < f.steps) {
    torch::manual_seed(1000 * step + rank);
    const auto x = at::randn({8, 16});
    const auto target = at::randn({8, 4});
    optimizer.zero_grad();
    (model->forward(x) - target).pow(2).mean().backward();
    if (snapshots) {
      snapshots->step(model, optimizer);
    } else {
      optimizer.step();
    }
    ++step;
    fsdp::markProgress(step);
    if (rank == 0) metricsLine(f, "train", step);
    if (attempt == 0 && rank == f.crashRank && step == f.crashStep) {
      if (snapshots) snapshots->wait();
      ::kill(::getpid(), SIGKILL);
    }
    if (snapshots) snapshots->save(model, &optimizer, {.step = step});
    if (step % f.saveEvery == 0) {
      if (stalls && f.stallAt == "save" && attempt == 0 && step == f.stallStep) {
        metricsLine(f, "stall", step);
        stall_worker_stuck_before_save();
      }
      if (snapshots) snapshots->wait();
      checkpoints.save(model, &optimizer, {.step = step});
    }
  }
  if (snapshots) snapshots->wait();
  std::ofstream(f.dir + "/final_" + std::to_string(rank)) << fsdp::testing::adamStateHash(model, optimizer) << "\n";
  if (rank == 0) {
    std::printf("{\"steps\": %lld, \"resumed_step\": %s, \"resumed_from\": %s, \"attempt\": %d}\n", step,
                resumed ? std::to_string(resumed->step).c_str() : "null",
                from.empty() ? "null" : ("\"" + from + "\"").c_str(), attempt);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const fsdp::ConfigError& e) {
    std::fprintf(stderr, "stall_worker: %s\n", e.what());
    return 2;
  }
}
