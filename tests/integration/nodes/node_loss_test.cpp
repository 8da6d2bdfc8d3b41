// Lost nodes of a job of more than two nodes, end to end: real agents on 127.0.0.2.. against a
// standalone fsdprun-rdzv, the real mnist trainer, real SIGKILLs of whole agents. A lost node's
// ranks come back from their peer copies on another node (fetched over TCP by whichever rank
// needs them); a node lost with the node holding its peer copy sends the job to disk, saying so;
// a frozen node is lost like a dead one, without holding the survivors.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "node_job.hpp"
#include "summary_line.hpp"

namespace {

using fsdp::testing::runCommand;
using fsdp::testing::summaryOf;
using fsdp::testing::nodes::kBin;
using fsdp::testing::metricsLines;
using fsdp::testing::nodes::mnist;
using fsdp::testing::nodes::NodeJob;
using fsdp::testing::nodes::unixNow;
using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kSteps = 30;
constexpr long long kKillAfter = 12;

class NodeLoss : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fsdp::testing::nodes::haveData()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
};


// Kills agent `victim` and checks that the others' workers re-form in process, each agent's one
// worker keeping its pid, their shards laid out again from `worldBefore` ranks.
struct InProcess {
  double killedAt = 0;
  json resume;  // null when none came
};
InProcess killExpectingReshardInProcess(NodeJob& job, int victim, int worldBefore) {
  std::map<int, std::vector<int>> before;
  for (int i = 0; i < job.agents(); ++i) {
    if (i != victim) before[i] = job.workersUnder(i);
  }
  InProcess r;
  r.killedAt = unixNow();
  if (!job.kill(victim)) {
    ADD_FAILURE() << "agent " << victim << " outlived SIGKILL";
    return r;
  }
  r.resume = job.waitForResume(r.killedAt, 240s);
  if (!r.resume.is_object()) {
    ADD_FAILURE() << "no resume line after the kill\n" << job.allErr();
    return r;
  }
  EXPECT_EQ(r.resume.value("path", ""), "in_process") << r.resume << job.allErr();
  EXPECT_EQ(r.resume.value("resharded_from_world", 0), worldBefore) << r.resume;
  for (const auto& [i, pids] : before) {
    EXPECT_EQ(pids.size(), 1u);
    EXPECT_EQ(job.workersUnder(i), pids) << "agent " << i << " has a new worker\n" << job.allErr();
  }
  return r;
}

TEST_F(NodeLoss, AKilledNodeOfFourIsRestoredFromItsPeerCopyAndThreeRanksEndAsAResumedRun) {
  NodeJob job("peer", {.agents = 4, .nnodes = "3:4", .steps = kSteps});
  ASSERT_TRUE(job.waitForStep(kKillAfter, 240s)) << job.allErr();
  // Not rank 0's node: its agent's output holds the summary this test reads.
  const int victim = job.agentOfRank(2);
  ASSERT_GE(victim, 0) << "no worker of rank 2 under any agent";
  // --restart_mode auto (the default): the survivors keep their processes, the world shrinks to
  // 3 and their shards are laid out again in process.
  const auto seen = killExpectingReshardInProcess(job, victim, 4);
  ASSERT_TRUE(seen.resume.is_object());
  const double killedAt = seen.killedAt;
  // Rank 0 of the restarted world prints the summary; whichever agent that is.
  const json summary = fsdp::testing::nodes::survivorsSucceed(job, victim, 300s);
  ASSERT_TRUE(summary.is_object()) << job.allErr();

  // At most one step redone: the last step completed before the kill, against the one resumed.
  const auto around = fsdp::testing::nodes::aroundKill(job.metricsPath(), killedAt);
  ASSERT_TRUE(around.resume.is_object()) << "no resume line in " << job.metricsPath() << "\n"
                                         << job.allErr();
  EXPECT_EQ(around.resume.value("source", ""), "peer copy") << job.allErr();
  const long long resumed = around.resume["step"].get<long long>();
  EXPECT_GE(resumed, around.doneBefore - 1) << "more than one step redone";
  EXPECT_EQ(summary.value("world_size", 0), 3);
  EXPECT_EQ(summary.value("resumed_from_step", -1), resumed);
  EXPECT_EQ(summary.value("steps", 0), kSteps);

  // The state equals a 3-rank run resumed from that step: 4 ranks that save every step up to
  // it, then 3 ranks from its checkpoint.
  std::string error;
  const auto reference = summaryOf(
      fsdp::testing::nodes::resumedReference(job.dir() + "/ckpt", 4, 3, resumed, kSteps, job.tag(), error));
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_EQ(reference.value("resumed_from_step", -1), resumed);
  EXPECT_EQ(summary.value("params_sha256", ""), reference.value("params_sha256", "?"))
      << "the survivors ended elsewhere than three ranks resumed from step " << resumed;
  EXPECT_EQ(job.leftovers(), std::vector<std::string>{});
}

