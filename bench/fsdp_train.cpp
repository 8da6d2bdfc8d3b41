// fsdp_train and collectives: our FSDP and Gloo communicator against PyTorch 1.13
// (python3-torch) on the same machine, in the same invocation.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/Functions.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "bench.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::bench {
namespace {

std::string binDir() {
  const std::string exe = selfExe();
  return exe.substr(0, exe.rfind('/'));
}

std::string peerScript(const std::string& name) {
  return std::string(FSDP_SOURCE_DIR) + "/bench/peer/" + name;
}

bool havePython() { return ::access("/usr/bin/python3", X_OK) == 0; }

// Environment of this process with `overrides` (KEY=VALUE) replacing or adding entries. Every
// implementation gets the malloc setting fsdprun gives its workers (huge pages for what glibc
// maps), so that no side is measured with an allocator setting the other lacks.
std::vector<std::string> environmentWith(std::vector<std::string> overrides) {
  if (std::getenv("GLIBC_TUNABLES") == nullptr) overrides.push_back("GLIBC_TUNABLES=glibc.malloc.hugetlb=1");
  std::vector<std::string> env;
  for (const auto& entry : currentEnvironment()) {
    const auto key = entry.substr(0, entry.find('=') + 1);
    const bool replaced = std::any_of(overrides.begin(), overrides.end(),
                                      [&](const std::string& o) { return o.starts_with(key); });
    if (!replaced) env.push_back(entry);
  }
  env.insert(env.end(), overrides.begin(), overrides.end());
  return env;
}

struct Outcome {
  bool ok = false;
  std::vector<nlohmann::json> lines;  // every JSON object the processes printed
  std::string error;
};

// Runs the processes (all at once) and collects the JSON lines of their stdout.
Outcome runAll(const std::vector<SpawnOptions>& commands, std::chrono::seconds limit) {
  std::vector<std::string> outputs;
  std::vector<ChildProcess> children;
  char dirTemplate[] = "/tmp/fsdp-bench-XXXXXX";
  const std::string dir = ::mkdtemp(dirTemplate);
  for (std::size_t i = 0; i < commands.size(); ++i) {
    SpawnOptions options = commands[i];
    outputs.push_back(dir + "/out" + std::to_string(i));
    options.stdoutPath = outputs.back();
    options.stderrPath = dir + "/err" + std::to_string(i);
    children.push_back(ChildProcess::spawn(options));
  }
  Outcome outcome{.ok = true};
  for (std::size_t i = 0; i < children.size(); ++i) {
    const auto status = children[i].waitFor(limit);
    if (!status || !WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
      outcome.ok = false;
      std::ifstream err(dir + "/err" + std::to_string(i));
      std::stringstream text;
      text << err.rdbuf();
      const std::string all = text.str();
      outcome.error = all.substr(all.size() > 400 ? all.size() - 400 : 0);
    }
  }
  for (const auto& path : outputs) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.starts_with("{")) {
        try {
          outcome.lines.push_back(nlohmann::json::parse(line));
        } catch (const nlohmann::json::exception&) {
          // a progress line that happens to start with a brace: not ours to report
        }
      }
    }
  }
  std::filesystem::remove_all(dir);
  return outcome;
}

// `world` python processes of a torch.distributed script (env:// rendezvous on loopback).
std::vector<SpawnOptions> torchProcesses(const std::vector<std::string>& args, int world,
                                         int threads) {
  const auto port = std::to_string(freePort());
  std::vector<SpawnOptions> commands;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv = {"/usr/bin/python3"};
    argv.insert(argv.end(), args.begin(), args.end());
    commands.push_back({.argv = argv,
                        .env = environmentWith({"RANK=" + std::to_string(r),
                                                "WORLD_SIZE=" + std::to_string(world),
                                                "LOCAL_RANK=" + std::to_string(r),
                                                "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port,
                                                "OMP_NUM_THREADS=" + std::to_string(threads)})});
  }
  return commands;
}

const nlohmann::json* lastWith(const Outcome& outcome, const char* key) {
  for (auto it = outcome.lines.rbegin(); it != outcome.lines.rend(); ++it) {
    if (it->contains(key)) return &*it;
  }
  return nullptr;
}

}  // namespace

