// A real Prometheus server scraping the agents of a real 2-node mnist job on loopback
// (--metrics_port on each agent; node 0 also serves the rendezvous, and its figures): the test
// reads the job only through Prometheus' query API, as an operator's dashboard would. Every rank's
// step appears and advances; a worker SIGKILLed shows as a restart on both nodes and a second
// rendezvous round, and the steps advance again. Skips without `prometheus` or the dataset.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"
#include "node_job.hpp"
#include "processes.hpp"
#include "prometheus_server.hpp"
#include "run_command.hpp"

namespace {

using fsdp::testing::prometheusMissing;
using fsdp::testing::PrometheusServer;
using fsdp::testing::QueryWait;
using fsdp::testing::valuesBy;
using Json = nlohmann::json;
using namespace std::chrono_literals;
namespace nodes = fsdp::testing::nodes;

constexpr int kNodes = 2;
constexpr int kProcPerNode = 2;
constexpr int kWorld = kNodes * kProcPerNode;

// The last `lines` lines of a file, under a line naming it.
std::string tail(const std::string& path, std::size_t lines = 40) {
  std::deque<std::string> kept;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    kept.push_back(line);
    if (kept.size() > lines) kept.pop_front();
  }
  std::string text = "---- " + path + " (last " + std::to_string(kept.size()) + " lines)\n";
  for (const auto& l : kept) text += l + "\n";
  return text;
}

// The training every node runs: ShallowNet, a small batch, far more steps than the test lasts
// (it kills the job), no evaluation, no per-step output.
std::vector<std::string> mnistCommand() {
  return {nodes::kBin + "/mnist", "--model", "shallow", "--batch_size", "32", "--epochs", "1000",
          "--max_steps", "1000000", "--no_eval", "--progress", "none", "--log_every", "0"};
}

// Two agents ("nodes" 127.0.0.2 and 127.0.0.3) of one job, each serving /metrics on its own
// address and port; node 0 hosts the rendezvous. The destructor SIGKILLs the agents (their
// workers die with them: PR_SET_PDEATHSIG) and waits for every process of the job to be gone.
class MetricsJob {
 public:
  MetricsJob() : runId_(nodes::uniqueRunId("prom")), tag_("FSDP_PROM_TAG=" + runId_) {
    const int rdzvPort = fsdp::testing::freeLoopbackPort();
    std::vector<std::string> env = fsdp::currentEnvironment();
    env.push_back(tag_);
    env.push_back("TMPDIR=" + dir_.path());
    for (int node = 0; node < kNodes; ++node) {
      int port = fsdp::testing::freeLoopbackPort();
      while (port == rdzvPort || std::find(ports_.begin(), ports_.end(), port) != ports_.end()) {
        port = fsdp::testing::freeLoopbackPort();
      }
      ports_.push_back(port);
      std::vector<std::string> argv = {nodes::kBin + "/fsdprun",
                                       "--nnodes", std::to_string(kNodes),
                                       "--nproc_per_node", std::to_string(kProcPerNode),
                                       "--max_restarts", "3",
                                       "--rdzv_backend", "c10d",
                                       "--rdzv_endpoint", "127.0.0.1:" + std::to_string(rdzvPort),
                                       "--rdzv_id", runId_,
                                       "--local_addr", address(node),
                                       "--rdzv_conf", node == 0 ? "is_host=true" : "is_host=false",
                                       "--metrics_port", std::to_string(port),
                                       "--metrics_addr", address(node)};
      const auto command = mnistCommand();
      argv.insert(argv.end(), command.begin(), command.end());
      fsdp::SpawnOptions spawn{.argv = argv, .env = env, .deathSignal = SIGKILL};
      spawn.stdoutPath = outPath(node);
      spawn.stderrPath = errPath(node);
      agents_.push_back(fsdp::ChildProcess::spawn(spawn));
    }
  }

  ~MetricsJob() {
    agents_.clear();  // SIGKILL and reap each agent's process group
    for (const int pid : fsdp::testing::processesWithEnvironment(tag_)) {
      if (!fsdp::testing::processGone(pid, 10s)) ::kill(pid, SIGKILL);
    }
  }
  MetricsJob(const MetricsJob&) = delete;
  MetricsJob& operator=(const MetricsJob&) = delete;

