// Chaos: an elastic job (3 agents on loopback, --nnodes 2:3, a rendezvous daemon of its own)
// trains mnist with checkpoints while a driver SIGKILLs and SIGSTOPs random workers and
// agents at random moments and restarts the agents it lost. Then the checker asserts that the
// job finished; that every round the server formed appears in the agents' logs; that the
// final parameters equal an undisturbed run resumed from the checkpoint the last round
// resumed from (bit-identical: same world size, same checkpoint); and that no process of the
// job and no file of it outside its output folder is left.
//
// CHAOS_SECONDS (default 20, CI's short schedule) and CHAOS_SEED (default 1 in CI; random,
// printed, when CHAOS_SECONDS is given) choose the schedule; a failure prints the seed.
// `make chaos CHAOS_SECONDS=600` runs a long one.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "rdzv_daemon.hpp"
#include "run_command.hpp"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::readFile;
using fsdp::testing::TempDir;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kBin = FSDP_BIN_DIR;
const std::string kData = "/usr/share/datasets/fashion-mnist";
constexpr int kNodes = 3;
constexpr int kCheckpointEvery = 10;

// `seconds` from now, on the steady clock.
Clock::time_point secondsFrom(Clock::time_point t, double seconds) {
  return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

std::string envOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

// The mnist flags of the job and of its reference run.
std::vector<std::string> trainingCommand(int steps, const std::string& checkpointDir,
                                         const std::string& summaryFile) {
  return {kBin + "/mnist",          "--max_steps",        std::to_string(steps),
          "--epochs",               "1000",
          "--checkpoint_dir",       checkpointDir,        "--checkpoint_every",
          std::to_string(kCheckpointEvery), "--keep_checkpoints", "0",
          "--no_eval",              "--progress",         "none",
          // The reference resumes from the disk checkpoint the last round resumed from.
          "--snapshot_every",       "0",
          "--summary_file",         summaryFile,          "--data",
          kData};
}

// The processes whose parent is `pid` (Linux: /proc/<pid>/task/*/children).
std::vector<int> childrenOf(int pid) {
  std::vector<int> out;
  std::error_code ec;
  for (const auto& task : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "children");
    int child = 0;
    while (in >> child) out.push_back(child);
  }
  return out;
}

bool isMnist(int pid) {
  const std::string cmd = readFile("/proc/" + std::to_string(pid) + "/cmdline");
  return cmd.find("/mnist") != std::string::npos;
}

// One node: its agent, restarted when lost. Every instance's output goes to its own files.
class Node {
 public:
  Node(const TempDir& dir, int index, std::vector<std::string> args, std::vector<std::string> env)
      : dir_(dir.path()), index_(index), args_(std::move(args)), env_(std::move(env)) {}
  ~Node() {
    if (agent_ && !agent_->reaped()) {
      agent_->signal(SIGCONT);
      agent_->signal(SIGKILL);
      agent_->waitFor(10s);
    }
  }
  void start() {
    const std::string base = dir_ + "/agent" + std::to_string(index_) + "." +
                             std::to_string(instances_++);
    fsdp::SpawnOptions options{.argv = args_, .env = env_, .deathSignal = 0};
    options.stdoutPath = base + ".out";
    options.stderrPath = base + ".err";
    logs_.push_back(base);
    agent_.emplace(fsdp::ChildProcess::spawn(options));
    frozen_ = false;
  }
  bool running() {
    return agent_ && !agent_->reaped() && !agent_->tryWait().has_value();
  }
  int pid() const { return agent_->pid(); }
  std::vector<int> workers() const {
    std::vector<int> out;
    for (const int child : childrenOf(agent_->pid())) {
      if (isMnist(child)) out.push_back(child);
    }
    return out;
  }
  void signal(int sig) { agent_->signal(sig); }
  std::optional<int> waitFor(std::chrono::milliseconds timeout) { return agent_->waitFor(timeout); }
  int instances() const { return instances_; }
  // stdout and stderr of every instance, in order.
  std::string logs() const {
    std::string all;
    for (const auto& base : logs_) all += readFile(base + ".out") + readFile(base + ".err");
    return all;
  }
  std::string lastLog() const {
    return logs_.empty() ? "" : readFile(logs_.back() + ".out") + readFile(logs_.back() + ".err");
  }
  bool frozen_ = false;

 private:
  std::string dir_;
  int index_;
  std::vector<std::string> args_;
  std::vector<std::string> env_;
  int instances_ = 0;
  std::vector<std::string> logs_;
  std::optional<fsdp::ChildProcess> agent_;
};