// Survivors never exit, across world sizes: 3 agents of a 2:3 job lose the node of rank 1. The
// other two keep their processes; the world shrinks to 2, rank 2 becomes rank 1, and both lay
// FSDP's shards out again in process and fill them from the snapshot of world 3 (the lost rank's
// piece from its peer copy): the end equals 2 ranks resumed from that step's checkpoint.
void shrinkInProcess(const std::string& sharding) {
  NodeJob job("shrink", {.agents = 3,
                         .nnodes = "2:3",
                         .job = mnist({"--metrics_file", "{metrics}", "--sharding", sharding}, kSteps)});
  ASSERT_TRUE(job.waitForStep(kKillAfter, 240s)) << job.allErr();
  const int victim = job.agentOfRank(1);
  ASSERT_GE(victim, 0) << "no worker of rank 1 under any agent";
  const json resume = killExpectingReshardInProcess(job, victim, 3).resume;
  ASSERT_TRUE(resume.is_object());
  EXPECT_EQ(resume.value("source", ""), "peer copy") << resume;
  const json summary = fsdp::testing::nodes::survivorsSucceed(job, victim, 300s);
  ASSERT_TRUE(summary.is_object()) << job.allErr();
  EXPECT_EQ(summary.value("world_size", 0), 2);
  EXPECT_EQ(summary.value("steps", 0), kSteps);
  const long long resumed = resume["step"].get<long long>();
  EXPECT_EQ(summary.value("resumed_from_step", -1), resumed);
  std::string error;
  const auto reference = summaryOf(
      fsdp::testing::nodes::resumedReference(job.dir() + "/ckpt", 3, 2, resumed, kSteps, job.tag(), error,
                                             {"--sharding", sharding}));
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_EQ(summary.value("params_sha256", ""), reference.value("params_sha256", "?"))
      << sharding << ": the survivors ended elsewhere than two ranks resumed from step " << resumed;
  EXPECT_EQ(job.leftovers(), std::vector<std::string>{});
}

TEST_F(NodeLoss, ANodeLostOfThreeShrinksTheWorldAndTheSurvivorsReshardInProcess) { shrinkInProcess("FULL_SHARD"); }
TEST_F(NodeLoss, ANodeLostOfThreeShrinksTheWorldAndTheSurvivorsReshardInProcessShardGradOp) {
  shrinkInProcess("SHARD_GRAD_OP");
}

// A world that grows in process: 2 agents of a 2:3 job train (or 1 of 1:2); one more joins, which
// ends the round (as torchrun's rendezvous does: there is room for it). The running workers keep
// their processes and lay their shards out for 3 ranks (from 2); the new node's worker restores
// its piece of the snapshot of world 2 over TCP. The end equals 3 ranks resumed from that step's
// checkpoint of 2.
// `running` agents of a running:running+1 job train; one more joins.
void growInProcess(int running) {
  constexpr int kLonger = 40;
  const std::string nnodes = std::to_string(running) + ":" + std::to_string(running + 1);
  NodeJob job("grow", {.agents = running + 1, .nnodes = nnodes, .steps = kLonger, .deferred = 1});
  ASSERT_TRUE(job.waitForStep(4, 240s)) << job.allErr();
  std::vector<std::vector<int>> before;
  for (int i = 0; i < running; ++i) {
    before.push_back(job.workersUnder(i));
    ASSERT_EQ(before.back().size(), 1u);
  }
  const double joinedAt = unixNow();
  job.startDeferred();
  const json resume = job.waitForResume(joinedAt, 240s);
  ASSERT_TRUE(resume.is_object()) << job.allErr();
  EXPECT_EQ(resume.value("path", ""), "in_process") << resume << job.allErr();
  EXPECT_EQ(resume.value("resharded_from_world", 0), running) << resume;
  for (int i = 0; i < running; ++i) EXPECT_EQ(job.workersUnder(i), before[static_cast<std::size_t>(i)]) << job.allErr();
  const json summary = fsdp::testing::nodes::survivorsSucceed(job, -1, 300s);
  ASSERT_TRUE(summary.is_object()) << job.allErr();
  EXPECT_EQ(summary.value("world_size", 0), running + 1);
  EXPECT_EQ(summary.value("steps", 0), kLonger);
  const long long resumed = resume["step"].get<long long>();
  EXPECT_EQ(summary.value("resumed_from_step", -1), resumed);
  std::string error;
  const auto reference = summaryOf(fsdp::testing::nodes::resumedReference(job.dir() + "/ckpt", running, running + 1,
                                                                          resumed, kLonger, job.tag(), error));
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_EQ(summary.value("params_sha256", ""), reference.value("params_sha256", "?"))
      << "the job ended elsewhere than " << running + 1 << " ranks resumed from step " << resumed;
  EXPECT_EQ(job.leftovers(), std::vector<std::string>{});
}

TEST_F(NodeLoss, ANodeAddedGrowsTheWorldAndTheRunningWorkersReshardInProcess) { growInProcess(2); }
// From one rank: FSDP's full buffers at world 1 are the parameters themselves (not sharded).
TEST_F(NodeLoss, ANodeAddedToOneGrowsTheWorldAndItsWorkerShardsInProcess) { growInProcess(1); }

