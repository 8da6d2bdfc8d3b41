// Node loss under real Slurm: `sbatch --nodes=5` of the multi-node template with `--nnodes 4`
// (PET_NNODES) gives the job one spare node without any other flag. Killing node 0's agent (the
// one serving the rendezvous) moves the rendezvous to its successor; the spare takes node 0's
// place and restores its ranks from the peer copy, and the job trains to its end. Needs root and
// the Slurm packages (skips otherwise), like slurm_cluster_test.cpp; its own 5-node cluster.
#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>

#include "batch_job.hpp"
#include "slurm_cluster.hpp"

namespace fsdp::testing {
namespace {

constexpr int kNodes = 5;
constexpr int kSteps = 60;

TEST(SlurmSpareNode, KillingTheAgentOfNodeZeroLeavesTheJobToItsSuccessorAndTheSpare) {
  std::string skipReason;
  std::unique_ptr<SlurmTestCluster> cluster;
  try {
    cluster = SlurmTestCluster::start({.nodes = kNodes}, &skipReason);
  } catch (const std::exception& e) {
    FAIL() << "the test cluster did not come up: " << e.what();
  }
  if (!cluster) GTEST_SKIP() << "no Slurm test cluster here: " << skipReason;
  if (::access(binPath("fsdprun").c_str(), X_OK) != 0 || ::access(binPath("mnist").c_str(), X_OK) != 0) {
    GTEST_SKIP() << "fsdprun or mnist is not built";
  }
  const char* path = std::getenv("PATH");
  ::setenv("PATH", (std::string(FSDP_BIN_DIR) + ":" + (path ? path : "/usr/bin:/bin")).c_str(), 1);
  const char* asan = std::getenv("ASAN_OPTIONS");
  ::setenv("ASAN_OPTIONS",
           ((asan && *asan ? std::string(asan) + ":" : std::string()) + "verify_asan_link_order=0").c_str(), 1);
  // What a user exports before sbatch (sbatch passes the environment on): 4 nodes of the 5, one
  // worker each, restarts allowed (in-memory snapshots need them), Gloo between the nodes.
  ::setenv("PET_NNODES", "4", 1);
  ::setenv("PET_MAX_RESTARTS", "3", 1);
  ::setenv("FSDP_NPROC_PER_NODE", "1", 1);
  ::setenv("FSDPRUN_BACKEND", "gloo", 1);
  TempDir dir;
  const std::string output = dir.path() + "/spare-%j.out";
  BatchJob job({"--nodes=5", "--gpus-per-node=0", "--cpus-per-task=1", "--time=15"},
               sourcePath("slurm/multi_node.sbatch"),
               {"stdbuf", "-oL", binPath("mnist"), "--max_steps", std::to_string(kSteps), "--batch_size", "64",
                "--log_every", "1", "--no_eval", "--progress", "lines"},
               output);
  ::unsetenv("PET_NNODES");
  ::unsetenv("PET_MAX_RESTARTS");
  ::unsetenv("FSDP_NPROC_PER_NODE");
  ::unsetenv("FSDPRUN_BACKEND");
  const std::string out = dir.path() + "/spare-" + std::to_string(job.id()) + ".out";
  // Training runs (rank 0 prints its steps), with one agent per node and 4 workers in all.
  ASSERT_TRUE(waitForFileText(out, " step 10/", 1, 300s)) << "job " << job.id() << " did not train:\n"
                                                          << readFile(out);
  int workers = 0;
  std::vector<pid_t> agentsOfNodeZero;  // fsdprun processes on node 0
  for (int node = 1; node <= kNodes; ++node) {
    for (const pid_t pid : processesInNamespace(SlurmTestCluster::nodeNamespace(node))) {
      if (executableOf(pid) == binPath("mnist")) ++workers;
      if (node == 1 && executableOf(pid) == binPath("fsdprun")) agentsOfNodeZero.push_back(pid);
    }
  }
  EXPECT_EQ(workers, 4) << "4 of the 5 nodes train; the fifth waits as a spare";
  // Node 0's agent (it serves the rendezvous) and its guardian, a fork of it; its workers go
  // with them.
  ASSERT_FALSE(agentsOfNodeZero.empty());
  for (const pid_t pid : agentsOfNodeZero) ::kill(pid, SIGKILL);
  const auto rc = job.wait(420s);
  const std::string text = readFile(out);
  ASSERT_TRUE(rc.has_value()) << "job " << job.id() << " did not end within 420 s:\n" << text;
  nlohmann::json summary;
  for (const auto& line : lines(text)) {
    if (line.rfind("{", 0) == 0 && hasLine(line, "\"params_sha256\"")) summary = nlohmann::json::parse(line);
  }
  ASSERT_TRUE(summary.contains("steps")) << "no summary line in:\n" << text;
  std::printf("[ result   ] job exit %d: %s\n", *rc, summary.dump().c_str());
  EXPECT_EQ(summary.value("world_size", 0), 4) << text;  // the spare kept the job's size
  EXPECT_EQ(summary.value("steps", 0), kSteps) << text;
  EXPECT_EQ(summary.value("resumed_source", ""), "peer copy") << text;
  EXPECT_TRUE(hasLine(text, "waits as a spare")) << text;
  EXPECT_TRUE(hasLine(text, "serving the rendezvous of run")) << text;
  // srun reports the task it lost; every other task exited 0.
  EXPECT_TRUE(*rc == 0 || hasLine(text, "Killed") || hasLine(text, "task 0")) << "exit " << *rc << ":\n" << text;
}

}  // namespace
}  // namespace fsdp::testing