struct Tally {
  std::map<std::string, int> faults;  // by kind
  std::string schedule;               // every fault, one per line
};

std::set<int> roundsIn(const std::string& text, const std::regex& pattern) {
  std::set<int> rounds;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), pattern);
       it != std::sregex_iterator(); ++it) {
    rounds.insert(std::stoi((*it)[1].str()));
  }
  return rounds;
}

TEST(Chaos, AnElasticJobUnderRandomKillsAndFreezesFinishesWithTheUndisturbedResult) {
  if (!fs::exists(kData)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const bool longRun = std::getenv("CHAOS_SECONDS") != nullptr;
  const double seconds = std::stod(envOr("CHAOS_SECONDS", "20"));
  const std::uint64_t seed = std::stoull(
      envOr("CHAOS_SEED", longRun ? std::to_string(std::random_device{}()) : "1"));
  SCOPED_TRACE("CHAOS_SEED=" + std::to_string(seed) + " CHAOS_SECONDS=" + envOr("CHAOS_SECONDS", "20") +
               " replays this schedule");
  std::printf("chaos: seed %llu, %.0f s of faults\n", static_cast<unsigned long long>(seed),
              seconds);
  // Enough steps that the job outlives the faults (about 10 steps a second get through).
  const int steps = std::stoi(envOr("CHAOS_STEPS", std::to_string(std::max(200, static_cast<int>(10 * seconds)))));
  std::mt19937_64 rng(seed);
  const auto uniform = [&rng](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };

  TempDir dir;
  const std::string tag = "FSDP_CHAOS_TAG=" + fs::path(dir.path()).filename().string();
  const std::string runId = "chaos-" + fs::path(dir.path()).filename().string();
  fs::create_directories(dir.path() + "/tmp");
  const std::string serverLogPath = dir.path() + "/rdzv.err";
  fsdp::testing::RdzvDaemon daemon({}, {"env", "FSDP_LOG_LEVEL=info"}, serverLogPath);
  std::vector<std::string> env = fsdp::currentEnvironment();
  env.push_back(tag);
  env.push_back("FSDP_LOG_LEVEL=info");
  env.push_back("TMPDIR=" + dir.path() + "/tmp");
  env.push_back("OMP_NUM_THREADS=1");
  env.push_back("FSDPRUN_BACKEND=gloo");  // as the reference run below, on any host
  std::vector<std::unique_ptr<Node>> nodes;
  for (int i = 0; i < kNodes; ++i) {
    std::vector<std::string> args = {
        kBin + "/fsdprun", "--nnodes", "2:" + std::to_string(kNodes), "--nproc_per_node", "1",
        "--max_restarts", "1000",
        // Faults come every 0.3-1.5 s and, before the first checkpoint (step 10), every round
        // starts again from step 0: three rounds in a row can fail before passing the step the
        // first failed at, which is the give-up rule doing its job, not this test's subject. A
        // real restart loop still fails the test: the job does not finish.
        "--max_stalled_restarts", "0", "--rdzv_backend", "c10d", "--rdzv_endpoint",
        "127.0.0.1:" + std::to_string(daemon.port()), "--rdzv_id", runId, "--local_addr",
        "127.0.0." + std::to_string(i + 2), "--rdzv_conf",
        "is_host=false,heartbeat_interval=0.2,heartbeat_timeout=2,last_call_timeout=1,"
        "join_timeout=120"};
    const auto command =
        trainingCommand(steps, dir.path() + "/ckpt", dir.path() + "/summary.json");
    args.insert(args.end(), command.begin(), command.end());
    nodes.push_back(std::make_unique<Node>(dir, i, args, env));
    nodes.back()->start();
  }

  // The schedule: a fault every 0.3-1.5 s; a frozen process is continued 0.3-3 s later, a
  // killed agent restarted 0.5-2 s later.
  Tally tally;
  struct Pending {
    Clock::time_point at;
    int node;
    int pid;  // SIGCONT this pid; 0: restart the node's agent
  };
  std::vector<Pending> pending;
  const auto start = Clock::now();
  const auto end = secondsFrom(start, seconds);
  const auto note = [&](const std::string& kind, const std::string& what) {
    ++tally.faults[kind];
    const double t = std::chrono::duration<double>(Clock::now() - start).count();
    char line[256];
    std::snprintf(line, sizeof(line), "%7.2f s  %-14s %s\n", t, kind.c_str(), what.c_str());
    tally.schedule += line;
  };
  auto nextFault = secondsFrom(start, uniform(0.3, 1.5));
  const std::string summaryPath = dir.path() + "/summary.json";
  while (Clock::now() < end && !fs::exists(summaryPath)) {
    const auto now = Clock::now();
    for (auto it = pending.begin(); it != pending.end();) {
      if (it->at > now) {
        ++it;
        continue;
      }
      Node& node = *nodes[it->node];
      if (it->pid == 0) {
        node.start();
        note("agent restart", "node " + std::to_string(it->node));
      } else {
        ::kill(it->pid, SIGCONT);
        if (it->pid == node.pid()) node.frozen_ = false;
      }
      it = pending.erase(it);
    }
    // A node whose agent exited by itself (dropped after a freeze, say) comes back too.
    for (int i = 0; i < kNodes; ++i) {
      const bool awaited = std::any_of(pending.begin(), pending.end(),
                                       [i](const Pending& p) { return p.node == i && p.pid == 0; });
      if (!awaited && !nodes[i]->running()) {
        nodes[i]->start();
        note("agent rejoin", "node " + std::to_string(i) + " had exited by itself");
      }
    }
    if (now >= nextFault) {
      nextFault = secondsFrom(now, uniform(0.3, 1.5));
      const int n = static_cast<int>(rng() % kNodes);
      Node& node = *nodes[n];
      const double kind = uniform(0, 1);
      const auto workers = node.running() ? node.workers() : std::vector<int>{};
      const bool busy = std::any_of(pending.begin(), pending.end(),
                                    [n](const Pending& p) { return p.node == n; });
      if (!node.running() || busy) {
        // a node already down or frozen: skip this turn
      } else if (kind < 0.35 && !workers.empty()) {
        ::kill(workers.front(), SIGKILL);
        note("worker kill", "node " + std::to_string(n) + " pid " + std::to_string(workers.front()));
      } else if (kind < 0.55 && !workers.empty()) {
        ::kill(workers.front(), SIGSTOP);
        const double forS = uniform(0.3, 3.0);
        pending.push_back({secondsFrom(now, forS), n, workers.front()});
        note("worker freeze", "node " + std::to_string(n) + " for " + std::to_string(forS) + " s");
      } else if (kind < 0.75) {
        node.signal(SIGSTOP);
        node.frozen_ = true;
        const double forS = uniform(0.3, 3.0);
        pending.push_back({secondsFrom(now, forS), n, node.pid()});
        note("agent freeze", "node " + std::to_string(n) + " for " + std::to_string(forS) + " s");
      } else {
        node.signal(SIGKILL);
        node.waitFor(10s);
        pending.push_back({secondsFrom(now, uniform(0.5, 2.0)), n, 0});
        note("agent kill", "node " + std::to_string(n));
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  // The end of the faults: continue what is frozen, restart what is down, let the job finish.
  for (const auto& p : pending) {
    if (p.pid != 0) ::kill(p.pid, SIGCONT);
  }
  for (const auto& p : pending) {
    if (p.pid == 0) nodes[p.node]->start();
  }
  pending.clear();
  // Until the job is done, a node whose agent exits (dropped after a freeze, say) is
  // restarted; once it is done (rank 0 wrote the summary), every agent must exit 0.
  const auto finishedBy = Clock::now() + 600s;
  std::vector<std::optional<int>> finalStatus(kNodes);
  while (std::any_of(finalStatus.begin(), finalStatus.end(), [](const auto& s) { return !s; })) {
    ASSERT_LT(Clock::now(), finishedBy) << "the job did not finish\n" << nodes[0]->lastLog();
    for (int i = 0; i < kNodes; ++i) {
      if (finalStatus[i]) continue;
      const auto code = nodes[i]->waitFor(50ms);
      if (!code) continue;
      if (fs::exists(dir.path() + "/summary.json")) {
        finalStatus[i] = code;
      } else {
        nodes[i]->start();
        note("agent rejoin", "node " + std::to_string(i) + " had exited by itself");
      }
    }
  }
  for (int i = 0; i < kNodes; ++i) {
    const int status = *finalStatus[i];
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "node " << i << ": " << fsdp::describeWaitStatus(status) << "\n" << nodes[i]->lastLog();
  }

  std::string faults;
  for (const auto& [kind, count] : tally.faults) faults += kind + " " + std::to_string(count) + ", ";
  std::printf("chaos: faults: %s\nschedule:\n%s", faults.c_str(), tally.schedule.c_str());
  // 1. The job finished every step.
  ASSERT_TRUE(fs::exists(dir.path() + "/summary.json")) << nodes[0]->logs();
  const auto summary = nlohmann::json::parse(readFile(dir.path() + "/summary.json"));
  EXPECT_EQ(summary.at("steps").get<int>(), steps);
  const double jobSeconds = std::chrono::duration<double>(Clock::now() - start).count();

  // 2. Every round the server formed is in some agent's log, and no agent ran a round the
  //    server did not form.
  const std::string serverLog = readFile(serverLogPath);
  const auto formed = roundsIn(serverLog, std::regex("round (\\d+) formed"));
  std::string agentLogs;
  for (const auto& node : nodes) agentLogs += node->logs();
  const auto ran = roundsIn(agentLogs, std::regex("round (\\d+): node rank"));
  EXPECT_FALSE(formed.empty()) << serverLog;
  EXPECT_EQ(formed, ran) << "server log:\n" << serverLog;
  std::printf("chaos: %zu rounds formed; agent instances:", formed.size());
  for (const auto& node : nodes) std::printf(" %d", node->instances());
  std::printf("\n");
  // Which way the survivors went (--restart_mode auto, the default): rounds in which some agent's
  // workers re-formed in process, and in which they started again as processes.
  const auto inProcess = roundsIn(agentLogs, std::regex("round (\\d+): rank\\(s\\) [0-9, ]+ re-form in process"));
  std::printf("chaos: %zu rounds with workers re-formed in process\n", inProcess.size());

  // 3. The last round resumed from a checkpoint: an undisturbed run of the same world size
  //    from that checkpoint ends with the same parameters, bit for bit.
  const int world = summary.at("world_size").get<int>();
  const auto& resumed = summary.at("resumed_from_step");
  const std::string refDir = dir.path() + "/reference";
  fs::create_directories(refDir + "/ckpt");
  if (!resumed.is_null()) {
    char name[32];
    std::snprintf(name, sizeof(name), "step_%08d", resumed.get<int>());
    fs::copy(dir.path() + "/ckpt/" + name, refDir + "/ckpt/" + name, fs::copy_options::recursive);
  }
  std::vector<std::string> reference = {kBin + "/fsdprun", "--standalone", "--nproc_per_node",
                                        std::to_string(world)};
  const auto command = trainingCommand(steps, refDir + "/ckpt", refDir + "/summary.json");
  reference.insert(reference.end(), command.begin(), command.end());
  std::vector<std::string> refEnv = {"FSDPRUN_BACKEND=gloo", "OMP_NUM_THREADS=1", tag};
  const auto refStart = Clock::now();
  const auto refRun = fsdp::testing::runCommand(reference, 600s, refEnv);
  const double refSeconds = std::chrono::duration<double>(Clock::now() - refStart).count();
  ASSERT_EQ(refRun.exitCode, 0) << refRun.out << refRun.err;
  const auto refSummary = nlohmann::json::parse(readFile(refDir + "/summary.json"));
  EXPECT_EQ(refSummary.at("resumed_from_step"), resumed);
  EXPECT_EQ(refSummary.at("params_sha256"), summary.at("params_sha256"))
      << "the chaos run ended elsewhere than an undisturbed run from step " << resumed.dump()
      << " with " << world << " ranks";

  // 4. Nothing of the job is left: no process, no shared-memory segment, no file outside dir.
  for (const int pid : fsdp::testing::processesWithEnvironment(tag)) {
    EXPECT_TRUE(fsdp::testing::processGone(pid, 10s)) << "process " << pid << " outlived the job";
  }
  for (const auto& entry : fs::directory_iterator("/dev/shm")) {
    EXPECT_EQ(entry.path().filename().string().find(runId), std::string::npos)
        << entry.path() << " was left behind";
  }
  std::printf("chaos: world %d at the end, resumed from step %s; parameters %s\n", world,
              resumed.dump().c_str(), summary.at("params_sha256").get<std::string>().c_str());
  // What the faults cost: the job's time against the undisturbed rate of the reference run.
  const int refSteps = steps - (resumed.is_null() ? 0 : resumed.get<int>());
  int faultCount = 0;
  for (const auto& [kind, count] : tally.faults) {
    if (kind.find("kill") != std::string::npos || kind.find("freeze") != std::string::npos)
      faultCount += count;
  }
  if (refSteps > 0 && faultCount > 0) {
    const double undisturbed = refSeconds / refSteps * steps;
    std::printf("chaos: job %.1f s for %d steps, undisturbed about %.1f s: %.2f s lost per fault "
                "(%d faults)\n",
                jobSeconds, steps, undisturbed, (jobSeconds - undisturbed) / faultCount, faultCount);
  }
}

}  // namespace
