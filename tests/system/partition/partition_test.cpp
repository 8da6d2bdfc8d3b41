// A real network partition (issue 32, must-show 6). Three fsdprun agents, each in a network
// namespace of its own (netns.hpp: own address on a bridge), train mnist with --nnodes 2:3;
// the agent on n1 serves the rendezvous. Once training is under way one node is cut off the
// network (its veth's bridge side goes down: packets dropped, nothing answered) and the job
// splits 2|1 with MIN=2:
//   - the side of two goes on: a new round of world size 2, the lost node's ranks restored
//     from their in-memory peer copy, every step trained, both agents exit 0; when the cut-off
//     node served the rendezvous, the survivors move it to their first successor;
//   - the side of one forms no round: its agent exits 1 with a message naming the partition.
// Every wait is bounded (generous: other tests share the two cores); none asserts wall time.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/common/process.hpp"
#include "netns.hpp"
#include "node_job.hpp"
#include "processes.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"

namespace {

using fsdp::testing::processesWithEnvironment;
using fsdp::testing::processGone;
using fsdp::testing::readFile;
using fsdp::testing::summaryOf;
using fsdp::testing::TempDir;
using fsdp::testing::netns::NamespaceNetwork;
using fsdp::testing::nodes::environmentValue;
using fsdp::testing::nodes::kBin;
using fsdp::testing::nodes::lastTrainStep;
using fsdp::testing::metricsLines;
using fsdp::testing::nodes::mnist;
using fsdp::testing::nodes::parentOf;
using fsdp::testing::nodes::uniqueRunId;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kNodes = 3;
constexpr int kSteps = 80;
constexpr long long kCutAfter = 10;
// The namespaces are this test's alone and new: nothing else can hold a port in them, so the
// rendezvous port need not be found free first (and failover re-serves this same port on n2).
constexpr int kRdzvPort = 29400;
constexpr auto kWait = 300s;

std::string lastLine(std::string text) {
  while (!text.empty() && text.back() == '\n') text.pop_back();
  const auto nl = text.rfind('\n');
  return nl == std::string::npos ? text : text.substr(nl + 1);
}

// One job of three agents, agent i (1-based) in the namespace of node i.
class PartitionJob {
 public:
  PartitionJob(const NamespaceNetwork& net, const std::string& what)
      : runId_(uniqueRunId("partition-" + what)), tag_("FSDP_PARTITION_TAG=" + runId_) {
    std::vector<std::string> env = fsdp::currentEnvironment();
    env.push_back(tag_);
    env.push_back("TMPDIR=" + dir_.path());
    env.push_back("FSDPRUN_BACKEND=gloo");
    const auto job = mnist({"--metrics_file", metricsPath()}, kSteps);
    for (int node = 1; node <= kNodes; ++node) {
      std::vector<std::string> argv = net.enter(node);
      const std::vector<std::string> agent = {
          kBin + "/fsdprun",
          "--nnodes",
          "2:3",
          "--nproc_per_node",
          "1",
          "--max_restarts",
          "3",
          "--rdzv_backend",
          "c10d",
          "--rdzv_endpoint",
          net.address(1) + ":" + std::to_string(kRdzvPort),
          "--rdzv_id",
          runId_,
          "--local_addr",
          net.address(node),
          "--rdzv_conf",
          std::string("is_host=") + (node == 1 ? "true" : "false") +
              ",heartbeat_interval=0.2,heartbeat_timeout=2,last_call_timeout=1,join_timeout=20"};
      argv.insert(argv.end(), agent.begin(), agent.end());
      argv.insert(argv.end(), job.begin(), job.end());
      fsdp::SpawnOptions spawn{.argv = argv, .env = env, .deathSignal = SIGKILL};
      spawn.stdoutPath = outPath(node);
      spawn.stderrPath = errPath(node);
      agents_.push_back(fsdp::ChildProcess::spawn(spawn));
    }
  }

