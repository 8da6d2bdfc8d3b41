// The GPU path up to the GPU boundary, on loopback with the real launcher and real NCCL where
// NCCL needs no device: rank 0's ncclGetUniqueId reaches every rank through our store under
// the round, and a restarted group gets a new id; fsdp::init()'s backend choice, asked for
// what this machine cannot give, is one clear error on every rank.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "run_command.hpp"

namespace {

using fsdp::testing::runCommand;
using fsdp::testing::TempDir;
using namespace std::chrono_literals;

const std::string kBin = FSDP_BIN_DIR;
const std::string kFsdprun = kBin + "/fsdprun";

// A machine with an NVIDIA GPU (its device nodes): there NCCL can be had, and auto may pick it.
bool gpuVisible() { return std::filesystem::exists("/dev/nvidiactl") || std::filesystem::exists("/dev/nvidia0"); }

// Two ranks under fsdprun that only call fsdp::init() with `variable` ("KEY=VALUE") set.
fsdp::testing::RunResult initOnly(const std::string& variable) {
  return runCommand({kFsdprun, "--standalone", "--nproc_per_node", "2", kBin + "/nccl_id_worker", "--init_only"},
                    120s, {variable});
}

std::string firstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

TEST(NcclUniqueId, FourProcessesShareRankZerosIdAndARestartGetsANewOne) {
  if (!FSDP_HAVE_NCCL) GTEST_SKIP() << "this build has no NCCL (sanitizer build, or no /usr/local/cuda)";
  TempDir dir;
  const auto r = runCommand({kFsdprun, "--standalone", "--nproc_per_node", "4", "--max_restarts", "1",
                             kBin + "/nccl_id_worker", dir.path(), "--fail_rank", "3"},
                            180s);
  ASSERT_FALSE(r.timedOut) << r.out << r.err;
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  // round -> rank -> the id in hex
  std::map<int, std::map<int, std::string>> ids;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    int round = -1, rank = -1;
    ASSERT_EQ(std::sscanf(entry.path().filename().c_str(), "round%d.rank%d", &round, &rank), 2)
        << entry.path();
    ids[round][rank] = firstLine(entry.path());
  }
  ASSERT_EQ(ids.size(), 2u) << "one round, then the restarted one\n" << r.err;
  std::set<std::string> perRound;
  for (const auto& [round, ranks] : ids) {
    ASSERT_EQ(ranks.size(), 4u) << "round " << round;
    const std::string& rankZero = ranks.at(0);
    EXPECT_EQ(rankZero.size(), 256u) << "128 bytes in hex: " << rankZero;
    EXPECT_NE(rankZero, std::string(256, '0'));
    for (const auto& [rank, id] : ranks) EXPECT_EQ(id, rankZero) << "round " << round << " rank " << rank;
    perRound.insert(rankZero);
  }
  EXPECT_EQ(perRound.size(), 2u) << "the restarted round must not reuse the previous round's id";
  EXPECT_NE(r.err.find("rank 3 fails on purpose"), std::string::npos) << r.err;
}

// Every rank fails on its own with the one line the backend choice gives (exit 2: a usage
// error), and fsdprun names the failing rank.
TEST(Backend, NcclAskedForOnAMachineWithoutItFailsEveryRankNamingIt) {
  if (gpuVisible()) GTEST_SKIP() << "this machine has a GPU: NCCL can be had";
  const auto r = initOnly("FSDPRUN_BACKEND=nccl");
  ASSERT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("FSDPRUN_BACKEND=nccl: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exit code 2"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("backend"), std::string::npos) << r.out;
}

TEST(Backend, AValueThatIsNoBackendIsNamedWithTheChoices) {
  const auto r = initOnly("FSDPRUN_BACKEND=mpi");
  ASSERT_FALSE(r.timedOut) << r.err;
  EXPECT_EQ(r.exitCode, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("FSDPRUN_BACKEND='mpi': expected gloo, shm, nccl or auto"), std::string::npos) << r.err;
}

TEST(Backend, ABadSharedMemorySlotSizeIsNamedNotFallenBackFrom) {
  for (const std::string value : {"1", "lots"}) {
    const auto r = initOnly("FSDPRUN_SHM_SLOT_KB=" + value);
    ASSERT_FALSE(r.timedOut) << r.err;
    EXPECT_EQ(r.exitCode, 1) << r.out << r.err;
    EXPECT_NE(r.err.find("FSDPRUN_SHM_SLOT_KB"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("backend"), std::string::npos) << r.out;
  }
}

TEST(Backend, OnCpuAutoSharesMemoryAndGlooForcesGlooWithTheCpuGroupBeingTheSame) {
  // With a GPU, auto would pick NCCL for two ranks on one device (refused, as it must be).
  std::vector<std::pair<std::string, std::string>> cases = {{"gloo", "Gloo"}, {"shm", "shared memory"}};
  if (!gpuVisible()) cases.insert(cases.end(), {{"auto", "shared memory"}, {"", "shared memory"}});
  for (const auto& [value, backend] : cases) {
    const auto r = initOnly("FSDPRUN_BACKEND=" + value);
    ASSERT_FALSE(r.timedOut) << r.err;
    EXPECT_EQ(r.exitCode, 0) << value << ": " << r.out << r.err;
    EXPECT_NE(r.out.find("rank 1 backend " + backend + " on cpu, cpu group " + backend), std::string::npos)
        << value << ": " << r.out;
  }
}

// The one command for a GPU machine says in one line, here, that it has nothing to run on.
TEST(GpuCheck, WithoutAGpuItFailsWithOneLineAndRunsNothing) {
  if (gpuVisible()) GTEST_SKIP() << "this machine has a GPU: scripts/gpu-check would build and run";
  const auto r = runCommand({std::string(FSDP_SOURCE_DIR) + "/scripts/gpu-check"}, 60s,
                            {"GPU_BUILD_DIR=/nonexistent-must-not-be-created"});
  ASSERT_FALSE(r.timedOut);
  EXPECT_EQ(r.exitCode, 1) << r.err;
  EXPECT_EQ(r.err, "gpu-check: no NVIDIA GPU on this machine (nvidia-smi is missing or lists no GPU); "
                   "nothing was run (--build-only checks up to the GPU boundary)\n");
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(std::filesystem::exists("/nonexistent-must-not-be-created"));
  const auto bad = runCommand({std::string(FSDP_SOURCE_DIR) + "/scripts/gpu-check", "--steps", "0"}, 60s);
  EXPECT_EQ(bad.exitCode, 2) << bad.err;
  EXPECT_EQ(bad.err, "gpu-check: --steps '0': expected a positive number\n");
}

}  // namespace
