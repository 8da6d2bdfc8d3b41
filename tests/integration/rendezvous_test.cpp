// Rendezvous rounds over real sockets: fsdprun-rdzv and agent processes on loopback.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>

#include <fstream>
#include <string>

#include "fsdp/common/process.hpp"
#include "line_reader.hpp"
#include "processes.hpp"
#include "rdzv_daemon.hpp"
#include "run_command.hpp"

namespace {

using fsdp::testing::LineProcess;
using fsdp::testing::procNumber;
using fsdp::testing::RdzvDaemon;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kAgent = std::string(FSDP_BIN_DIR) + "/rdzv_agent";

std::unique_ptr<LineProcess> agent(const RdzvDaemon& d, const std::string& node, int minNodes, int maxNodes,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {kAgent, std::to_string(d.port()), node, std::to_string(minNodes),
                                   std::to_string(maxNodes)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return std::make_unique<LineProcess>(argv);
}

std::string field(const std::string& line, const std::string& name) {
  const auto at = line.find(name + "=");
  if (at == std::string::npos) return "";
  const auto start = at + name.size() + 1;
  return line.substr(start, line.find(' ', start) - start);
}

TEST(Rendezvous, RanksFollowNodeNamesAndOffsetsFollowLocalWorldSizes) {
  RdzvDaemon d;
  auto c = agent(d, "node-c", 3, 3, {"--local_world_size", "2"});
  auto a = agent(d, "node-a", 3, 3, {"--local_world_size", "4"});
  auto b = agent(d, "node-b", 3, 3, {"--local_world_size", "1"});
  const auto la = a->waitFor("ASSIGNED", 10s);
  const auto lb = b->waitFor("ASSIGNED", 10s);
  const auto lc = c->waitFor("ASSIGNED", 10s);
  ASSERT_TRUE(la && lb && lc);
  EXPECT_EQ(field(*la, "node_rank"), "0");
  EXPECT_EQ(field(*lb, "node_rank"), "1");
  EXPECT_EQ(field(*lc, "node_rank"), "2");
  EXPECT_EQ(field(*lb, "rank_offset"), "4");
  EXPECT_EQ(field(*lc, "rank_offset"), "5");
  EXPECT_EQ(field(*lc, "world_size"), "7");
}

TEST(Rendezvous, PreferredRankWinsOverTheName) {
  RdzvDaemon d;
  auto a = agent(d, "a", 2, 2, {"--preferred_rank", "1"});
  auto z = agent(d, "z", 2, 2, {"--preferred_rank", "0"});
  const auto la = a->waitFor("ASSIGNED", 10s);
  const auto lz = z->waitFor("ASSIGNED", 10s);
  ASSERT_TRUE(la && lz);
  EXPECT_EQ(field(*lz, "node_rank"), "0");
  EXPECT_EQ(field(*la, "node_rank"), "1");
}

TEST(Rendezvous, MinNodesCompleteAfterTheLastCallWait) {
  RdzvDaemon d;
  const auto start = Clock::now();
  auto a = agent(d, "a", 2, 4, {"--last_call_ms", "400"});
  auto b = agent(d, "b", 2, 4, {"--last_call_ms", "400"});
  const auto la = a->waitFor("ASSIGNED", 10s);
  ASSERT_TRUE(la);
  EXPECT_GE(Clock::now() - start, 350ms);
  EXPECT_EQ(field(*la, "nnodes"), "2");
}

TEST(Rendezvous, ASigkilledNodeIsNoticedAtOnceAndTheRestContinueSmaller) {
  RdzvDaemon d;
  // Heartbeats would take 30 s: only the closed connection can explain a fast notice.
  const std::vector<std::string> slowHeartbeat = {"--heartbeat_timeout_ms", "30000", "--heartbeat_ms", "1000",
                                                  "--last_call_ms", "100"};
  auto a = agent(d, "a", 1, 2, slowHeartbeat);
  auto b = agent(d, "b", 1, 2, slowHeartbeat);
  // Round 0 when both joined within the last call; round 1 when a formed one alone first (b's
  // start slower than 100 ms, as under ctest -j2 with ASan) and b's join ended it.
  const auto both = a->waitFor("nnodes=2", 10s);
  ASSERT_TRUE(both);
  ASSERT_TRUE(b->waitFor("nnodes=2", 10s));
  b->process().signal(SIGKILL);
  // Within 5 s, where a heartbeat would take 30: the closed connection, which the line names.
  const auto ended = a->waitFor("ROUND_ENDED", 5s);
  ASSERT_TRUE(ended);
  EXPECT_NE(ended->find("node b left: connection closed"), std::string::npos) << *ended;
  const auto again = a->waitFor("ASSIGNED", 5s);
  ASSERT_TRUE(again);
  EXPECT_EQ(field(*again, "nnodes"), "1");
  EXPECT_EQ(field(*again, "round"), std::to_string(std::stoi(field(*both, "round")) + 1));
}

TEST(Rendezvous, ASigstoppedNodeIsNoticedAfterTheHeartbeatTimeout) {
  RdzvDaemon d;
  const std::vector<std::string> hb = {"--heartbeat_timeout_ms", "1000", "--heartbeat_ms", "100",
                                       "--last_call_ms", "100"};
  auto a = agent(d, "a", 1, 2, hb);
  auto b = agent(d, "b", 1, 2, hb);
  ASSERT_TRUE(a->waitFor("nnodes=2", 10s));
  ASSERT_TRUE(b->waitFor("nnodes=2", 10s));
  const auto stoppedAt = Clock::now();
  b->process().signal(SIGSTOP);
  const auto ended = a->waitFor("ROUND_ENDED", 10s);
  const auto took = Clock::now() - stoppedAt;
  b->process().signal(SIGKILL);
  ASSERT_TRUE(ended);
  // The server counts the 1000 ms from the last heartbeat it received, sent every 100 ms or later
  // (a busy host delays one): the notice may come up to a few of them sooner after the stop.
  EXPECT_GE(took, 500ms);
  EXPECT_LT(took, 4s);
  EXPECT_NE(ended->find("no heartbeat for 1000 ms"), std::string::npos) << *ended;
  EXPECT_TRUE(a->waitFor("nnodes=1", 5s));
}

TEST(Rendezvous, ALateJoinerEndsTheRunningRound) {
  RdzvDaemon d;
  auto a = agent(d, "a", 1, 3, {"--last_call_ms", "100"});
  ASSERT_TRUE(a->waitFor("nnodes=1", 10s));
  auto b = agent(d, "b", 1, 3, {"--last_call_ms", "100"});
  const auto ended = a->waitFor("ROUND_ENDED", 5s);
  ASSERT_TRUE(ended);
  EXPECT_NE(ended->find("node b joined"), std::string::npos) << *ended;
  EXPECT_TRUE(a->waitFor("nnodes=2", 5s));
  EXPECT_TRUE(b->waitFor("nnodes=2", 5s));
}

TEST(Rendezvous, DaemonSigtermTellsAgentsAndExitsZeroWithinASecond) {
  RdzvDaemon d;
  auto a = agent(d, "a", 1, 1);
  ASSERT_TRUE(a->waitFor("ASSIGNED", 10s));
  const auto start = Clock::now();
  d.process().signal(SIGTERM);
  const auto status = d.process().waitFor(5s);
  ASSERT_TRUE(status);
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
  const auto closed = a->waitFor("RUN_CLOSED", 5s);
  ASSERT_TRUE(closed);
  EXPECT_NE(closed->find("server shutting down"), std::string::npos);
}

// The daemon takes the hard limit on descriptors (a soft limit of 1,024 would refuse the
// 1,021st rank) and sizes its descriptor table for it before serving, so that the table never
// grows (an RCU grace period each time) while thousands of ranks connect.
TEST(Rendezvous, DaemonTakesTheHardDescriptorLimitAndSizesItsTableUpFront) {
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  if (limit.rlim_max < 4096) GTEST_SKIP() << "a hard descriptor limit of " << limit.rlim_max;
  if (!fsdp::findExecutable("prlimit", nullptr)) GTEST_SKIP() << "prlimit (util-linux) is missing";
  RdzvDaemon d({}, {"prlimit", "--nofile=256:4096"});
  const std::string proc = "/proc/" + std::to_string(d.process().pid());
  EXPECT_EQ(procNumber(proc + "/limits", "Max open files"), 4096) << fsdp::testing::readFile(proc + "/limits");
  EXPECT_GE(procNumber(proc + "/status", "FDSize:"), 4096) << fsdp::testing::readFile(proc + "/status");
}

TEST(Rendezvous, OnlyAgentsWithTheTokenGetIn) {
  fsdp::testing::TempDir dir;
  std::ofstream(dir.path() + "/token") << "correct horse\n";
  RdzvDaemon d({"--token_file", dir.path() + "/token"});
  auto wrong = agent(d, "w", 1, 1, {"--token", "battery staple"});
  const auto refused = wrong->waitFor("ERROR", 10s);
  ASSERT_TRUE(refused);
  EXPECT_NE(refused->find("authentication failed"), std::string::npos) << *refused;
  EXPECT_EQ(refused->find("correct horse"), std::string::npos);  // never echoed
  auto none = agent(d, "n", 1, 1);
  const auto noToken = none->waitFor("ERROR", 10s);
  ASSERT_TRUE(noToken);
  EXPECT_NE(noToken->find("requires a job token"), std::string::npos) << *noToken;
  auto right = agent(d, "r", 1, 1, {"--token", "correct horse"});
  EXPECT_TRUE(right->waitFor("ASSIGNED", 10s));
}

}  // namespace