// The gpt example at GPT-2-small width (12 layers, d=768): FULL_SHARD on 2 ranks against one
// process with the same global batch, for the per-rank memory FSDP saves.
void gptTrain(const Args& args) {
  const auto steps = args.ints("steps", "3").front();
  const auto batch = args.ints("batch_size", "16").front();
  const std::string bin = binDir();
  const std::vector<std::string> gpt = {bin + "/gpt", "--n_layer", "12", "--n_head", "12",
                                        "--n_embd", "768", "--block_size", "128", "--batch_size",
                                        std::to_string(batch), "--max_steps", std::to_string(steps),
                                        "--eval_every", "0", "--eval_batches", "1", "--sample_chars",
                                        "0", "--log_every", "0"};
  const auto limit = std::chrono::seconds(1800);
  std::stringstream strategies(args.str("strategies", "FULL_SHARD"));
  const auto one = [&](const std::string& impl, const std::string& sharding, int ranks, int threads) {
    std::vector<std::string> argv = {bin + "/fsdprun", "--standalone", "--nproc_per_node",
                                     std::to_string(ranks)};
    argv.insert(argv.end(), gpt.begin(), gpt.end());
    argv.insert(argv.end(), {"--sharding", sharding});
    const auto outcome = runAll(
        {{.argv = argv, .env = environmentWith({"OMP_NUM_THREADS=" + std::to_string(threads)})}}, limit);
    nlohmann::json line = {{"bench", "fsdp_train"}, {"impl", impl},   {"model", "gpt"},
                           {"sharding", sharding},  {"ranks", ranks}, {"threads_per_rank", threads},
                           {"global_batch", batch}, {"block_size", 128}, {"steps", steps}};
    const auto* result = lastWith(outcome, "train_samples_per_s");
    if (!outcome.ok || result == nullptr) {
      line["error"] = outcome.error.empty() ? "no result line" : outcome.error;
      emit(line);
      return 0.0;
    }
    line["parameters"] = (*result)["parameters"];
    line["samples_per_s"] = (*result)["train_samples_per_s"];
    line["peak_rss_mb_rank0"] = (*result)["peak_rss_mb"];
    emit(line);
    return (*result)["peak_rss_mb"].get<double>();
  };
  const double single = one("libtorch_single", "FULL_SHARD", 1, 2);
  std::string sharding;
  while (std::getline(strategies, sharding, ',')) {
    const double sharded = one("fsdp", sharding, 2, 1);
    if (single > 0 && sharded > 0) {
      emit({{"bench", "fsdp_train"}, {"compare", sharding + " per-rank peak RSS / one process"},
            {"model", "gpt"}, {"ratio", sharded / single}});
    }
  }
}

