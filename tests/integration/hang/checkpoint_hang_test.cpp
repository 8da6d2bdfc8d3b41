// Hangs around checkpoints, snapshots and restores, with a hand-written loop (stall_worker.cpp)
// under the real launcher: a rank stuck in the user's code just before a save, a loadLatest() or a
// snapshot restore, while the others wait for it there, is named with its function in seconds
// and the job finishes from the newest checkpoint or snapshot, bit-identical to a run never
// stopped; a rank that is only slow inside its own checkpoint write (a slow disk) is not declared
// hung, on its node or on another, until a much longer bound. Every wait is bounded by the
// command's timeout; nothing asserts how long anything took.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "run_command.hpp"
#include "summary_line.hpp"

namespace checkpoint_hang {  // its own names in a unity batch
namespace {

namespace fs = std::filesystem;
using fsdp::testing::readFile;
using fsdp::testing::runCommand;
using fsdp::testing::summaryOf;
using fsdp::testing::TempDir;
using nlohmann::json;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
constexpr int kSteps = 12;
constexpr int kRanks = 3;

using fsdp::testing::haveStackTool;

std::vector<std::string> worker(const std::string& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {kBin + "/stall_worker", "--dir", dir, "--steps", std::to_string(kSteps),
                                   "--save_every", "3"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

std::vector<std::string> finalHashes(const std::string& dir, int ranks) {
  std::vector<std::string> out;
  for (int r = 0; r < ranks; ++r) out.push_back(readFile(dir + "/final_" + std::to_string(r)));
  return out;
}

class CheckpointHangs : public ::testing::Test {
 protected:
  // The run every stalled one must match, bit for bit: never stopped.
  static void SetUpTestSuite() {
    TempDir dir;
    auto argv = worker(dir.path(), {});
    argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", std::to_string(kRanks)});
    const auto r = runCommand(argv, 180s);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    reference_ = finalHashes(dir.path(), kRanks);
    ASSERT_FALSE(reference_[0].empty()) << r.out;
  }

  // Runs a 3-rank job whose rank 1 stalls before `where`, then checks the report and the end.
  void stallAndFinish(const std::vector<std::string>& flags, const std::string& function,
                      const std::vector<std::string>& mustShow, const std::string& resumedFrom) {
    if (reference_.empty()) GTEST_SKIP() << "the reference run failed";
    TempDir dir;
    auto argv = worker(dir.path(), flags);
    argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", std::to_string(kRanks), "--max_restarts",
                               "3", "--hang_timeout", "5"});
    const auto r = runCommand(argv, 300s);
    ASSERT_EQ(r.exitCode, 0) << r.err;
    const std::string& err = r.err;
    EXPECT_NE(err.find("the job is hung"), std::string::npos) << err;
    for (const auto& line : mustShow) EXPECT_NE(err.find(line), std::string::npos) << line << "\n" << err;
    EXPECT_NE(err.find("rank 1 on "), std::string::npos) << err;
    if (haveStackTool()) {
      EXPECT_NE(err.find(function), std::string::npos) << err;
    } else {
      EXPECT_NE(err.find("no stack:"), std::string::npos) << err;
    }
    const auto summary = summaryOf(r.out);
    EXPECT_EQ(summary.value("steps", 0), kSteps) << r.out;
    EXPECT_EQ(summary.value("resumed_from", json()), json(resumedFrom)) << r.out;
    EXPECT_EQ(finalHashes(dir.path(), kRanks), reference_);
  }

  static inline std::vector<std::string> reference_;
};

// Rank 1 spins just before the save of step 6; rank 0 waits in the save's commit for its files,
// rank 2 (its own file written) in the next step's all-gather. Before, rank 0's save counted as
// busy for the whole wait and nothing was ever reported.
TEST_F(CheckpointHangs, ARankStuckBeforeASaveIsNamedWithTheSaveTheOthersWaitIn) {
  stallAndFinish({"--stall_rank", "1", "--stall_at", "save", "--stall_step", "6"}, "stall_worker_stuck_before_save",
                 {"rank 0 waits in checkpoint #2 (save step 6: waiting for ranks' files)",
                  "rank 1 never entered checkpoint #2", "rank 2 waits in world #", "rank 1 never entered world #",
                  "last progress mark: step 6"},
                 "disk");
}

// The first attempt loses rank 2 after step 8 (the save of step 6 is the newest); on the
// restart rank 1 spins before loadLatest() while the others wait in its first collective.
TEST_F(CheckpointHangs, ARankStuckBeforeLoadLatestOnARestartIsNamed) {
  stallAndFinish({"--crash_rank", "2", "--crash_step", "8", "--stall_rank", "1", "--stall_at", "load"},
                 "stall_worker_stuck_before_load",
                 {"ranks 0, 2 wait in world #", "(checkpoint pick)", "rank 1 never entered world #",
                  "no progress mark yet"},
                 "disk");
}

// The same with in-memory snapshots: rank 1 spins before the Snapshotter's restore.
TEST_F(CheckpointHangs, ARankStuckBeforeASnapshotRestoreIsNamed) {
  stallAndFinish({"--snapshots", "--crash_rank", "2", "--crash_step", "8", "--stall_rank", "1", "--stall_at",
                  "restore"},
                 "stall_worker_stuck_before_restore",
                 {"ranks 0, 2 wait in world #", "(snapshot restore)", "rank 1 never entered world #", "no progress mark yet"},
                 "memory");
}

// Rank 1's checkpoint write takes 3x the hang timeout (the test hook sleeps inside it): ranks 0
// and 2 wait for it, the node is quiet, and nothing is declared. The job ends never restarted.
TEST_F(CheckpointHangs, ARankSlowInItsOwnWriteIsNotDeclaredHung) {
  if (reference_.empty()) GTEST_SKIP() << "the reference run failed";
  TempDir dir;
  auto argv = worker(dir.path(), {});
  argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", std::to_string(kRanks), "--max_restarts", "3",
                             "--hang_timeout", "3"});
  const auto r = runCommand(argv, 300s, {"FSDPRUN_TEST_CHECKPOINT_WRITE_DELAY=1:9000"});
  ASSERT_EQ(r.exitCode, 0) << r.err;
  EXPECT_NE(r.err.find("rank 1 sleeps 9000 ms inside its checkpoint write"), std::string::npos) << r.err;
  // The watchdog saw the quiet node and held back: what this test is about.
  EXPECT_NE(r.err.find("has been inside its own checkpoint write for"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("the job is hung"), std::string::npos) << r.err;
  EXPECT_EQ(summaryOf(r.out).value("attempt", -1), 0) << r.out;
  EXPECT_EQ(finalHashes(dir.path(), kRanks), reference_);
}

// Past kBusyFactor (10) times the hang timeout, a write that never ends is a hang; the report
// says which rank was inside its own write and for how long.
TEST_F(CheckpointHangs, AWriteThatNeverEndsIsDeclaredPastTheLongerBound) {
  TempDir dir;
  auto argv = worker(dir.path(), {});
  argv.insert(argv.begin(), {kBin + "/fsdprun", "--nproc_per_node", std::to_string(kRanks), "--hang_timeout", "2"});
  const auto r = runCommand(argv, 300s, {"FSDPRUN_TEST_CHECKPOINT_WRITE_DELAY=1:600000"});
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_NE(r.err.find("the job is hung"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("past the 20.0 s a long operation may take (10x the hang timeout)"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("rank 1 is inside its own checkpoint write (waiting for no other rank), for "),
            std::string::npos) << r.err;
}

// Two agents on loopback, two ranks each: rank 1's write is slow; ranks 2 and 3, on the other
// node, wait for it there. Neither node declares the job hung; both finish.
TEST_F(CheckpointHangs, ARankSlowInItsOwnWriteHoldsBackTheOtherNodeToo) {
  if (reference_.empty()) GTEST_SKIP() << "the reference run failed";
  TempDir dir;
  const int port = fsdp::testing::freeLoopbackPort();
  std::vector<fsdp::ChildProcess> agents;
  auto env = fsdp::currentEnvironment();
  env.push_back("FSDPRUN_TEST_CHECKPOINT_WRITE_DELAY=1:9000");
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv = {kBin + "/fsdprun", "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend",
                                     "c10d", "--rdzv_endpoint", "127.0.0.1:" + std::to_string(port), "--rdzv_id",
                                     "slowwrite", "--local_addr", "127.0.0." + std::to_string(node + 2),
                                     "--rdzv_conf", node == 0 ? "is_host=true" : "is_host=false", "--max_restarts",
                                     "2", "--hang_timeout", "3"};
    const auto more = worker(dir.path(), {});
    argv.insert(argv.end(), more.begin(), more.end());
    fsdp::SpawnOptions options{.argv = argv, .env = env, .deathSignal = 0};
    options.stdoutPath = dir.path() + "/node" + std::to_string(node) + ".out";
    options.stderrPath = dir.path() + "/node" + std::to_string(node) + ".err";
    agents.push_back(fsdp::ChildProcess::spawn(options));
  }
  int remoteHeld = 0;
  for (int node = 0; node < 2; ++node) {
    const auto status = agents[static_cast<std::size_t>(node)].waitFor(240s);
    ASSERT_TRUE(status) << "node " << node << " did not end";
    const std::string err = readFile(dir.path() + "/node" + std::to_string(node) + ".err");
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << err;
    EXPECT_EQ(err.find("the job is hung"), std::string::npos) << "node " << node << ":\n" << err;
    // The node without rank 1 held back for a rank of the other node.
    const std::string other = "127.0.0." + std::to_string(node == 0 ? 3 : 2);
    if (err.find("rank 1 on " + other + " has been inside its own checkpoint write for") != std::string::npos) {
      ++remoteHeld;
    }
  }
  EXPECT_EQ(remoteHeld, 1) << readFile(dir.path() + "/node0.err") << "\n----\n" << readFile(dir.path() + "/node1.err");
  // 4 ranks: their own result, the same whether or not the write was slow; never restarted.
  std::string out = readFile(dir.path() + "/node0.out") + readFile(dir.path() + "/node1.out");
  EXPECT_NE(out.find("\"attempt\": 0"), std::string::npos) << out;
}

}  // namespace
}  // namespace checkpoint_hang
