#pragma once
// The local elastic agent: serves the job's store, spawns the workers of this node with the
// torchrun environment, watches them (SIGCHLD through signalfd, no polling), restarts the
// group on failure up to --max_restarts, forwards stop signals, and reports the first failure.

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/launcher/options.hpp"

namespace fsdp::launcher {

// What happened to the job, for the exit code and the report.
struct Failure {
  int rank = -1;
  int localRank = -1;
  int pid = -1;
  int waitStatus = 0;
  double secondsAfterStart = 0;
  int attempt = 0;
};

struct AgentResult {
  int exitCode = 0;                // 0, 1 (workers failed), 128+N (signal)
  std::optional<Failure> firstFailure;
  int restarts = 0;
};

// The environment a worker gets, as "KEY=VALUE" entries (on top of the agent's own).
struct WorkerIdentity {
  int localRank = 0;
  int rank = 0;
  int worldSize = 1;
  int localWorldSize = 1;
  int groupRank = 0;
  int groupWorldSize = 1;
  int restartCount = 0;
  int round = 0;
};
std::vector<std::string> workerEnvironment(const LaunchOptions& options, const WorkerIdentity& id,
                                           const std::string& storeHost, int storePort,
                                           int masterPort, std::vector<std::string> base,
                                           const std::string& tokenFile = "");

// Runs a single-node job to completion. Blocks the signals it handles in the calling
// thread (call it from main before other threads exist).
AgentResult runStandalone(const LaunchOptions& options, const std::vector<std::string>& command);

// One line describing a failure: "rank 2 (local_rank 2, pid 123) failed: exit code 3 ...".
std::string describeFailure(const Failure& failure);

}  // namespace fsdp::launcher