// Test accuracy after E epochs of the mnist recipe: ours (FSDP FULL_SHARD, 2 ranks x 1 thread)
// against the same recipe in one PyTorch process (2 threads), same machine, same run.
void accuracy(const Args& args) {
  const std::string model = args.str("model", "deep");
  const auto epochs = args.ints("epochs", "1").front();
  if (model != "deep" && model != "shallow") throw ConfigError("--model '" + model + "': expected deep or shallow");
  const auto limit = std::chrono::seconds(7200);
  const std::string globalBatch = "256";  // given to both sides, so the label says what ran
  nlohmann::json base = {{"bench", "accuracy"}, {"model", model}, {"epochs", epochs}, {"global_batch", std::stoi(globalBatch)}};
  const auto oursOutcome = runAll({{.argv = {binDir() + "/fsdprun", "--nproc_per_node", "2", binDir() + "/mnist",
                                             "--model", model, "--epochs", std::to_string(epochs), "--batch_size",
                                             globalBatch, "--progress", "none", "--log_every", "0"},
                                    .env = environmentWith({"OMP_NUM_THREADS=1"})}},
                                  limit);
  // One line per side; the result line it came from, or null.
  const auto report = [&base](const char* impl, const auto& outcome) {
    const auto* result = lastWith(outcome, "test_accuracy");
    nlohmann::json line = base;
    line["impl"] = impl;
    if (result == nullptr) {
      line["error"] = outcome.error.empty() ? "no result line" : outcome.error;
    } else {
      line["test_accuracy"] = (*result)["test_accuracy"];
      line["train_samples_per_s"] = (*result)["train_samples_per_s"];
    }
    emit(line);
    return result;
  };
  const auto* ours = report("fsdp FULL_SHARD 2 ranks x 1 thread", oursOutcome);
  if (!havePython()) {
    emit({{"bench", "accuracy"}, {"impl", "pytorch"}, {"unavailable", "needs python3-torch"}});
    return;
  }
  const auto peerOutcome = runAll({{.argv = {"/usr/bin/python3", peerScript("mnist_accuracy_torch.py"), "--model",
                                             model, "--epochs", std::to_string(epochs), "--batch_size", globalBatch,
                                             "--threads", "2"},
                                    .env = environmentWith({})}},
                                  limit);
  const auto* peer = report("pytorch 1 process x 2 threads", peerOutcome);
  if (ours != nullptr && peer != nullptr) {
    emit({{"bench", "accuracy"}, {"model", model}, {"compare", "test accuracy points, ours - pytorch"},
          {"difference_points", 100.0 * ((*ours)["test_accuracy"].get<double>() - (*peer)["test_accuracy"].get<double>())}});
  }
}

