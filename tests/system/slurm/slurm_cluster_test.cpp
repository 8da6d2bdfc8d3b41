// System tests on a real Slurm 22.05 cluster: 2 nodes, each in its own network and UTS
// namespace (tests/system/slurm/cluster_up.sh). Needs root and the Debian packages slurmctld,
// slurmd, slurm-client and munge; skips with the reason otherwise. The cluster comes up in
// SetUpTestSuite and goes down in TearDownTestSuite, or by its guard if this process dies.
//
// Every wait is bounded and event driven: sbatch --wait (Slurm's own poll of the job) watched
// through a pidfd, inotify on job output files, pidfds for leftover processes.
#include "slurm_cluster.hpp"
#include "batch_job.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/common/env.hpp"
#include "line_reader.hpp"
#include "processes.hpp"
#include "run_command.hpp"

namespace fsdp::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kNodes = 2;

class SlurmCluster : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto t0 = Clock::now();
    try {
      cluster_ = SlurmTestCluster::start({.nodes = kNodes}, &skipReason_);
    } catch (const std::exception& e) {
      failure_ = e.what();
      return;
    }
    if (!cluster_) return;
    // The templates call `fsdprun`: the jobs inherit this PATH (sbatch exports our environment).
    const char* path = std::getenv("PATH");
    ::setenv("PATH", (std::string(FSDP_BIN_DIR) + ":" + (path ? path : "/usr/bin:/bin")).c_str(),
             1);
    // Sanitizer builds: slurmstepd starts tasks with its own libraries loaded ahead of the
    // program's, which ASan refuses by default; its checks work the same without that one.
    const char* asan = std::getenv("ASAN_OPTIONS");
    ::setenv("ASAN_OPTIONS",
             ((asan && *asan ? std::string(asan) + ":" : std::string()) + "verify_asan_link_order=0").c_str(), 1);
    std::printf("[ cluster  ] %d nodes up in %.2f s (SLURM_CONF=%s)\n", kNodes, secondsSince(t0),
                cluster_->slurmConf().c_str());
  }

  static void TearDownTestSuite() {
    const auto t0 = Clock::now();
    const bool wasUp = cluster_ != nullptr;
    cluster_.reset();
    if (wasUp) std::printf("[ cluster  ] down in %.2f s\n", secondsSince(t0));
  }

  void SetUp() override {
    if (!failure_.empty()) FAIL() << "the test cluster did not come up: " << failure_;
    if (!cluster_) GTEST_SKIP() << "no Slurm test cluster here: " << skipReason_;
    dir_ = std::make_unique<TempDir>();
  }

  std::string file(const std::string& name) const { return dir_->path() + "/" + name; }

  std::string writeScript(const std::string& name, const std::string& body) const {
    const std::string path = file(name);
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) throw std::runtime_error("cannot write " + path);
    std::fputs(body.c_str(), f);
    std::fclose(f);
    return path;
  }

  // Skips when the binaries the templates run are not built.
  static std::optional<std::string> binariesMissing() {
    if (::access(binPath("fsdprun").c_str(), X_OK) != 0 ||
        ::access(binPath("mnist").c_str(), X_OK) != 0) {
      return "no " + binPath("fsdprun") + " or " + binPath("mnist") + " (not built)";
    }
    return std::nullopt;
  }

  // Processes in the nodes' namespaces other than their slurmd.
  std::vector<pid_t> processesOnNodes() const {
    std::vector<pid_t> out;
    for (int node = 1; node <= kNodes; ++node) {
      const auto slurmd = cluster_->slurmdPid(node);
      for (const pid_t pid : processesInNamespace(SlurmTestCluster::nodeNamespace(node))) {
        if (!slurmd || pid != *slurmd) out.push_back(pid);
      }
    }
    return out;
  }

  // Processes of `node`'s namespace running `exe`.
  static int countOnNode(int node, const std::string& exe) {
    int n = 0;
    for (const pid_t pid : processesInNamespace(SlurmTestCluster::nodeNamespace(node))) {
      if (executableOf(pid) == exe) ++n;
    }
    return n;
  }

  // After the job ended: everything it started must be gone from every node, at once or within
  // a few seconds (slurmstepd finishing). Returns the descriptions of what is left.
  std::vector<std::string> leftoversOf(long long jobId) const {
    std::vector<pid_t> suspects = processesOnNodes();
    for (const pid_t pid : jobProcesses(jobId)) suspects.push_back(pid);
    std::vector<std::string> out;
    for (const pid_t pid : waitForExit(suspects, 20s)) out.push_back(describeProcess(pid));
    return out;
  }

  static inline std::unique_ptr<SlurmTestCluster> cluster_;
  static inline std::string skipReason_;
  static inline std::string failure_;
  std::unique_ptr<TempDir> dir_;
};

