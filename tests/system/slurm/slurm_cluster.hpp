#pragma once
// System-test helpers around the real Slurm cluster of cluster_up.sh / cluster_down.sh:
// an owner that brings it up and always down again, a scan for the processes of a node's
// network namespace, and event-driven waits (pidfd, inotify). Which processes belong to a
// job: processesWithEnvironment("SLURM_JOB_ID=<id>") from tests/support/processes.hpp.

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::testing {

// The test cluster, up from start() until destruction. Not copyable; one per process (the
// scripts use fixed names, and a machine-wide lock held by the guard lets one test cluster
// exist at a time).
//
// Teardown happens whatever happens: the destructor runs cluster_down.sh; and before the
// cluster comes up a detached guard (cluster_guard.sh) starts, which runs cluster_down.sh if
// this process dies without doing it (crash, SIGKILL by a ctest timeout).
//
// While it lives, the process environment has SLURM_CONF set and no other SLURM_* variable,
// so sbatch/srun/scancel started by the test talk to this cluster.
class SlurmTestCluster {
 public:
  struct Options {
    int nodes = 2;
    int cpusPerNode = 4;
    std::chrono::seconds upTimeout{180};
  };

  // Brings the cluster up. Returns nullptr and sets `skipReason` when it cannot run here
  // (not root, Slurm packages missing, namespaces not permitted); throws Error when it
  // should run but fails (with the scripts' output).
  static std::unique_ptr<SlurmTestCluster> start(const Options& options, std::string* skipReason);

  ~SlurmTestCluster();
  SlurmTestCluster(const SlurmTestCluster&) = delete;
  SlurmTestCluster& operator=(const SlurmTestCluster&) = delete;

  int nodes() const { return nodes_; }
  const std::string& slurmConf() const { return slurmConf_; }
  // "fsdp-n1" for node 1 (1-based, like Slurm's list).
  static std::string nodeName(int node);
  // "fsdp-slurm-n1": the network namespace of node 1, under /run/netns.
  static std::string nodeNamespace(int node);
  // Pid of the slurmd of `node`, from its pid file.
  std::optional<pid_t> slurmdPid(int node) const;

 private:
  SlurmTestCluster(int nodes, std::string conf, int guardFd)
      : nodes_(nodes), slurmConf_(std::move(conf)), guardFd_(guardFd) {}
  int nodes_;
  std::string slurmConf_;
  int guardFd_;  // write end of the guard's stdin: "disarm\n" or close (= tear down)
};

// Absolute path of a script under tests/system/slurm.
std::string slurmScript(const std::string& name);

// Processes whose network namespace is /run/netns/<ns>.
std::vector<pid_t> processesInNamespace(const std::string& ns);

// The executable path of a process ("" when it is gone).
std::string executableOf(pid_t pid);

// "1234 /usr/bin/sleep [sleep 600]" for messages.
std::string describeProcess(pid_t pid);

// Waits until every process in `pids` has exited (pidfd + poll, no sleeping), at most
// `timeout`; returns those still alive.
std::vector<pid_t> waitForExit(const std::vector<pid_t>& pids, std::chrono::milliseconds timeout);

// Waits until the file at `path` (which may not exist yet) contains `needle` at least `count`
// times, watching its directory with inotify; returns false after `timeout`.
bool waitForFileText(const std::string& path, const std::string& needle, int count,
                     std::chrono::milliseconds timeout);

}  // namespace fsdp::testing
