#pragma once
// What the agent does about hangs, as functions of its state: start a round's watchdog, turn a
// hang report into the round's failure (and the lagging rank's error file), count restarts
// that never get past the failing step, and take the stacks of the workers still running when
// a program without flight records fails. Private to the launcher.

#include <memory>
#include <optional>
#include <string>

#include "../workers/worker_group.hpp"
#include "fsdp/launcher/agent.hpp"
#include "fsdp/rendezvous/round.hpp"
#include "watchdog.hpp"

namespace fsdp::launcher::detail {

// Where this node's agent reaches the store, for the watchdog's exchanges.
struct StoreContact {
  std::string node;
  std::string host;
  int port = 0;
  std::string runId;
  std::string token;
};

// nullptr with --hang_timeout 0, or (after a warning) when the store cannot be reached.
// `roundStartNs`: when the agent began the round (WatchdogOptions::roundStartNs).
std::unique_ptr<HangWatchdog> startHangWatchdog(const LaunchOptions& options, const rendezvous::Assignment& a,
                                                const WorkerGroup& group, const StoreContact& store,
                                                std::int64_t roundStartNs);

// The failure a hang makes: the first lagging rank, the report. Writes the report into that
// rank's error file (attemptDir/<local_rank>/error.json, torchrun's format) when it is local.
Failure hangFailure(const HangReport& report, int restartCount, const WorkerGroup& group,
                    const std::string& attemptDir, const std::string& node);

// --max_stalled_restarts: fed each failed round, says when to give up.
class StallCounter {
 public:
  explicit StallCounter(int limit) : limit_(limit) {}
  // After a failed round of `group`: the one line to give up with, or nullopt. A program
  // without flight records (no steps to count) never gives up here.
  std::optional<std::string> afterFailure(const WorkerGroup& group);

 private:
  int limit_;
  std::optional<std::int64_t> failedAtStep_;  // the newest step any local rank had marked
  int stalled_ = 0;                           // failures in a row without a newer one
};

// When a worker of a program without flight records (a PyTorch script) fails after running a
// while (its collective timed out, typically), what the node's other workers that still run are
// doing: state and stacks, taken in parallel within `timeout`. "" when there is nothing to say.
std::string inspectSurvivors(const WorkerGroup& group, int failedLocalRank, double failedAfterSeconds,
                             std::chrono::milliseconds timeout);

}  // namespace fsdp::launcher::detail
