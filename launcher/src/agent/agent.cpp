// The elastic agent's rounds (agent_state.hpp): the workers' lifecycle in a round, stop
// signals, restarts, and runAgent, its entry point. The rendezvous side is agent_rendezvous.cpp.
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "agent_state.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/flight_ring.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/shm.hpp"

namespace fsdp::launcher {
namespace detail {
namespace {

// How long after a round's workers start its standbys do (--standby).
constexpr std::chrono::seconds kStandbyDelay{3};

}  // namespace

using namespace std::chrono_literals;
using rendezvous::EventKind;

void Agent::startStandby(const Assignment& a, const std::string& runDir, const detail::OutputOptions& output) {
  // As the restart after this round would be if the group restarts as it is: the same ranks,
  // the next restart count (the round and the store are handed over when it comes).
  Assignment next = a;
  next.restartCount = a.restartCount + 1;
  const std::string attemptDir = runDir + "/attempt_" + std::to_string(next.restartCount);
  try {
    standby_ = std::make_unique<detail::WorkerGroup>(workerSpecs(next, attemptDir), output, attemptDir, guardian_,
                                                     /*standby=*/true, reformMode());
  } catch (const Error& e) {
    log::warn("--standby: cannot start the standby workers ({}); a restart starts new ones", e.what());
  }
}

void Agent::noteSpareExits() {
  if (!standby_) return;
  for (const auto& line : standby_->exitedSpares()) {
    log::warn("--standby: the spare of {}; a restart starts a new process instead", line);
  }
}

std::vector<detail::WorkerSpec> Agent::workerSpecs(const Assignment& a, const std::string& attemptDir) {
  std::vector<detail::WorkerSpec> specs;
  for (int local = 0; local < options_.nprocPerNode; ++local) {
    const WorkerIdentity id{.localRank = local,
                            .rank = a.rankOffset + local,
                            .worldSize = a.worldSize,
                            .localWorldSize = options_.nprocPerNode,
                            .groupRank = a.nodeRank,
                            .groupWorldSize = a.nnodes,
                            .restartCount = a.restartCount,
                            .round = a.round};
    WorkerContact contact{.masterAddr = a.masterAddr,
                          .masterPort = a.masterPort,
                          .agentStore = a.pytorchStore,
                          .storeHost = proxy_ ? std::string("127.0.0.1") : storeHost_,
                          .storePort = proxy_ ? int{proxy_->port()} : storePort_,
                          .localAddress = address_,
                          .tokenFile = tokenFile_,
                          .errorFile = attemptDir + "/" + std::to_string(local) + "/error.json",
                          .node = node_};
    if (keeper_) {
      contact.snapshotSocket = keeper_->socketName();
      contact.snapshotPeer = keeper_->peerEndpoint();
    }
    if (a.pytorchStore) {
      contact.masterAddr = storeHost_;
      contact.masterPort = storePort_;
    }
    // A membership-change round reuses the attempt's directory: no stale error file.
    std::error_code ec;
    std::filesystem::remove(contact.errorFile, ec);
    specs.push_back({local, id.rank, command_, workerEnvironment(options_, id, contact, base_)});
    if (static_cast<std::size_t>(local) < bindings_.size()) {
      specs.back().cpus = bindings_[static_cast<std::size_t>(local)].cpus;
      specs.back().memNodes = bindings_[static_cast<std::size_t>(local)].memNodes;
    }
  }
  return specs;
}

std::optional<AgentResult> Agent::runRound(const Assignment& a) {
  restarts_ = a.restartCount;
  last_ = a;
  successors_ = a.successors;
  failoverWait_.reset();  // a round formed: the failover is over
  failoverWaitedFor_.clear();
  const std::string runDir = options_.logDir.empty()
                                 ? scratch_.path() + "/" + options_.rdzvId
                                 : options_.logDir + "/" + options_.rdzvId;
  const std::string attemptDir = runDir + "/attempt_" + std::to_string(a.restartCount);
  log::info("round {}: node rank {} of {}, ranks {}-{} of {}", a.round, a.nodeRank, a.nnodes,
             a.rankOffset, a.rankOffset + options_.nprocPerNode - 1, a.worldSize);
  const detail::OutputOptions output{.redirects = options_.redirects,
                                     .tee = options_.tee,
                                     .localRanksFilter = options_.localRanksFilter};
  auto specs = workerSpecs(a, attemptDir);
  std::unique_ptr<detail::WorkerGroup> standing;
  // Before the kept workers get the round: a ring attached earlier has not re-formed into it.
  const std::int64_t roundStartNs = flight::nowNs();
  const std::size_t keptNow = kept_ ? keptRanks_.size() : 0;
  if (kept_) standing = reformKept(a, specs, attemptDir);
  if (metrics_ && a.restartCount > 0) {
    metrics_->recovered("process", static_cast<int>(specs.size() - (standing ? std::min(keptNow, specs.size()) : 0)));
  }
  if (standing) {
    standby_.reset();  // the survivors are the round's workers: no spares needed for it
  } else if (standby_) {
    noteSpareExits();
    std::string why;
    if (standby_->activate(specs, why)) {
      standing = std::move(standby_);
      log::info("round {}: the standby workers take over", a.round);
    } else {
      log::info("round {}: the standby workers do not fit it ({}): starting new ones", a.round, why);
    }
    standby_.reset();
  }
  if (!standing) {
    standing = std::make_unique<detail::WorkerGroup>(std::move(specs), output, attemptDir, guardian_, /*standby=*/false,
                                                     reformMode());
  }
  detail::WorkerGroup& group = *standing;
  auto watchdog = detail::startHangWatchdog(options_, a, group,
                                            {node_, storeHost_, storePort_, options_.rdzvId, token_}, roundStartNs);
  int failedWorkers = 0;
  if (metrics_) {
    metrics_->setNode(node_);
    metrics_->setKeeper(keeper_.get());
    serving(server_.get());
    metrics_->roundStarted(a.round, a.nodeRank, a.worldSize, a.restartCount, group.watched(),
                           watchdog ? "watching" : "off");
  }
  // The spares for the next restart start once this round's workers are past their own start-up
  // (they would compete with it for the CPUs).
  auto standbyAt = options_.standby && a.restartCount < options_.maxRestarts ? Clock::now() + kStandbyDelay
                                                                              : Clock::time_point::max();

  enum class State { kRunning, kSucceeded, kStopping } state = State::kRunning;
  std::optional<Verdict> verdict;
  std::optional<int> stopSignal;
  auto killAt = Clock::time_point::max();
  // --restart_mode auto: the local ranks that survive this round's end in process (not stopped).
  std::set<int> keep;
  // Signals the workers once; the shutdown timeout starts with the first stop.
  const auto stopGroup = [&](int sig) {
    group.signalAll(sig, keep);
    if (sig != SIGTERM || stopSignal) standby_.reset();  // a stop of the job: no restart to wait for
    if (state == State::kStopping) return;
    state = State::kStopping;
    killAt = Clock::now() + options_.shutdownTimeout;
    if (watchdog) watchdog->requestStop();  // its thread ends while the workers do
  };

  for (;;) {
    std::vector<pollfd> fds;
    group.addPollFds(fds);
    if (watchdog) fds.push_back({watchdog->fd(), POLLIN, 0});
    waitForActivity(fds, std::min(killAt, standbyAt));
    group.pump(fds);
    if (Clock::now() >= standbyAt) {
      standbyAt = Clock::time_point::max();
      if (state == State::kRunning) startStandby(a, runDir, output);
    }

    for (int sig : signals_.take()) {
      if (sig == SIGCHLD) continue;
      if (isStopSignal(sig)) {
        if (stopSignal) {
          group.signalAll(SIGKILL);  // a second stop signal: no more waiting
        } else {
          log::warn("received {}: stopping the workers", signalName(sig));
          stopSignal = sig;
          keep.clear();  // the job stops: every worker
          stopGroup(sig);
        }
      } else {
        group.signalAll(sig);  // e.g. SIGUSR1 from Slurm before the time limit
      }
    }

    noteSpareExits();
    for (const auto& exit : group.reap()) {
      if (exit.status != 0) ++failedWorkers;
      if (keep.erase(exit.localRank) > 0) {
        log::warn("rank {} (pid {}) exited ({}) instead of re-forming in process: it starts again as a process",
                  exit.rank, exit.pid, describeWaitStatus(exit.status));
      }
      if (state != State::kRunning || exit.status == 0) continue;
      Failure f{.rank = exit.rank,
                .localRank = exit.localRank,
                .node = node_,
                .pid = exit.pid,
                .waitStatus = exit.status,
                .secondsAfterStart = exit.secondsAfterStart,
                .time = utcNow(),
                .restartCount = a.restartCount,
                .error = group.errorMessage(exit.localRank).value_or(""),
                .stderrTail = group.stderrTail(exit.localRank),
                // Bounded well inside the rendezvous heartbeat timeout: the loop waits on it.
                .peers = detail::inspectSurvivors(group, exit.localRank, exit.secondsAfterStart, 2s)};
      const std::string reason = "rank " + std::to_string(f.rank) + " (local_rank " +
                                 std::to_string(f.localRank) + ", pid " + std::to_string(f.pid) +
                                 ") failed: " + describeWaitStatus(f.waitStatus);
      log::warn("{}", reason);
      try {
        client_->endRound(reason, f.toJson());
      } catch (const Error& e) {
        lost_ = e.what();
      }
      keep = keepSurvivors(group, reason, {exit.localRank});
      stopGroup(SIGTERM);
    }
    if (watchdog) {
      // Taken whatever the state, so that its descriptor never stays readable.
      const auto report = watchdog->take();
      if (report && metrics_) metrics_->hangReported();
      if (report && state == State::kRunning) {
        // A worker failure: counted against --max_restarts; the stuck workers are killed.
        log::error("{}", report->text);
        const Failure f = detail::hangFailure(*report, a.restartCount, group, attemptDir, node_);
        try {
          client_->endRound("the job hung: " + report->summary, f.toJson());
        } catch (const Error& e) {
          lost_ = e.what();
        }
        // The stuck ranks are killed: nothing to wait for. The others (auto mode) re-form.
        std::set<int> stuck;
        for (const auto& w : group.watched()) {
          if (report->lagging.empty() || report->lagging.contains(w.rank)) stuck.insert(w.localRank);
        }
        keep = keepSurvivors(group, "the job hung: " + report->summary, stuck);
        stopGroup(SIGKILL);
      }
    }
    if (state == State::kRunning && group.running() == 0) {
      state = State::kSucceeded;
      if (watchdog) watchdog->requestStop();
      try {
        client_->succeeded();
      } catch (const Error& e) {
        lost_ = e.what();
      }
    }

    while (!verdict) {
      const auto event = takeEvent();
      if (!event) break;
      switch (event->kind) {
        case EventKind::kRoundEnded:
          verdict = Verdict{Verdict::kRestart, event->reason, event->failure};
          break;
        case EventKind::kRunFinished: verdict = Verdict{Verdict::kFinished, event->reason, ""}; break;
        case EventKind::kRunFailed:
          verdict = Verdict{Verdict::kFailed, event->reason, event->failure};
          break;
        case EventKind::kRunClosed:
        case EventKind::kJoinFailed:
        case EventKind::kDisconnect:
          verdict = Verdict{Verdict::kClosed, "the run was closed: " + event->reason, ""};
          break;
        case EventKind::kAssigned:
        case EventKind::kSpare: break;  // cannot happen while a member
      }
    }
    if (!verdict && lost_) {
      verdict = Verdict{Verdict::kServerLost, "lost the rendezvous server " + endpointName() + ": " + *lost_, ""};
    }
    if (verdict && state == State::kRunning) {
      // The round ended elsewhere (a worker or node lost there, a hang declared there).
      if (verdict->kind == Verdict::kRestart || verdict->kind == Verdict::kServerLost) {
        keep = keepSurvivors(group, verdict->reason, {});
      }
      stopGroup(SIGTERM);
    }

    if (Clock::now() >= killAt && group.running() > 0) {
      log::warn("{} worker(s) still running {} ms after the stop signal: sending SIGKILL",
                group.running(), options_.shutdownTimeout.count());
      group.signalAll(SIGKILL, keep);
      killAt = Clock::time_point::max();
    }
    if (group.running(keep) > 0) continue;
    if (metrics_) metrics_->roundEnded(failedWorkers);
    if (stopSignal) {
      return ended(128 + *stopSignal, "received " + signalName(*stopSignal) + ": stopped every worker");
    }
    if (!verdict) continue;  // succeeded here; waiting for the other nodes
    switch (verdict->kind) {
      case Verdict::kRestart:
        if (!verdict->failure.empty()) {
          if (auto why = stalls_.afterFailure(group)) {
            log::error("{}", *why);
            try {
              client_->closeRun(*why);
            } catch (const Error& e) {
              log::warn("could not close the run: {}", e.what());
            }
            return ended(1, *why, verdict->failure);
          }
        }
        log::warn("restarting the workers: {}", verdict->reason);
        if (!keep.empty()) {
          kept_ = std::move(standing);
          keptRanks_ = std::move(keep);
        }
        return std::nullopt;
      case Verdict::kFinished: return ended(0, verdict->reason);
      case Verdict::kFailed: return ended(1, verdict->reason, verdict->failure);
      case Verdict::kClosed: return ended(1, verdict->reason);
      case Verdict::kServerLost:
        // joinRound moves the run to a successor, or ends it when none answers.
        log::warn("{}: this node's workers are stopped", verdict->reason);
        if (!keep.empty()) {
          kept_ = std::move(standing);
          keptRanks_ = std::move(keep);
        }
        return std::nullopt;
    }
  }
}

void Agent::startMetrics() {
  if (!options_.metricsPort) return;
  metrics_ = std::make_unique<AgentMetrics>(options_.rdzvId, options_.localAddr.empty() ? hostName() : options_.localAddr);
  try {
    metricsHttp_ = std::make_unique<MetricsHttpServer>(options_.metricsAddr, *options_.metricsPort,
                                                       [m = metrics_.get()] { return m->render(); });
  } catch (const Error& e) {
    throw ConfigError("--metrics_port " + std::to_string(*options_.metricsPort) + ": " + e.what());
  }
  // Asked for a free port, the user learns which one only here.
  if (*options_.metricsPort == 0) {
    log::warn("metrics at {}", metricsHttp_->url());
  } else {
    log::info("metrics at {}", metricsHttp_->url());
  }
}

AgentResult Agent::run() {
  startMetrics();
  try {
    startRendezvous();
  } catch (const StopRequested& stop) {
    return ended(128 + stop.sig, "received " + signalName(stop.sig) +
                                     " while connecting to the rendezvous at " + endpointName());
  }
  try {
    return rounds();
  } catch (const StopRequested& stop) {  // while moving to a successor
    return ended(128 + stop.sig, "received " + signalName(stop.sig) + " while moving the rendezvous");
  }
}

AgentResult Agent::rounds() {
  for (;;) {
    auto joined = joinRound();
    if (auto* result = std::get_if<AgentResult>(&joined)) return std::move(*result);
    auto result = runRound(std::get<Assignment>(joined));
    // Every worker of the round is gone: what a worker that died before its group attached left
    // in /dev/shm goes with it (attached segments are unlinked at once).
    if (const int removed = removeShmSegments(options_.rdzvId, ::getpid()); removed > 0) {
      log::warn("removed {} shared-memory segment(s) left by this node's workers", removed);
    }
    if (result) return std::move(*result);
  }
}

}  // namespace detail

AgentResult runAgent(const LaunchOptions& options, const std::vector<std::string>& command) {
  // A busy port the user asked for is named now, not after the workers failed on it.
  if (options.masterPort && planRendezvous(options).embedded &&
      portBusy("127.0.0.1", *options.masterPort)) {
    const auto holder = portHolder(*options.masterPort);
    throw ConfigError("--master_port " + std::to_string(*options.masterPort) +
                      ": the port is in use on this host" + (holder ? " by " + *holder : "") +
                      "; leave --master_port out and fsdprun picks a free one (" +
                      std::to_string(freePort()) + " is free now)");
  }
  ::signal(SIGPIPE, SIG_IGN);  // a console that went away must not kill the agent
  detail::Agent agent(options, command);
  return agent.run();
}

}  // namespace fsdp::launcher