std::string joinLines(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += "\n  " + s;
  return out;
}

TEST_F(SlurmCluster, EveryNodeRunsAStepUnderItsOwnNameAndReachesTheHeadNode) {
  const auto t0 = Clock::now();
  const auto r =
      runCommand({"srun", "--nodes=2", binPath("slurm_env_probe"), "--check", "--exchange"}, 90s);
  std::printf("[ timing   ] srun of the probe on 2 nodes: %.2f s\n", secondsSince(t0));
  ASSERT_EQ(r.exitCode, 0) << r.out << r.err;
  const std::string& out = r.out;
  for (const char* expected : {
           "fsdp-n1 nodes: fsdp-n[1-2] (SLURM_STEP_NODELIST)",
           "fsdp-n1 head_node: fsdp-n1 (first host of SLURM_STEP_NODELIST)",
           "fsdp-n1 nnodes: 2 (SLURM_STEP_NUM_NODES)",
           "fsdp-n1 node_id: 0 (SLURM_NODEID)",
           "fsdp-n2 node_id: 1 (SLURM_NODEID)",
           "fsdp-n1 tasks_on_node: 1 (SLURM_STEP_TASKS_PER_NODE)",
           "fsdp-n1 check: ok",
           "fsdp-n2 check: ok",
           "fsdp-n1 head_address: 10.233.0.11",
           "fsdp-n2 head_address: 10.233.0.11",
           "fsdp-n1 exchange: got 'hello fsdp-n2'",
           "fsdp-n2 exchange: welcome fsdp-n2 from fsdp-n1",
       }) {
    EXPECT_TRUE(hasLine(out, expected)) << "missing '" << expected << "' in:\n" << out << r.err;
  }
  // Both nodes derived the same rendezvous id and port.
  std::map<std::string, std::string> ports;
  for (const auto& line : lines(out)) {
    if (line.find(" rdzv_port: ") != std::string::npos) {
      ports[line.substr(0, line.find(' '))] = line.substr(line.find(':') + 2);
    }
  }
  ASSERT_EQ(ports.size(), 2u) << out;
  EXPECT_EQ(ports["fsdp-n1"], ports["fsdp-n2"]);
}