  const std::string& runId() const { return runId_; }
  static std::string address(int node) { return "127.0.0." + std::to_string(node + 2); }
  // "HOST:PORT" of node `node`'s /metrics.
  std::string metricsTarget(int node) const {
    return address(node) + ":" + std::to_string(ports_.at(static_cast<std::size_t>(node)));
  }
  std::string outPath(int node) const { return dir_.path() + "/agent" + std::to_string(node) + ".out"; }
  std::string errPath(int node) const { return dir_.path() + "/agent" + std::to_string(node) + ".err"; }

  // Every agent's stderr tail, and whether it still runs.
  std::string diagnostics() {
    std::string text;
    for (int node = 0; node < kNodes; ++node) {
      auto& agent = agents_.at(static_cast<std::size_t>(node));
      const auto status = agent.reaped() ? agent.status() : agent.tryWait();
      text += "agent " + std::to_string(node) + " (pid " + std::to_string(agent.pid()) + "): " +
              (status ? fsdp::describeWaitStatus(*status) : std::string("running")) + "\n" +
              tail(errPath(node));
    }
    return text;
  }

  // The training workers under node `node`'s agent now: pid -> global rank (RANK).
  std::map<int, int> workersOf(int node) const {
    std::map<int, int> workers;
    const int agent = agents_.at(static_cast<std::size_t>(node)).pid();
    for (const int pid : fsdp::testing::processesWithEnvironment(tag_)) {
      if (fsdp::testing::parentOf(pid) != agent) continue;
      const std::string rank = nodes::environmentValue(pid, "RANK");
      const std::string cmdline = fsdp::testing::readFile("/proc/" + std::to_string(pid) + "/cmdline");
      if (!rank.empty() && cmdline.find("/mnist") != std::string::npos) workers[pid] = std::stoi(rank);
    }
    return workers;
  }

 private:
  fsdp::testing::TempDir dir_;
  std::string runId_;
  std::string tag_;  // "FSDP_PROM_TAG=<run id>": in the environment of every process of the job
  std::vector<int> ports_;
  std::vector<fsdp::ChildProcess> agents_;
};

// Every rank 0..kWorld-1 has a sample, and, for the ranks in `above`, a value above it.
bool allRanks(const Json& result, const std::map<std::string, double>& above = {}) {
  const auto steps = valuesBy(result, "rank");
  for (int rank = 0; rank < kWorld; ++rank) {
    const auto it = steps.find(std::to_string(rank));
    if (it == steps.end()) return false;
    if (const auto floor = above.find(it->first); floor != above.end() && !(it->second > floor->second)) {
      return false;
    }
  }
  return true;
}

// Every node's sample is at least `least`.
std::function<bool(const Json&)> everyNodeAtLeast(double least) {
  return [least](const Json& result) {
    const auto values = valuesBy(result, "node");
    if (values.size() != static_cast<std::size_t>(kNodes)) return false;
    return std::all_of(values.begin(), values.end(), [least](const auto& v) { return v.second >= least; });
  };
}

TEST(PrometheusHarness, ScrapesItself) {
  if (const auto why = prometheusMissing(); !why.empty()) GTEST_SKIP() << why;
  PrometheusServer prom({.scrapeItself = true});
  const QueryWait up = prom.waitFor("up{job=\"fsdprun\"}", [](const Json& r) {
    return r.size() == 1 && fsdp::testing::sampleValue(r[0]) == 1;
  }, 30s);
  ASSERT_TRUE(up.met) << up.describe() << prom.logTail();
  EXPECT_EQ(up.result[0]["metric"].value("instance", ""), prom.address()) << up.describe();
  // A bad expression is an error naming the query, not an empty result.
  try {
    prom.query("up{");
    ADD_FAILURE() << "a malformed query did not throw";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'up{'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad_data"), std::string::npos) << e.what();
  }
}

