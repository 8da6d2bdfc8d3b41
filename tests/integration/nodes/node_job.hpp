#pragma once
// Test helper for multi-node jobs on loopback: a standalone fsdprun-rdzv daemon and one fsdprun
// agent per "node" (127.0.0.2, .3, ..., or all on 127.0.0.1: sharedAddress), each with its own
// stdout/stderr file, all running the mnist trainer with a shared metrics file; finding the
// agent of a rank or of a group rank, and killing agents (with their workers) by SIGKILL. Every
// wait is bounded.
//
//   NodeJob job("loss", {.agents = 4, .nnodes = "3:4"});
//   ASSERT_TRUE(job.waitForStep(12, 240s));
//   job.kill(job.agentOfRank(2));
//   auto rc = job.wait(survivor, 240s);

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "rdzv_daemon.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"

namespace fsdp::testing::nodes {

inline const std::string kBin = FSDP_BIN_DIR;
inline const std::string kData = "/usr/share/datasets/fashion-mnist";

inline bool haveData() { return std::filesystem::exists(kData); }


// The newest "train" step in a metrics file; -1 when none.
inline long long lastTrainStep(const std::string& metricsPath) {
  long long step = -1;
  for (const auto& line : metricsLines(metricsPath)) {
    if (line.value("type", "") == "train") step = std::max(step, line["step"].get<long long>());
  }
  return step;
}

// A run id of its own, so that what the job leaves behind can be found by name.
inline std::string uniqueRunId(const std::string& what) {
  return "nodes-" + what + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);
}