void fsdpTrain(const Args& args) {
  const std::string model = args.str("model", "deep");
  if (model == "gpt") return gptTrain(args);
  const auto steps = args.ints("steps", "10").front();
  const auto batch = args.ints("batch_size", "256").front();
  std::stringstream strategies(args.str("strategies", "FULL_SHARD,SHARD_GRAD_OP,NO_SHARD"));
  const std::string bin = binDir();
  const std::vector<std::string> mnist = {bin + "/mnist", "--model", model, "--no_dropout",
                                          "--no_eval", "--log_every", "0", "--max_steps",
                                          std::to_string(steps), "--batch_size",
                                          std::to_string(batch)};
  const auto limit = std::chrono::seconds(1800);
  const auto reps = args.ints("reps", "1").front();
  // Two rates per run: over every step, and past the first kWarmupSteps (the rate a long run
  // settles at; the first steps touch every buffer for the first time, which this VM's host
  // backs at ~2 ms per MB). Comparisons are made per rep on both, and their medians reported.
  struct Rate {
    double whole = 0;
    double steady = 0;
  };
  std::map<std::string, std::vector<Rate>> rates;  // impl -> one per rep
  const auto report = [&](const std::string& impl, const std::string& sharding, int ranks, int threads,
                          int rep, const Outcome& outcome) {
    nlohmann::json line = {{"bench", "fsdp_train"}, {"impl", impl},   {"model", model},
                           {"sharding", sharding},  {"ranks", ranks}, {"threads_per_rank", threads},
                           {"global_batch", batch}, {"steps", steps}, {"rep", rep}};
    const auto* result = lastWith(outcome, "train_samples_per_s");
    if (!outcome.ok || result == nullptr) {
      line["error"] = outcome.error.empty() ? "no result line" : outcome.error;
      emit(line);
      return;
    }
    line["samples_per_s"] = (*result)["train_samples_per_s"];
    line["samples_per_s_steady"] = result->value("train_samples_per_s_steady", 0.0);
    line["peak_rss_mb_rank0"] = (*result)["peak_rss_mb"];
    emit(line);
    rates[impl + "/" + sharding].push_back({(*result)["train_samples_per_s"].get<double>(),
                                             result->value("train_samples_per_s_steady", 0.0)});
  };
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  // "a / b" per rep where both ran, on both rates; one line with the medians.
  const auto compare = [&](const std::string& what, const std::string& key, const std::string& a,
                           const std::string& b) {
    const auto& x = rates[a];
    const auto& y = rates[b];
    std::vector<double> whole, steady;
    for (std::size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
      if (y[i].whole > 0) whole.push_back(x[i].whole / y[i].whole);
      if (y[i].steady > 0 && x[i].steady > 0) steady.push_back(x[i].steady / y[i].steady);
    }
    if (whole.empty()) return;
    emit({{"bench", "fsdp_train"}, {"compare", what}, {"model", model}, {"reps", whole.size()},
          {key, median(steady)}, {key + "_every_step", median(whole)}, {key + "_per_rep", steady},
          {key + "_every_step_per_rep", whole}});
  };
  std::vector<std::string> shardings;
  for (std::string sharding; std::getline(strategies, sharding, ',');) shardings.push_back(sharding);
  // --numa exclusive|node|socket|core-complex: FULL_SHARD again with fsdprun --numa_binding.
  const std::string numa = args.str("numa", "");
  for (int rep = 0; rep < reps; ++rep) {
    for (const auto& sharding : shardings) {
      std::vector<std::string> argv = {bin + "/fsdprun", "--standalone", "--nproc_per_node", "2"};
      argv.insert(argv.end(), mnist.begin(), mnist.end());
      argv.insert(argv.end(), {"--sharding", sharding});
      // "fsdp": what fsdp::init() picks (shared memory between the ranks of this node).
      report("fsdp", sharding, 2, 1, rep,
             runAll({{.argv = argv, .env = environmentWith({"OMP_NUM_THREADS=1"})}}, limit));
      if (sharding == "FULL_SHARD" && !numa.empty()) {
        auto bound = argv;
        bound.insert(bound.begin() + 1, {"--numa_binding", numa});
        report("fsdp_numa_" + numa, sharding, 2, 1, rep,
               runAll({{.argv = bound, .env = environmentWith({"OMP_NUM_THREADS=1"})}}, limit));
      }
      if (sharding == "FULL_SHARD") {
        report("fsdp_gloo", sharding, 2, 1, rep,
               runAll({{.argv = argv, .env = environmentWith({"OMP_NUM_THREADS=1", "FSDPRUN_BACKEND=gloo"})}}, limit));
      }
    }
    {
      std::vector<std::string> argv = {bin + "/fsdprun", "--standalone", "--nproc_per_node", "1"};
      argv.insert(argv.end(), mnist.begin(), mnist.end());
      report("libtorch_single", "-", 1, 2, rep,
             runAll({{.argv = argv, .env = environmentWith({"OMP_NUM_THREADS=2"})}}, limit));
    }
    if (!havePython()) continue;
    const std::vector<std::string> script = {peerScript("mnist_torch.py"), "--model", model,
                                             "--steps", std::to_string(steps), "--batch_size",
                                             std::to_string(batch)};
    auto ddpArgs = script;
    ddpArgs.insert(ddpArgs.end(), {"--threads", "1"});
    report("pytorch_ddp_gloo", "-", 2, 1, rep, runAll(torchProcesses(ddpArgs, 2, 1), limit));
    auto singleArgs = script;
    singleArgs.insert(singleArgs.end(), {"--threads", "2"});
    report("pytorch_single", "-", 1, 2, rep, runAll(torchProcesses(singleArgs, 1, 2), limit));
  }
  compare("FULL_SHARD 2 ranks x 1 thread / one LibTorch process x 2 threads", "ratio", "fsdp/FULL_SHARD",
          "libtorch_single/-");
  if (!numa.empty()) {
    compare("FULL_SHARD with --numa_binding " + numa + " / without", "ratio", "fsdp_numa_" + numa + "/FULL_SHARD",
            "fsdp/FULL_SHARD");
  }
  if (!havePython()) {
    emit({{"bench", "fsdp_train"}, {"impl", "pytorch"}, {"error", "unavailable: needs python3-torch"}});
    return;
  }
  compare("FULL_SHARD vs pytorch DDP (2 ranks)", "speedup", "fsdp/FULL_SHARD", "pytorch_ddp_gloo/-");
}