TEST(PrometheusHarness, AServerThatDoesNotStartThrowsWithItsLog) {
  if (const auto why = prometheusMissing(); !why.empty()) GTEST_SKIP() << why;
  try {
    PrometheusServer prom({.jobName = ""});  // Prometheus refuses a scrape job without a name
    ADD_FAILURE() << "a config Prometheus refuses did not throw";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("before it was ready"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("job_name is empty"), std::string::npos) << e.what();
  }
}

TEST(Prometheus, SeesEveryRankStepAndAWorkerKillAsARestartOnBothNodesAndANewRound) {
  if (const auto why = prometheusMissing(); !why.empty()) GTEST_SKIP() << why;
  if (!nodes::haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  MetricsJob job;
  PrometheusServer prom({.targets = {job.metricsTarget(0), job.metricsTarget(1)}});
  const std::string sel = "{job=\"" + job.runId() + "\"}";
  const std::string step = "fsdprun_worker_step" + sel;
  const auto context = [&] { return job.diagnostics() + prom.logTail(); };

  // 1. Every rank's step appears, then every one advances past the first value seen.
  const QueryWait appeared = prom.waitFor(step, [](const Json& r) { return allRanks(r); }, 120s);
  ASSERT_TRUE(appeared.met) << appeared.describe() << context();
  const auto first = valuesBy(appeared.result, "rank");
  const QueryWait advanced = prom.waitFor(step, [&](const Json& r) { return allRanks(r, first); }, 60s);
  ASSERT_TRUE(advanced.met) << "first seen: " << appeared.describe() << advanced.describe() << context();
  const QueryWait before = prom.waitFor("fsdprun_node_restarts_total" + sel, everyNodeAtLeast(0), 30s);
  ASSERT_TRUE(before.met) << before.describe() << context();
  for (const auto& [node, restarts] : valuesBy(before.result, "node")) {
    ASSERT_EQ(restarts, 0) << "node " << node << " restarted before any fault: " << before.describe() << context();
  }

  // 2. SIGKILL one worker of node 1 (not the node that serves the rendezvous).
  const auto workers = job.workersOf(1);
  ASSERT_EQ(workers.size(), static_cast<std::size_t>(kProcPerNode)) << context();
  const auto [victim, victimRank] = *workers.begin();
  ASSERT_EQ(::kill(victim, SIGKILL), 0) << "kill " << victim;
  EXPECT_TRUE(fsdp::testing::processGone(victim, 20s)) << "worker " << victim << " outlived SIGKILL";

  // 3. Both nodes count the restart, the server a second round, and every rank trains again.
  const QueryWait restarted = prom.waitFor("fsdprun_node_restarts_total" + sel, everyNodeAtLeast(1), 90s);
  ASSERT_TRUE(restarted.met) << "killed rank " << victimRank << " (pid " << victim << ")\n"
                             << restarted.describe() << context();
  const QueryWait rounds = prom.waitFor("fsdprun_rendezvous_rounds_total" + sel, [](const Json& r) {
    return r.size() == 1 && fsdp::testing::sampleValue(r[0]) >= 2;
  }, 30s);
  ASSERT_TRUE(rounds.met) << rounds.describe() << context();
  // The restarted workers' steps (each node's newest scrape shows its new round's workers only).
  const QueryWait again = prom.waitFor(step, [](const Json& r) { return allRanks(r); }, 90s);
  ASSERT_TRUE(again.met) << again.describe() << context();
  const auto resumed = valuesBy(again.result, "rank");
  const QueryWait onward = prom.waitFor(step, [&](const Json& r) { return allRanks(r, resumed); }, 60s);
  ASSERT_TRUE(onward.met) << "after the restart: " << again.describe() << onward.describe() << context();
  const auto show = [](const std::map<std::string, double>& steps) {
    std::string text;
    for (const auto& [rank, value] : steps) text += " " + rank + ":" + std::to_string(static_cast<long long>(value));
    return text;
  };
  std::printf("prometheus: steps by rank%s before the kill of rank %d,%s after the restart\n",
              show(valuesBy(advanced.result, "rank")).c_str(), victimRank,
              show(valuesBy(onward.result, "rank")).c_str());
}

}  // namespace
