// Hangs found and named, then the job goes on: the real launcher, the real mnist trainer with
// in-memory snapshots, a rank that freezes (SIGSTOP), spins in user code or blocks in a read
// after a step; a program whose ranks desync; two agents on loopback. Every wait is bounded by
// the command's timeout; nothing asserts how long anything took.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::summaryOf;
using fsdp::testing::TempDir;
using nlohmann::json;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kData = "/usr/share/datasets/fashion-mnist";
constexpr int kSteps = 16;
constexpr int kStallStep = 6;

std::vector<std::string> mnist(const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {kBin + "/mnist", "--max_steps", std::to_string(kSteps), "--no_eval",
                                   "--progress", "none", "--log_every", "4"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

using fsdp::testing::haveStackTool;

class Hangs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(kData)) return;
    // The uninterrupted run each hung one must match, bit for bit.
    auto argv = mnist({});
    argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", "3"});
    const auto r = runCommand(argv, 300s);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    reference_ = summaryOf(r.out);
    ASSERT_TRUE(reference_.contains("params_sha256")) << r.out;
  }
  void SetUp() override {
    if (!fs::exists(kData)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }

  // A 3-rank job whose rank 1 hangs (`kind`) after step kStallStep of its first attempt.
  void stallAndRecover(const std::string& kind, const std::string& mustShow) {
    TempDir dir;
    auto argv = mnist({"--fault_kill_at_step", std::to_string(kStallStep), "--fault_kill_rank", "1", "--fault_kind",
                       kind});
    argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", "3", "--max_restarts", "2", "--hang_timeout",
                               "5", "--log_dir", dir.path()});
    const auto r = runCommand(argv, 300s);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    const std::string& err = r.err;
    EXPECT_NE(err.find("the job is hung"), std::string::npos) << err;
    EXPECT_NE(err.find("ranks 0, 2 wait in world #"), std::string::npos) << err;
    EXPECT_NE(err.find("rank 1 never entered world #"), std::string::npos) << err;
    EXPECT_NE(err.find("last progress mark: snapshot step " + std::to_string(kStallStep)), std::string::npos) << err;
    EXPECT_NE(err.find("rank 1 on "), std::string::npos) << err;
    if (haveStackTool()) {
      EXPECT_NE(err.find(mustShow), std::string::npos) << err;
    } else {
      EXPECT_NE(err.find("no stack:"), std::string::npos) << err;
    }
    // The lagging rank's error file holds the report, as a torchrun error file.
    const auto error = json::parse(readFile(dir.path() + "/none/attempt_0/1/error.json"), nullptr, false);
    ASSERT_TRUE(error.is_object()) << readFile(dir.path() + "/none/attempt_0/1/error.json");
    EXPECT_NE(error["message"]["message"].get<std::string>().find("never entered"), std::string::npos);
    EXPECT_TRUE(error["message"]["extraInfo"]["hang"].is_array());
    const auto summary = summaryOf(r.out);
    EXPECT_EQ(summary.value("resumed_source", ""), "memory") << r.out;
    EXPECT_GE(summary.value("resumed_from_step", -1), kStallStep - 1) << r.out;
    EXPECT_EQ(summary.value("steps", 0), kSteps);
    EXPECT_EQ(summary.value("params_sha256", ""), reference_["params_sha256"].get<std::string>());
  }
  static inline json reference_;
};

TEST_F(Hangs, AFrozenRankIsNamedWithItsStateAndTheJobEndsBitIdentical) {
  stallAndRecover("stop", "stopped (SIGSTOP)");
}

TEST_F(Hangs, ARankLoopingInUserCodeIsNamedWithTheLoopInItsStack) {
  stallAndRecover("loop", "fsdp_test_spin_forever");
}

TEST_F(Hangs, ARankBlockedInAReadIsNamedWithTheReadInItsStack) {
  stallAndRecover("read", "fsdp_test_block_in_read");
}