// The mnist trainer's command line: `steps` steps, no eval, a metrics line per step.
inline std::vector<std::string> mnist(const std::vector<std::string>& extra, int steps) {
  std::vector<std::string> argv = {
      kBin + "/mnist", "--max_steps", std::to_string(steps), "--no_eval",
      "--progress",    "none",        "--log_every",         "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

using fsdp::testing::parentOf;

// The value of `key` in a process's environment; "" when it has none (or is gone).
inline std::string environmentValue(int pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ");
  std::string entry;
  while (std::getline(in, entry, '\0')) {
    if (entry.starts_with(key + "=")) return entry.substr(key.size() + 1);
  }
  return "";
}

struct NodeJobOptions {
  int agents = 4;
  std::string nnodes = "3:4";
  int nprocPerNode = 1;
  int maxRestarts = 2;
  std::vector<std::string> job;            // the training command ("{metrics}" stands for
                                           // metricsPath()); mnist when empty:
  int steps = 40;                          //   its steps,
  int checkpointEvery = 0;                 //   and disk checkpoints to checkpointDir() (0: none)
  std::vector<std::string> launcherFlags;  // more fsdprun flags
  std::string rdzvConf =
      "is_host=false,heartbeat_interval=0.2,heartbeat_timeout=2,last_call_timeout=1";
  // Agent 0 serves the rendezvous itself (on 127.0.0.2, is_host=true), as under Slurm, instead
  // of a standalone daemon.
  bool agentHosts = false;
  // Every agent on 127.0.0.1 without --local_addr, as several agents on one machine run: they
  // share one host name and one address (agent 0, when it hosts, serves on 127.0.0.1).
  bool sharedAddress = false;
  std::vector<std::string> env;  // more of the agents' environment ("KEY=VALUE")
  int deferred = 0;  // the last this many agents start only at startDeferred()
};

class NodeJob {
 public:
  // Starts the daemon and the agents (FSDPRUN_BACKEND=gloo: nodes share no memory anyway).
  NodeJob(const std::string& what, NodeJobOptions options)
      : options_(std::move(options)), runId_(uniqueRunId(what)), tag_("FSDP_NODES_TAG=" + runId_) {
    if (!options_.agentHosts) daemon_.emplace();
    rdzvPort_ = options_.agentHosts ? freeLoopbackPort() : daemon_->port();
    const std::string endpoint =
        (options_.agentHosts && !options_.sharedAddress ? "127.0.0.2:" : "127.0.0.1:") + std::to_string(rdzvPort_);
    std::vector<std::string> env = fsdp::currentEnvironment();
    env.push_back(tag_);
    env.push_back("TMPDIR=" + dir_.path());
    env.push_back("FSDPRUN_BACKEND=gloo");
    env.insert(env.end(), options_.env.begin(), options_.env.end());
    std::vector<std::string> job = options_.job;
    for (auto& arg : job) {
      if (arg == "{metrics}") arg = metricsPath();
    }
    if (job.empty()) {
      std::vector<std::string> flags = {"--metrics_file", metricsPath()};
      if (options_.checkpointEvery > 0) {
        flags.insert(flags.end(), {"--checkpoint_dir", checkpointDir(), "--checkpoint_every",
                                   std::to_string(options_.checkpointEvery)});
      }
      job = mnist(flags, options_.steps);
    }
    for (int i = 0; i < options_.agents; ++i) {
      std::vector<std::string> argv = {kBin + "/fsdprun",
                                       "--nnodes",
                                       options_.nnodes,
                                       "--nproc_per_node",
                                       std::to_string(options_.nprocPerNode),
                                       "--max_restarts",
                                       std::to_string(options_.maxRestarts),
                                       "--rdzv_backend",
                                       "c10d",
                                       "--rdzv_endpoint",
                                       endpoint,
                                       "--rdzv_id",
                                       runId_,
                                       "--rdzv_conf",
                                       options_.agentHosts && i == 0 ? "is_host=true" + options_.rdzvConf.substr(options_.rdzvConf.find(','))
                                                                     : options_.rdzvConf};
      if (!options_.sharedAddress) argv.insert(argv.end(), {"--local_addr", "127.0.0." + std::to_string(i + 2)});
      argv.insert(argv.end(), options_.launcherFlags.begin(), options_.launcherFlags.end());
      argv.insert(argv.end(), job.begin(), job.end());
      fsdp::SpawnOptions spawn{.argv = argv, .env = env, .deathSignal = SIGKILL};
      spawn.stdoutPath = outPath(i);
      spawn.stderrPath = errPath(i);
      if (i >= options_.agents - options_.deferred) {
        deferred_.push_back(std::move(spawn));
      } else {
        agents_.push_back(fsdp::ChildProcess::spawn(spawn));
      }
    }
  }
  // Starts the agents NodeJobOptions::deferred held back (they join a running job as spares).
  void startDeferred() {
    for (const auto& spawn : deferred_) agents_.push_back(fsdp::ChildProcess::spawn(spawn));
    deferred_.clear();
  }

  const std::string& dir() const { return dir_.path(); }
  // The rendezvous port (the daemon's, or the one agent 0 serves on and successors take over).
  int rdzvPort() const { return rdzvPort_; }
  const std::string& runId() const { return runId_; }
  // "FSDP_NODES_TAG=<run id>": in the environment of every process of the job.
  const std::string& tag() const { return tag_; }
  std::string metricsPath() const { return dir_.path() + "/metrics.jsonl"; }
  std::string checkpointDir() const { return dir_.path() + "/ckpt"; }
  std::string outPath(int agent) const {
    return dir_.path() + "/agent" + std::to_string(agent) + ".out";
  }
  std::string errPath(int agent) const {
    return dir_.path() + "/agent" + std::to_string(agent) + ".err";
  }
  std::string out(int agent) const { return readFile(outPath(agent)); }
  std::string err(int agent) const { return readFile(errPath(agent)); }
  // Every agent's stderr, each under a line naming it.
  std::string allErr() const {
    std::string text;
    for (int i = 0; i < options_.agents; ++i)
      text += "---- agent " + std::to_string(i) + "\n" + err(i);
    return text;
  }
  int agents() const { return options_.agents; }
  fsdp::ChildProcess& agent(int i) { return agents_.at(static_cast<std::size_t>(i)); }

  // Waits (bounded) until the metrics file shows step `step` trained.
  bool waitForStep(long long step, std::chrono::milliseconds within) const {
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (lastTrainStep(metricsPath()) < step && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return lastTrainStep(metricsPath()) >= step;
  }

  // Waits (bounded) until `count` agents have workers at once: every one of them has had an
  // assignment (a round of that many nodes formed).
  bool waitForWorkers(int count, std::chrono::milliseconds within) const {
    const auto deadline = std::chrono::steady_clock::now() + within;
    for (;;) {
      int with = 0;
      for (int i = 0; i < options_.agents; ++i) with += ranksUnder(i).empty() ? 0 : 1;
      if (with >= count) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // The agent whose worker has `key`=`value` in its environment ("RANK", "GROUP_RANK"); -1 when
  // none (now).
  int agentOfWorker(const std::string& key, int value) const {
    const auto ours = processesWithEnvironment(tag_);
    for (const int pid : processesWithEnvironment(key + "=" + std::to_string(value))) {
      if (std::find(ours.begin(), ours.end(), pid) == ours.end()) continue;
      const int parent = parentOf(pid);
      for (std::size_t i = 0; i < agents_.size(); ++i) {
        if (agents_[i].pid() == parent) return static_cast<int>(i);
      }
    }
    return -1;
  }
  int agentOfRank(int rank) const { return agentOfWorker("RANK", rank); }
  int agentOfGroupRank(int groupRank) const { return agentOfWorker("GROUP_RANK", groupRank); }
  // The pids of the workers under agent `i` now (as they started: RANK set), sorted.
  std::vector<int> workersUnder(int i) const {
    std::vector<int> pids;
    for (const int pid : processesWithEnvironment(tag_)) {
      if (parentOf(pid) != agents_.at(static_cast<std::size_t>(i)).pid()) continue;
      if (!environmentValue(pid, "RANK").empty()) pids.push_back(pid);  // not its guardian
    }
    std::sort(pids.begin(), pids.end());
    return pids;
  }
  // Waits (bounded) for a resume line written after `since` (unix time); null when none came.
  nlohmann::json waitForResume(double since, std::chrono::milliseconds within) const {
    const auto deadline = std::chrono::steady_clock::now() + within;
    for (;;) {
      for (const auto& line : metricsLines(metricsPath())) {
        if (line.value("type", "") == "resume" && line.value("unix_time", 0.0) > since) return line;
      }
      if (std::chrono::steady_clock::now() >= deadline) return nullptr;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  // The global ranks of the workers under agent `i` now.
  std::vector<int> ranksUnder(int i) const {
    std::vector<int> ranks;
    for (const int pid : processesWithEnvironment(tag_)) {
      if (parentOf(pid) != agents_.at(static_cast<std::size_t>(i)).pid()) continue;
      const std::string rank = environmentValue(pid, "RANK");
      if (!rank.empty()) ranks.push_back(std::stoi(rank));
    }
    std::sort(ranks.begin(), ranks.end());
    return ranks;
  }

  // What the job left behind once its agents are gone: processes carrying tag() that outlive
  // `grace`, /dev/shm entries naming runId(); empty when nothing.
  std::vector<std::string> leftovers(
      std::chrono::milliseconds grace = std::chrono::seconds(10)) const {
    std::vector<std::string> left;
    for (const int pid : processesWithEnvironment(tag_)) {
      if (!processGone(pid, grace)) left.push_back("process " + std::to_string(pid));
    }
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      if (entry.path().filename().string().find(runId_) != std::string::npos)
        left.push_back(entry.path().string());
    }
    return left;
  }

  // SIGKILLs agent `i` (its workers die with it: PR_SET_PDEATHSIG) and reaps it.
  bool kill(int i) {
    ::kill(agent(i).pid(), SIGKILL);
    return agent(i).waitFor(std::chrono::seconds(20)).has_value();
  }
  // Agent `i`'s exit code (its wait status decoded); nullopt when it did not exit within.
  std::optional<int> wait(int i, std::chrono::milliseconds within) {
    const auto status = agent(i).waitFor(within);
    if (!status) return std::nullopt;
    return WIFEXITED(*status) ? WEXITSTATUS(*status) : 128 + WTERMSIG(*status);
  }

 private:
  NodeJobOptions options_;
  TempDir dir_;
  std::string runId_;
  std::string tag_;
  std::optional<RdzvDaemon> daemon_;
  int rdzvPort_ = 0;
  std::vector<fsdp::ChildProcess> agents_;
  std::vector<fsdp::SpawnOptions> deferred_;
};

// The wall-clock time now, as the metrics lines' unix_time has it.
inline double unixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The agent that says it waits as a spare; -1 (with a test failure) when none does.
inline int spareOf(NodeJob& job) {
  for (int i = 0; i < job.agents(); ++i) {
    if (job.err(i).find("waits as a spare") != std::string::npos) return i;
  }
  ADD_FAILURE() << "no agent says it waits as a spare\n" << job.allErr();
  return -1;
}

// Waits for every agent but `victim` to exit 0 (gtest failures otherwise); the summary line of
// the one that printed it (rank 0 of the last world, whichever agent that is), null if none.
inline nlohmann::json survivorsSucceed(NodeJob& job, int victim, std::chrono::milliseconds within) {
  nlohmann::json summary;
  for (int i = 0; i < job.agents(); ++i) {
    if (i == victim) continue;
    const auto rc = job.wait(i, within);
    EXPECT_TRUE(rc.has_value()) << "agent " << i << " did not end\n" << job.allErr();
    if (!rc) return summary;
    EXPECT_EQ(*rc, 0) << "agent " << i << "\n" << job.allErr();
    const auto s = summaryOf(job.out(i));
    if (s.contains("params_sha256")) summary = s;
  }
  return summary;
}

// What a job's metrics file shows around a kill at `killedAt` (unix time): the newest step
// trained before it, and the resume line after it (null when none).
struct AroundKill {
  long long doneBefore = -1;
  nlohmann::json resume;
};

inline AroundKill aroundKill(const std::string& metricsPath, double killedAt) {
  AroundKill r;
  for (const auto& line : metricsLines(metricsPath)) {
    if (line.value("type", "") == "train" && line.value("unix_time", 0.0) < killedAt && r.resume.is_null()) {
      r.doneBefore = std::max(r.doneBefore, line["step"].get<long long>());
    }
    if (line.value("type", "") == "resume") r.resume = line;
  }
  return r;
}

// The reference for a run that lost ranks at `step`: `before` ranks (one agent, Gloo) that save
// every step up to it into `checkpointDir`, then `after` ranks resumed from it to `steps`.
// Returns the second run's stdout; "" with `error` set when either run failed.
// `more`: flags both runs take (the job's own: --sharding).
inline std::string resumedReference(const std::string& checkpointDir, int before, int after, long long step, int steps,
                                    const std::string& tag, std::string& error,
                                    const std::vector<std::string>& more = {}) {
  std::vector<std::string> flags = {"--checkpoint_dir", checkpointDir, "--checkpoint_every", "1",
                                    "--keep_checkpoints", "0", "--snapshot_every", "0"};
  flags.insert(flags.end(), more.begin(), more.end());
  auto first = mnist(flags, static_cast<int>(step));
  first.insert(first.begin(), {kBin + "/fsdprun", "--nproc_per_node", std::to_string(before)});
  const auto r1 = runCommand(first, std::chrono::seconds(300), {"FSDPRUN_BACKEND=gloo", tag});
  if (r1.exitCode != 0) {
    error = r1.err;
    return "";
  }
  flags = {"--checkpoint_dir", checkpointDir, "--snapshot_every", "0"};
  flags.insert(flags.end(), more.begin(), more.end());
  auto second = mnist(flags, steps);
  second.insert(second.begin(), {kBin + "/fsdprun", "--nproc_per_node", std::to_string(after)});
  const auto r2 = runCommand(second, std::chrono::seconds(300), {"FSDPRUN_BACKEND=gloo", tag});
  if (r2.exitCode != 0) {
    error = r2.err;
    return "";
  }
  return r2.out;
}

}  // namespace fsdp::testing::nodes