  std::string metricsPath() const { return dir_.path() + "/metrics.jsonl"; }
  std::string outPath(int node) const { return dir_.path() + "/n" + std::to_string(node) + ".out"; }
  std::string errPath(int node) const { return dir_.path() + "/n" + std::to_string(node) + ".err"; }
  std::string out(int node) const { return readFile(outPath(node)); }
  std::string err(int node) const { return readFile(errPath(node)); }
  std::string allErr() const {
    std::string text;
    for (int node = 1; node <= kNodes; ++node) {
      text += "---- stderr of the agent on n" + std::to_string(node) + "\n" + err(node);
    }
    return text;
  }

  // Waits (bounded) until the metrics file shows `step` trained.
  bool waitForStep(long long step, std::chrono::milliseconds within) {
    const auto deadline = std::chrono::steady_clock::now() + within;
    while (lastTrainStep(metricsPath()) < step && std::chrono::steady_clock::now() < deadline) {
      for (auto& a : agents_) {
        if (a.tryWait()) return false;  // an agent ended before training got there
      }
      std::this_thread::sleep_for(50ms);
    }
    return lastTrainStep(metricsPath()) >= step;
  }

  // The GROUP_RANK (node rank) of node's worker now; -1 when it has none.
  int groupRank(int node) const {
    const int agentPid = agents_.at(static_cast<std::size_t>(node - 1)).pid();
    for (const int pid : processesWithEnvironment(tag_)) {
      if (parentOf(pid) != agentPid) continue;
      const std::string rank = environmentValue(pid, "GROUP_RANK");
      if (!rank.empty()) return std::stoi(rank);
    }
    return -1;
  }

  // Node's agent's exit code (128 + signal when killed); nullopt when it did not end within.
  std::optional<int> wait(int node, std::chrono::milliseconds within) {
    const auto status = agents_.at(static_cast<std::size_t>(node - 1)).waitFor(within);
    if (!status) return std::nullopt;
    return WIFEXITED(*status) ? WEXITSTATUS(*status) : 128 + WTERMSIG(*status);
  }

  // Processes of the job that outlive `grace` once its agents are gone.
  std::vector<int> leftovers(std::chrono::milliseconds grace) const {
    std::vector<int> left;
    for (const int pid : processesWithEnvironment(tag_)) {
      if (!processGone(pid, grace)) left.push_back(pid);
    }
    return left;
  }