void collectives(const Args& args) {
  const auto sizes = args.ints("mb", "1,16,128");
  const auto reps = args.ints("reps", "5").front();
  const auto rankCounts = args.ints("ranks", "2,4");
  std::string mb;
  for (const auto s : sizes) mb += (mb.empty() ? "" : ",") + std::to_string(s);
  const auto limit = std::chrono::seconds(900);
  for (const auto ranks : rankCounts) {
    std::vector<nlohmann::json> lines;
    // Ours twice, forced: shared memory (what fsdp::init() picks on one node) and Gloo.
    for (const std::string backend : {"shm", "gloo"}) {
      const auto ours = runAll({{.argv = {binDir() + "/fsdprun", "--standalone", "--nproc_per_node", std::to_string(ranks),
                                          selfExe(), "collectives_worker", mb, std::to_string(reps)},
                                 .env = environmentWith({"OMP_NUM_THREADS=1", "FSDPRUN_BACKEND=" + backend})}},
                               limit);
      if (!ours.ok) emit({{"bench", "collectives"}, {"impl", "fsdp_" + backend}, {"ranks", ranks}, {"error", ours.error}});
      for (const auto& line : ours.lines) {
        emit(line);
        lines.push_back(line);
      }
    }
    if (havePython()) {
      const auto peer = runAll(torchProcesses({peerScript("collectives_torch.py"), "--mb", mb, "--reps",
                                               std::to_string(reps)},
                                              static_cast<int>(ranks), 1),
                               limit);
      if (!peer.ok) emit({{"bench", "collectives"}, {"impl", "torch_gloo"}, {"ranks", ranks}, {"error", peer.error}});
      for (const auto& line : peer.lines) {
        emit(line);
        lines.push_back(line);
      }
    }
    // Ratios: the other's time / shared memory's, per operation and size.
    for (const auto& o : lines) {
      if (o.value("impl", "") != "fsdp_shm") continue;
      for (const auto& p : lines) {
        if (p.value("impl", "") == "fsdp_shm" || o.value("mb", -1) != p.value("mb", -2) ||
            o.value("op", "") != p.value("op", "x")) {
          continue;
        }
        emit({{"bench", "collectives"}, {"compare", o["op"]}, {"mb", o["mb"]}, {"ranks", ranks},
              {"shm_vs", p["impl"]}, {"method", p["method"]},
              {"speedup", p["ms_median"].get<double>() / o["ms_median"].get<double>()}});
      }
    }
  }
}

// Runs as each rank under fsdprun: times our communicator, rank 0 prints JSON lines.
int collectivesWorker(const std::string& mbList, int reps) {
  auto rt = fsdp::init();
  auto& comm = rt->comm();
  const int world = comm.size();
  std::stringstream list(mbList);
  std::string item;
  while (std::getline(list, item, ',')) {
    const long long mb = std::stoll(item);
    const std::int64_t n = mb * (1 << 20) / 4 / world * world;
    const auto full = at::ones({n});
    const auto shard = at::ones({n / world});
    auto out = at::empty({n});
    auto outShard = at::empty({n / world});
    const std::vector<std::pair<std::string, std::function<void()>>> ops = {
        {"all_gather", [&] { comm.allGather(shard, out).wait(); }},
        {"reduce_scatter", [&] { comm.reduceScatter(full, outShard).wait(); }},
        {"all_reduce", [&] { out.copy_(full); comm.allReduce(out).wait(); }},
    };
    for (const auto& [name, fn] : ops) {
      fn();  // warm-up
      std::vector<double> ms;
      for (int r = 0; r < reps; ++r) {
        comm.barrier().wait();
        const auto start = std::chrono::steady_clock::now();
        fn();
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      if (rt->rank() == 0) {
        const double median = percentile(ms, 0.5);
        const bool shm = std::string(comm.backendName()) == "shared memory";
        emit({{"bench", "collectives"}, {"impl", shm ? "fsdp_shm" : "fsdp_gloo"}, {"op", name}, {"mb", mb},
              {"ranks", world}, {"method", shm ? "shared-memory blocks" : "gloo algorithm"}, {"ms_median", median},
              {"gb_per_s", static_cast<double>(n * 4) / (median * 1e6)}});
      }
    }
  }
  comm.barrier().wait();
  return 0;
}

}  // namespace fsdp::bench
