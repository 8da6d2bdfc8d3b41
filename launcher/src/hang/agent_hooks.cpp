// The agent's hang handling (agent_hooks.hpp).
#include "agent_hooks.hpp"

#include <ctime>
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>

#include "../agent/agent_support.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "stacks.hpp"

namespace fsdp::launcher::detail {
namespace {

// A failure this long after the worker started may be a collective's own timeout: worth the
// stacks of the others (fast failures, a crash at start-up, cost nothing extra).
constexpr double kSurvivorStacksAfterSeconds = 10;

}  // namespace

std::unique_ptr<HangWatchdog> startHangWatchdog(const LaunchOptions& options, const rendezvous::Assignment& a,
                                                const WorkerGroup& group, const StoreContact& store,
                                                std::int64_t roundStartNs) {
  if (options.hangTimeout && options.hangTimeout->count() == 0) return nullptr;  // --hang_timeout 0
  try {
    return std::make_unique<HangWatchdog>(WatchdogOptions{.timeout = options.hangTimeout,
                                                          .round = a.round,
                                                          .roundStartNs = roundStartNs,
                                                          .nodeRank = a.nodeRank,
                                                          .nnodes = a.nnodes,
                                                          .worldSize = a.worldSize,
                                                          .host = store.node,
                                                          .storeHost = store.host,
                                                          .storePort = store.port,
                                                          .runId = store.runId,
                                                          .token = store.token},
                                          group.watched());
  } catch (const std::exception& e) {  // the store unreachable, no thread to be had
    log::warn("no hang watchdog in round {}: {}", a.round, e.what());
    return nullptr;
  }
}

Failure hangFailure(const HangReport& report, int restartCount, const WorkerGroup& group,
                    const std::string& attemptDir, const std::string& node) {
  Failure f{.rank = report.firstRank,
            .node = report.firstHost.empty() ? node : report.firstHost,
            .pid = static_cast<int>(report.firstPid),
            .time = utcNow(),
            .restartCount = restartCount,
            .hang = report.text};
  for (const auto& w : group.watched()) {
    if (w.rank != report.firstRank) continue;
    f.localRank = w.localRank;
    // Where torchrun users look: the lagging rank's error file, in its format.
    const auto error = torchrunError(report.text, {{"hang", nlohmann::json::parse(report.viewsJson, nullptr, false)}},
                                     static_cast<long long>(::time(nullptr)));
    const std::string dir = attemptDir + "/" + std::to_string(w.localRank);
    // A worker kept from an earlier round (re-formed in process) has no folder of this attempt yet.
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string path = dir + "/error.json";
    std::ofstream out(path);
    out << error.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!out) log::warn("could not write the hang report to {}", path);
  }
  return f;
}

std::optional<std::string> StallCounter::afterFailure(const WorkerGroup& group) {
  std::optional<std::int64_t> step;
  for (const auto& w : group.watched()) {
    if (!w.ring) continue;
    const auto r = w.ring->read(0);
    if (!r.attached) continue;
    step = std::max(step.value_or(-1), r.progress.count > 0 ? r.progress.step : std::int64_t{-1});
  }
  if (!step) return std::nullopt;  // not a libfsdp program: no steps to count
  if (failedAtStep_ && *step <= *failedAtStep_) {
    ++stalled_;
  } else {
    stalled_ = 0;
    failedAtStep_ = step;
  }
  if (limit_ == 0 || stalled_ < limit_) return std::nullopt;
  return "giving up: " + std::to_string(stalled_) + " restarts in a row failed before completing a step past " +
         std::to_string(*failedAtStep_) + " (--max_stalled_restarts " + std::to_string(limit_) +
         "); the last failure follows";
}

std::string inspectSurvivors(const WorkerGroup& group, int failedLocalRank, double failedAfterSeconds,
                             std::chrono::milliseconds timeout) {
  if (failedAfterSeconds < kSurvivorStacksAfterSeconds) return "";
  std::vector<std::pair<WatchedWorker, std::future<ProcessInspection>>> looks;
  for (const auto& w : group.watched()) {
    // libfsdp's: the watchdog's (a Python script's ring, attached by fsdprun's module, is not).
    const bool python = w.pystacks && pythonStacksRegistered(*w.pystacks, w.pid);
    if (w.localRank == failedLocalRank || (w.ring && w.ring->read(0).attached && !python)) continue;
    looks.emplace_back(w, std::async(std::launch::async, [w, timeout] {
                         // The Python stacks first: a ptrace attach would hold the signal that asks for them.
                         const std::string py = withPythonStacks(w, "");
                         ProcessInspection seen = inspectProcess(w.pid, timeout);
                         if (!py.empty()) seen.stack = py + (seen.stack.empty() ? "" : "native:\n" + seen.stack);
                         return seen;
                       }));
  }
  std::string out;
  for (auto& [w, look] : looks) {
    const ProcessInspection seen = look.get();
    if (seen.state == '?' || seen.state == 'Z' || seen.state == 'X') continue;  // exiting too
    out += "rank " + std::to_string(w.rank) + " (local_rank " + std::to_string(w.localRank) + ", pid " +
           std::to_string(w.pid) + "): " + seen.stateName + (seen.wchan.empty() ? "" : ", waiting in " + seen.wchan) + "\n";
    out += seen.stack.empty() ? "  no stack: " + seen.stackError + "\n" : seen.stack + (seen.stack.ends_with('\n') ? "" : "\n");
  }
  return out;
}

}  // namespace fsdp::launcher::detail