// A node that stops answering without dying (its agent frozen by SIGSTOP: a hung host, a cut
// link) is lost at the heartbeat timeout like a dead one. Its predecessor's peer copy to it never
// gets a reply; the survivors' re-formation, which waits for the snapshot in flight, once waited
// for that copy's 120 s timeout. The agent's abort notice now cuts it short (one line says so):
// the survivors re-form in process while the node is still frozen, and finish.
TEST_F(NodeLoss, AFrozenNodeIsLostAndThePeerCopyToItDoesNotHoldTheSurvivors) {
  NodeJob job("frozen", {.agents = 3,
                         .nnodes = "2:3",
                         .job = mnist({"--metrics_file", "{metrics}"}, kSteps),
                         .env = {"FSDP_LOG_LEVEL=info"}});
  ASSERT_TRUE(job.waitForStep(kKillAfter, 240s)) << job.allErr();
  // Node 1 holds the peer copies of node 0 (rank 0's, whose agent prints the summary).
  const int victim = job.agentOfGroupRank(1);
  const int predecessor = job.agentOfGroupRank(0);
  ASSERT_GE(victim, 0);
  ASSERT_GE(predecessor, 0);
  const double frozenAt = unixNow();
  job.agent(victim).signal(SIGSTOP);
  const json resume = job.waitForResume(frozenAt, 240s);
  ASSERT_TRUE(resume.is_object()) << job.allErr();
  EXPECT_EQ(resume.value("path", ""), "in_process") << resume;
  EXPECT_NE(job.err(predecessor).find("was cut short: the world re-forms"), std::string::npos) << job.allErr();
  job.agent(victim).signal(SIGCONT);  // it finds the run closed and leaves
  const json summary = fsdp::testing::nodes::survivorsSucceed(job, victim, 300s);
  ASSERT_TRUE(summary.is_object()) << job.allErr();
  EXPECT_EQ(summary.value("world_size", 0), 2);
  EXPECT_EQ(summary.value("steps", 0), kSteps);
  EXPECT_TRUE(job.wait(victim, 60s).has_value()) << job.allErr();
  EXPECT_EQ(job.leftovers(), std::vector<std::string>{});
}

TEST_F(NodeLoss, ANodeLostWithItsPeerCopysHolderSendsTheSurvivorsToDiskSayingWhy) {
  constexpr int kEvery = 4;
  NodeJob job("disk", {.agents = 4, .nnodes = "2:4", .steps = kSteps, .checkpointEvery = kEvery});
  ASSERT_TRUE(job.waitForStep(kKillAfter, 240s)) << job.allErr();
  // Node g's peer copies are on node g + 1: kill both, neither of them rank 0's node.
  const int zero = job.agentOfRank(0);
  ASSERT_GE(zero, 0);
  int lostGroup = -1;
  for (int g = 0; g < 4 && lostGroup < 0; ++g) {
    if (job.agentOfGroupRank(g) != zero && job.agentOfGroupRank((g + 1) % 4) != zero) lostGroup = g;
  }
  ASSERT_GE(lostGroup, 0);
  const int first = job.agentOfGroupRank(lostGroup);
  const int second = job.agentOfGroupRank((lostGroup + 1) % 4);
  ASSERT_GE(first, 0);
  ASSERT_GE(second, 0);
  const std::vector<int> lostRanks = job.ranksUnder(first);  // held nowhere once both are gone
  ASSERT_EQ(lostRanks.size(), 1u);
  ::kill(job.agent(first).pid(), SIGKILL);
  ::kill(job.agent(second).pid(), SIGKILL);
  ASSERT_TRUE(job.agent(first).waitFor(20s).has_value());
  ASSERT_TRUE(job.agent(second).waitFor(20s).has_value());
  std::string survivorsErr;
  json summary;
  for (int i = 0; i < job.agents(); ++i) {
    if (i == first || i == second) continue;
    const auto rc = job.wait(i, 300s);
    ASSERT_TRUE(rc.has_value()) << "agent " << i << " did not end\n" << job.allErr();
    ASSERT_EQ(*rc, 0) << "agent " << i << "\n" << job.allErr();
    survivorsErr += job.err(i);
    const auto s = summaryOf(job.out(i));
    if (s.contains("params_sha256")) summary = s;
  }
  ASSERT_TRUE(summary.is_object()) << job.allErr();
  EXPECT_EQ(summary.value("world_size", 0), 2);
  EXPECT_EQ(summary.value("resumed_source", ""), "disk") << survivorsErr;
  EXPECT_EQ(summary.value("resumed_from_step", -1) % kEvery, 0) << summary;
  EXPECT_EQ(summary.value("steps", 0), kSteps);
  // One line says why, naming the rank no survivor holds.
  const std::string why = "rank " + std::to_string(lostRanks[0]) + " is held by no surviving node";
  EXPECT_EQ(fsdp::testing::countOccurrences(survivorsErr, why), 1) << survivorsErr;
  EXPECT_NE(survivorsErr.find("no in-memory snapshot covers every rank of world 4"),
            std::string::npos)
      << survivorsErr;
  EXPECT_EQ(job.leftovers(), std::vector<std::string>{});
}

}  // namespace