TEST(HangDesync, ARankThatSkipsACollectiveIsReportedAsADesync) {
  const auto r = runCommand({kBin + "/fsdprun", "--nproc_per_node", "3", "--hang_timeout", "3", kBin + "/desync_worker",
                             "--skip_rank", "1"},
                            120s);
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_NE(r.err.find("desync in world #5: rank 1 issued all_gather of 30 Float; ranks 0, 2 issued all_reduce of 10 Float"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("the job hung"), std::string::npos) << r.err;  // the final failure report
}

TEST(HangWatchdog, RestartsThatNeverGetPastTheFailingStepStopEarly) {
  if (!fs::exists(kData)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  // No snapshots: each attempt starts over and is killed at step 3 again.
  const auto r = runCommand({kBin + "/fsdprun", "--nproc_per_node", "2", "--max_restarts", "6",
                             "--max_stalled_restarts", "2", kBin + "/mnist", "--max_steps", "20", "--no_eval",
                             "--progress", "none", "--snapshot_every", "0", "--fault_kill_at_step", "3",
                             "--fault_kill_rank", "1", "--fault_every_attempt"},
                            300s);
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_NE(r.err.find("giving up: 2 restarts in a row failed before completing a step past 3"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("restart 6 of 6"), std::string::npos) << r.err;
}

// A PyTorch script has no flight records: when its own collective timeout fails a rank, the
// report shows what the node's other workers, still running, were doing.
TEST(HangPytorch, AScriptWhoseCollectiveTimesOutShowsTheStuckRanksStateAndStacks) {
  if (!fsdp::testing::systemPythonHasTorch()) GTEST_SKIP() << "python3-torch is not installed";
  const auto r = runCommand({kBin + "/fsdprun", "--nproc_per_node", "2", "--hang_timeout", "5",
                             std::string(FSDP_SOURCE_DIR) + "/tests/integration/python/hang_worker.py", "--timeout",
                             "12"},
                            180s, {std::string("PYTHON_EXEC=") + fsdp::testing::kSystemPython});
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_NE(r.err.find("rank 0 (local_rank 0"), std::string::npos) << r.err;  // failed first: its timeout
  EXPECT_NE(r.err.find("the other workers of its node, still running then:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1 (local_rank 1, pid "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("sleeping"), std::string::npos) << r.err;
  if (haveStackTool() && r.err.find("no stack:") == std::string::npos) {  // Yama may refuse a script
    EXPECT_NE(r.err.find("thread "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("read"), std::string::npos) << r.err;  // the C read under os.read
  }
  EXPECT_EQ(r.err.find("the job is hung"), std::string::npos) << r.err;  // no records: no watchdog verdict
}

// Two agents on loopback, one rank each; the rank of the second node spins. Both nodes print the
// report, naming the remote rank's host and its stack.
TEST(HangTwoNodes, BothNodesReportTheStalledRankOfTheSecondNodeWithItsStack) {
  if (!fs::exists(kData)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  std::vector<fsdp::ChildProcess> agents;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv = {kBin + "/fsdprun", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend",
                                     "c10d", "--rdzv_endpoint", "127.0.0.1:" + std::to_string(port), "--rdzv_id",
                                     "hang2", "--local_addr", "127.0.0." + std::to_string(node + 2), "--rdzv_conf",
                                     node == 0 ? "is_host=true" : "is_host=false", "--hang_timeout", "5"};
    const auto more = mnist({"--fault_kill_at_step", "4", "--fault_kill_rank", "1", "--fault_kind", "loop"});
    argv.insert(argv.end(), more.begin(), more.end());
    fsdp::SpawnOptions options{.argv = argv, .env = fsdp::currentEnvironment(), .deathSignal = 0};
    options.stdoutPath = dir.path() + "/node" + std::to_string(node) + ".out";
    options.stderrPath = dir.path() + "/node" + std::to_string(node) + ".err";
    agents.push_back(fsdp::ChildProcess::spawn(options));
  }
  for (int node = 0; node < 2; ++node) {
    const auto status = agents[static_cast<std::size_t>(node)].waitFor(240s);
    ASSERT_TRUE(status) << "node " << node << " did not end";
    const std::string err = readFile(dir.path() + "/node" + std::to_string(node) + ".err");
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 1) << err;
    EXPECT_NE(err.find("rank 1 never entered world #"), std::string::npos) << "node " << node << ":\n" << err;
    EXPECT_NE(err.find("rank 1 on 127.0.0.3"), std::string::npos) << "node " << node << ":\n" << err;
    if (haveStackTool()) {
      EXPECT_NE(err.find("fsdp_test_spin_forever"), std::string::npos) << "node " << node << ":\n" << err;
    }
  }
}

}  // namespace