TEST_F(SlurmCluster, ReadSlurmJobMatchesWhatSlurmSetsInBatchScriptsAndSteps) {
  const std::string probe = binPath("slurm_env_probe");
  const std::string script = writeScript("probe.sbatch",
                                         "#!/bin/bash\n"
                                         "echo '== batch'\n" +
                                             probe +
                                             " --check\n"
                                             "echo '== step on the second node only'\n"
                                             "srun --nodes=1 --ntasks=1 --nodelist=fsdp-n2 " +
                                             probe +
                                             "\n"
                                             "echo '== step with two tasks per node'\n"
                                             "srun " +
                                             probe +
                                             " --check\n"
                                             "echo '== end'\n");
  BatchJob job({"--nodes=2", "--ntasks-per-node=2"}, script, {}, file("probe-%j.out"));
  const auto rc = job.wait(120s);
  const std::string out = readFile(file("probe-" + std::to_string(job.id()) + ".out"));
  ASSERT_TRUE(rc) << "job " << job.id() << " did not end within 120 s:\n" << out;
  const std::string id = std::to_string(job.id());
  for (const std::string& expected : {
           // The batch script: the job's variables, and fsdprun refuses to run there alone.
           "fsdp-n1 rdzv_id: " + id + " (SLURM_JOB_ID)",
           std::string("fsdp-n1 nodes: fsdp-n[1-2] (SLURM_JOB_NODELIST)"),
           std::string("fsdp-n1 nnodes: 2 (SLURM_NNODES)"),
           "fsdp-n1 check: fsdprun runs outside srun in Slurm job " + id + ", which has 2 nodes",
           // A step on part of the job: its own node list, and SLURM_NODEID relative to it.
           "fsdp-n2 rdzv_id: " + id + ".0 (SLURM_JOB_ID.SLURM_STEP_ID)",
           std::string("fsdp-n2 head_node: fsdp-n2 (first host of SLURM_STEP_NODELIST)"),
           std::string("fsdp-n2 nnodes: 1 (SLURM_STEP_NUM_NODES)"),
           std::string("fsdp-n2 node_id: 0 (SLURM_NODEID)"),
           // Two tasks per node: the sanity check explains the fix on both nodes.
           "fsdp-n1 rdzv_id: " + id + ".1 (SLURM_JOB_ID.SLURM_STEP_ID)",
           std::string("fsdp-n1 check: SLURM_STEP_TASKS_PER_NODE says srun started 2 fsdprun "
                       "tasks on fsdp-n1: fsdprun starts the workers of a node itself and must "
                       "run once per node; use `srun --ntasks-per-node=1 fsdprun "
                       "--nproc_per_node 2 ...`"),
           std::string("fsdp-n2 check: SLURM_STEP_TASKS_PER_NODE says srun started 2 fsdprun "
                       "tasks on fsdp-n2"),
       }) {
    EXPECT_TRUE(hasLine(out, expected)) << "missing '" << expected << "' in:\n" << out;
  }
  EXPECT_EQ(countOccurrences(out, " check: SLURM_STEP_TASKS_PER_NODE says srun started 2"), 4)
      << out;
}

TEST_F(SlurmCluster, ScancelLeavesNoProcessOfAJobOnAnyNode) {
  // Each task starts a child in a session of its own and one in its process group, like an
  // agent starting workers.
  const std::string script = writeScript(
      "long.sbatch",
      "#!/bin/bash\n"
      "srun bash -c 'setsid sleep 600 & sleep 600 & echo \"started $(hostname)\"; wait'\n");
  BatchJob job({"--nodes=2", "--job-name=long"}, script, {}, file("long-%j.out"));
  const std::string output = file("long-" + std::to_string(job.id()) + ".out");
  ASSERT_TRUE(waitForFileText(output, "started", kNodes, 60s))
      << "job " << job.id() << " did not start on both nodes within 60 s:\n"
      << readFile(output);
  // At least slurmstepd, the task and its two children on each node (the children were forked
  // before the echo, but may not have exec'd sleep yet).
  for (int node = 1; node <= kNodes; ++node) {
    const auto slurmd = cluster_->slurmdPid(node);
    const auto pids = processesInNamespace(SlurmTestCluster::nodeNamespace(node));
    EXPECT_GE(pids.size() - (slurmd ? 1 : 0), 4u) << SlurmTestCluster::nodeName(node);
  }
  EXPECT_FALSE(jobProcesses(job.id()).empty());

  const auto t0 = Clock::now();
  ASSERT_EQ(runCommand({"scancel", std::to_string(job.id())}, 30s).exitCode, 0);
  ASSERT_TRUE(job.wait(60s)) << "job " << job.id() << " did not end within 60 s of scancel";
  const auto left = leftoversOf(job.id());
  std::printf("[ timing   ] scancel to no process left: %.2f s\n", secondsSince(t0));
  EXPECT_TRUE(left.empty()) << "left after scancel of job " << job.id() << ":" << joinLines(left);
}