 private:
  TempDir dir_;
  std::string runId_;
  std::string tag_;
  std::vector<fsdp::ChildProcess> agents_;
};

class Partition : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fsdp::testing::nodes::haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
    std::string why;
    net_ = NamespaceNetwork::create({.nodes = kNodes}, &why);
    if (!net_) GTEST_SKIP() << why;
    names_ = net_->names();
  }

  void TearDown() override {
    // FSDP_PARTITION_VERBOSE=1: every agent's stderr, also when the test passes.
    if (job_ && std::getenv("FSDP_PARTITION_VERBOSE") != nullptr) {
      std::printf("%s", job_->allErr().c_str());
    }
    job_.reset();  // its agents (and workers) first: they run in the namespaces
    net_.reset();
    if (!names_.namespaces.empty()) {
      EXPECT_EQ(NamespaceNetwork::leftoversOf(names_), std::vector<std::string>{});
    }
  }

  // Starts the job and cuts `victim` off once step kCutAfter is trained. Returns the node
  // ranks (GROUP_RANK) the nodes had before the cut, by node.
  std::map<int, int> startAndCut(int victim, const std::string& what) {
    job_ = std::make_unique<PartitionJob>(*net_, what);
    std::map<int, int> ranks;
    if (!job_->waitForStep(kCutAfter, 240s)) {
      ADD_FAILURE() << "step " << kCutAfter << " not reached\n" << job_->allErr();
      return ranks;
    }
    for (int node = 1; node <= kNodes; ++node) ranks[node] = job_->groupRank(node);
    net_->cut(victim);
    return ranks;
  }

  // The survivors end with exit code 0, all steps, world size 2, resumed from the peer copy;
  // the victim ends with 1, naming the partition.
  void expectSplitTwoOne(int victim) {
    PartitionJob& job = *job_;
    json summary;
    for (int node = 1; node <= kNodes; ++node) {
      if (node == victim) continue;
      const auto rc = job.wait(node, kWait);
      ASSERT_TRUE(rc.has_value()) << "the agent on n" << node << " did not end\n" << job.allErr();
      EXPECT_EQ(*rc, 0) << "the agent on n" << node << "\n" << job.allErr();
      const auto s = summaryOf(job.out(node));
      if (s.is_object() && s.contains("params_sha256")) summary = s;
    }
    ASSERT_TRUE(summary.is_object()) << "no summary line in the survivors' output\n"
                                     << job.allErr();
    std::printf("the survivors' summary: %s\n", summary.dump().c_str());
    EXPECT_EQ(summary.value("world_size", 0), 2) << summary;
    EXPECT_EQ(summary.value("steps", 0), kSteps) << summary;
    EXPECT_EQ(summary.value("resumed_source", json()), json("peer copy")) << summary;
    json resume;
    for (const auto& line : metricsLines(job.metricsPath())) {
      if (line.value("type", "") == "resume") resume = line;
    }
    ASSERT_TRUE(resume.is_object()) << "no resume line in " << job.metricsPath() << "\n"
                                    << job.allErr();
    EXPECT_EQ(resume.value("source", ""), "peer copy") << resume;
    EXPECT_EQ(lastTrainStep(job.metricsPath()), kSteps) << job.allErr();
    const auto victimRc = job.wait(victim, kWait);
    ASSERT_TRUE(victimRc.has_value()) << "the cut-off agent on n" << victim << " did not end\n"
                                      << job.allErr();
    EXPECT_EQ(*victimRc, 1) << job.allErr();
    const std::string victimErr = job.err(victim);
    std::printf("n%d (cut off) exited %d; its last line: %s\n", victim, *victimRc,
                lastLine(victimErr).c_str());
    EXPECT_NE(victimErr.find("forms no round"), std::string::npos) << job.allErr();
    EXPECT_NE(victimErr.find("network partition"), std::string::npos) << job.allErr();
    EXPECT_EQ(job.leftovers(10s), std::vector<int>{});
  }

  std::unique_ptr<NamespaceNetwork> net_;
  NamespaceNetwork::Names names_;
  std::unique_ptr<PartitionJob> job_;
};

TEST_F(Partition, ACutOffWorkerNodeFormsNoRoundWhileTheOtherTwoFinishFromItsPeerCopy) {
  startAndCut(3, "worker");
  if (HasFailure()) return;
  expectSplitTwoOne(3);
  // The rendezvous stayed where it was.
  EXPECT_EQ(job_->err(2).find("serving the rendezvous of run"), std::string::npos)
      << job_->allErr();
}

TEST_F(Partition, ACutOffRendezvousHostFormsNoRoundWhileTheOtherTwoMoveItAndFinish) {
  const auto ranks = startAndCut(1, "host");
  if (HasFailure()) return;
  expectSplitTwoOne(1);
  // The survivors try the successors in node-rank order: the first, of the two, serves.
  ASSERT_GE(ranks.at(2), 0);
  ASSERT_GE(ranks.at(3), 0);
  const int first = ranks.at(2) < ranks.at(3) ? 2 : 3;
  const int other = 5 - first;
  EXPECT_NE(job_->err(first).find("serving the rendezvous of run"), std::string::npos)
      << "node ranks before the cut: n2 " << ranks.at(2) << ", n3 " << ranks.at(3) << "\n"
      << job_->allErr();
  EXPECT_EQ(job_->err(other).find("serving the rendezvous of run"), std::string::npos)
      << job_->allErr();
  const std::string movedTo = "goes on with the rendezvous at " + net_->address(first);
  EXPECT_NE(job_->err(2).find(movedTo), std::string::npos) << job_->allErr();
  EXPECT_NE(job_->err(3).find(movedTo), std::string::npos) << job_->allErr();
}

}  // namespace
