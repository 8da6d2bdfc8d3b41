// The shared-memory communicator under fsdprun, as users run it: a worker SIGKILLed in the
// middle of a collective. Its peer fails with an error naming it well within the timeout,
// fsdprun restarts the group, the restarted group works, and no segment of the job is left in
// /dev/shm.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <thread>

#include "fsdp/common/process.hpp"
#include "processes.hpp"
#include "run_command.hpp"

namespace {

using namespace std::chrono_literals;
const std::string kBin = FSDP_BIN_DIR;

// Names in /dev/shm that belong to run `runId` (our segments are "fsdprun-<run id>-...").
std::vector<std::string> segmentsOf(const std::string& runId) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const auto name = e.path().filename().string();
    if (name.rfind("fsdprun-" + runId + "-", 0) == 0) names.push_back(name);
  }
  return names;
}

bool waitForFile(const std::string& path, std::chrono::milliseconds within) {
  const auto until = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < until) {
    if (std::filesystem::exists(path)) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

TEST(SharedMemory, AWorkerKilledMidCollectiveIsNamedByItsPeerTheRestartWorksAndNothingIsLeft) {
  fsdp::testing::TempDir dir;
  const std::string runId = "shmkill" + std::to_string(::getpid());
  fsdp::SpawnOptions options{.argv = {kBin + "/fsdprun", "--standalone", "--nproc_per_node", "2", "--max_restarts",
                                      "1", "--rdzv_id", runId, kBin + "/shm_kill_worker", dir.path()},
                             .env = fsdp::currentEnvironment(),
                             .deathSignal = 0};
  options.stdoutPath = dir.path() + "/out";
  options.stderrPath = dir.path() + "/err";
  auto launcher = fsdp::ChildProcess::spawn(options);
  const auto pids = fsdp::testing::waitForPidFiles(dir.path(), {"0", "1"}, 60s);
  ASSERT_EQ(pids.size(), 2u) << fsdp::testing::readFile(dir.path() + "/err");
  ASSERT_TRUE(waitForFile(dir.path() + "/1.looping", 60s));
  EXPECT_TRUE(segmentsOf(runId).empty()) << "attached segments are unlinked at once";
  ::kill(pids[1], SIGKILL);
  // The worker's timeout is 60 s; the death must be noticed before it (by pid, every 100 ms).
  EXPECT_TRUE(fsdp::testing::processGone(pids[0], 55s)) << "rank 0 did not fail on its own";
  const auto status = launcher.waitFor(120s);
  ASSERT_TRUE(status.has_value()) << "fsdprun did not finish";
  const std::string out = fsdp::testing::readFile(dir.path() + "/out");
  const std::string err = fsdp::testing::readFile(dir.path() + "/err");
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << fsdp::describeWaitStatus(*status) << "\n" << err;
  // Rank 0 (deaf to fsdprun's SIGTERM) named its dead peer itself.
  const std::string error0 = fsdp::testing::readFile(dir.path() + "/error.0");
  EXPECT_NE(error0.find("rank 1 (pid " + std::to_string(pids[1]) + ") exited during the operation"),
            std::string::npos)
      << error0 << err;
  EXPECT_NE(out.find("restart ok rank 0 backend shared memory"), std::string::npos) << out << err;
  EXPECT_NE(out.find("restart ok rank 1 backend shared memory"), std::string::npos) << out << err;
  EXPECT_TRUE(segmentsOf(runId).empty());
}

}  // namespace