TEST_F(SlurmCluster, TheLeftoverCheckSeesAProcessThatEscapedItsJob) {
  // A double fork with its own stdio escapes proctrack/linuxproc: scancel cannot find it. The
  // check of the test above must see it (and this test removes it again).
  const std::string script =
      writeScript("escape.sbatch",
                  "#!/bin/bash\n"
                  "srun bash -c 'setsid -f sleep 600 </dev/null >/dev/null 2>&1; "
                  "echo \"started $(hostname)\"; sleep 600'\n");
  BatchJob job({"--nodes=2", "--job-name=escape"}, script, {}, file("escape-%j.out"));
  const std::string output = file("escape-" + std::to_string(job.id()) + ".out");
  ASSERT_TRUE(waitForFileText(output, "started", kNodes, 60s)) << readFile(output);
  ASSERT_EQ(runCommand({"scancel", std::to_string(job.id())}, 30s).exitCode, 0);
  ASSERT_TRUE(job.wait(60s));
  const auto escaped = jobProcesses(job.id());
  EXPECT_EQ(escaped.size(), static_cast<std::size_t>(kNodes));
  for (const pid_t pid : escaped) {
    EXPECT_EQ(executableOf(pid), "/usr/bin/sleep") << describeProcess(pid);
    ::kill(pid, SIGKILL);
  }
  EXPECT_TRUE(waitForExit(escaped, 10s).empty());
}

TEST_F(SlurmCluster, MultiNodeTemplateTrainsMnistWithTwoCpuWorkersPerNode) {
  if (const auto why = binariesMissing()) GTEST_SKIP() << *why;
  const auto t0 = Clock::now();
  BatchJob job({"--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", "--time=15"},
               sourcePath("slurm/multi_node.sbatch"),
               {binPath("mnist"), "--max_steps", "20", "--batch_size", "64"}, file("mnist-%j.out"));
  const auto rc = job.wait(480s);
  const std::string out = readFile(file("mnist-" + std::to_string(job.id()) + ".out"));
  std::printf("[ timing   ] multi_node.sbatch, mnist 20 steps on 2x2 workers: %.1f s\n",
              secondsSince(t0));
  ASSERT_TRUE(rc) << "job " << job.id() << " did not end within 480 s:\n" << out;
  ASSERT_EQ(*rc, 0) << out;
  nlohmann::json summary;
  for (const auto& line : lines(out)) {
    if (line.rfind("{", 0) == 0 && hasLine(line, "\"test_accuracy\"")) {
      summary = nlohmann::json::parse(line);
    }
  }
  ASSERT_TRUE(summary.contains("test_accuracy")) << "no summary line in:\n" << out;
  std::printf("[ result   ] %s\n", summary.dump().c_str());
  EXPECT_EQ(summary.value("world_size", 0), 4) << out;
  EXPECT_EQ(summary.value("steps", 0), 20) << out;
  EXPECT_GT(summary["test_accuracy"].get<double>(), 0.3) << out;  // 10 classes: chance is 0.1
}

TEST_F(SlurmCluster, ScancelOfTheMultiNodeTemplateLeavesNoWorkerOnAnyNode) {
  if (const auto why = binariesMissing()) GTEST_SKIP() << *why;
  // stdbuf: the workers' step lines reach the output file as they are printed.
  BatchJob job({"--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", "--time=15"},
               sourcePath("slurm/multi_node.sbatch"),
               {"stdbuf", "-oL", binPath("mnist"), "--max_steps", "1000000", "--batch_size", "64",
                "--log_every", "1", "--no_eval"},
               file("mnist-long-%j.out"));
  const std::string output = file("mnist-long-" + std::to_string(job.id()) + ".out");
  ASSERT_TRUE(waitForFileText(output, " step 2/", 1, 240s))
      << "job " << job.id() << " did not train within 240 s:\n"
      << readFile(output);
  for (int node = 1; node <= kNodes; ++node) {
    EXPECT_EQ(countOnNode(node, binPath("mnist")), 2) << SlurmTestCluster::nodeName(node);
  }

  const auto t0 = Clock::now();
  ASSERT_EQ(runCommand({"scancel", std::to_string(job.id())}, 30s).exitCode, 0);
  ASSERT_TRUE(job.wait(90s)) << "job " << job.id() << " did not end within 90 s of scancel";
  const auto left = leftoversOf(job.id());
  std::printf("[ timing   ] scancel of a training job to no process left: %.2f s\n",
              secondsSince(t0));
  EXPECT_TRUE(left.empty()) << "left after scancel of job " << job.id() << ":" << joinLines(left);
}

}  // namespace
}  // namespace fsdp::testing
