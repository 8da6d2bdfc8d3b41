// The elastic agent's state machine: rendezvous, rounds, the workers' lifecycle and stop
// signals (class Agent), and runAgent, its entry point.
#include "fsdp/launcher/agent.hpp"
#include "fsdp/launcher/snapshot_keeper.hpp"

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

#include "agent_support.hpp"
#include "fsdp/common/deadline.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/sha256.hpp"
#include "fsdp/common/shm.hpp"
#include "fsdp/rendezvous/rdzv_client.hpp"
#include "fsdp/rendezvous/store_proxy.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "../hang/agent_hooks.hpp"
#include "../workers/guardian.hpp"
#include "../workers/worker_group.hpp"

namespace fsdp::launcher {
namespace {

// How long after a round's workers start its standbys do (--standby).
constexpr std::chrono::seconds kStandbyDelay{3};

using namespace std::chrono_literals;
using detail::readToken;
using detail::ScratchDir;
using detail::SignalFd;
using detail::utcNow;
using detail::writeToken;
using rendezvous::Assignment;
using rendezvous::EventKind;
using Clock = Deadline::Clock;

// How a round ended for this node, once its workers are all gone.
struct Verdict {
  enum Kind { kRestart, kFinished, kFailed, kClosed } kind = kClosed;
  std::string reason;
  std::string failure;  // JSON, for kFailed (and kRestart after a failure)
};

// A stop signal arrived before any worker ran.
struct StopRequested {
  int sig;
};

class Agent {
 public:
  Agent(const LaunchOptions& options, std::vector<std::string> command)
      : options_(options),
        command_(std::move(command)),
        plan_(planRendezvous(options)),
        signals_(options.signalsToHandle),
        base_(currentEnvironment()) {}

  AgentResult run();

 private:
  void startRendezvous();
  void connect();
  rendezvous::JoinRequest joinRequest() const;
  // Joins the next round; an assignment, or the job's end for this node.
  std::variant<Assignment, AgentResult> joinRound();
  std::optional<AgentResult> runRound(const Assignment& a);
  // Starts the spares of this node's workers for the restart after round `a` (--standby).
  void startStandby(const Assignment& a, const std::string& runDir, const detail::OutputOptions& output);
  std::vector<detail::WorkerSpec> workerSpecs(const Assignment& a, const std::string& attemptDir);
  // Polls the signalfd, the rendezvous connection and `extra` until something is ready or
  // `until`; heartbeats on the way.
  void waitForActivity(std::vector<pollfd>& fds, Clock::time_point until);
  std::optional<rendezvous::RendezvousEvent> takeEvent();
  AgentResult ended(int exitCode, std::string message, const std::string& failureJson = "");
  std::string endpointName() const {
    return plan_.embedded ? "the embedded server" : plan_.endpoint.str();
  }

  const LaunchOptions& options_;
  const std::vector<std::string> command_;
  const RendezvousPlan plan_;
  SignalFd signals_;  // before any thread starts, so that every thread inherits the mask
  detail::Guardian guardian_;  // forked before any thread starts too
  const std::vector<std::string> base_;
  ScratchDir scratch_;
  std::string token_;
  std::string tokenFile_;
  std::unique_ptr<rendezvous::StoreServer> server_;
  std::unique_ptr<rendezvous::RendezvousClient> client_;
  std::string storeHost_;
  int storePort_ = 0;
  // When set, this node's workers reach the store through it (on loopback), not directly.
  std::unique_ptr<rendezvous::StoreProxy> proxy_;
  // Holds this node's in-memory snapshots across worker restarts (with --max_restarts > 0).
  std::unique_ptr<SnapshotKeeper> keeper_;
  void startSnapshotKeeper();
  // --standby: the workers of the next restart, waiting in fsdp::init() (after guardian_, so
  // that they are stopped before it goes).
  std::unique_ptr<detail::WorkerGroup> standby_;
  std::string address_;  // this node's address for the others
  std::string node_;
  int masterPort_ = 0;   // the MASTER_PORT this node offers, should it be node 0
  int restarts_ = 0;
  detail::StallCounter stalls_{options_.maxStalledRestarts};  // --max_stalled_restarts
  Clock::time_point nextHeartbeat_ = Clock::now();
  std::optional<std::string> lost_;  // the rendezvous connection failed: why
};

AgentResult Agent::ended(int exitCode, std::string message, const std::string& failureJson) {
  standby_.reset();
  AgentResult result{.exitCode = exitCode, .message = std::move(message), .restarts = restarts_};
  if (!failureJson.empty()) {
    try {
      result.failure = Failure::fromJson(failureJson);
    } catch (const ProtocolError& e) {
      log::warn("unreadable failure report from the rendezvous: {}", e.what());
    }
  }
  return result;
}

void Agent::startRendezvous() {
  const auto& conf = options_.rdzvConf;
  const bool allowPytorch = conf.allowPytorchClients.value_or(false);
  if (plan_.embedded) {
    token_ = toHex(randomBytes(32));
    tokenFile_ = writeToken(scratch_.path(), token_);
    server_ = std::make_unique<rendezvous::StoreServer>(
        rendezvous::ServerOptions{.host = "127.0.0.1",
                                  .port = 0,
                                  .token = token_,
                                  .allowPytorchClients = allowPytorch,
                                  .pytorchRunId = options_.rdzvId});
    storeHost_ = "127.0.0.1";
    storePort_ = server_->port();
    connect();
    startSnapshotKeeper();
    return;
  }
  tokenFile_ = conf.tokenFile;
  if (tokenFile_.empty()) {
    if (const char* env = std::getenv("FSDPRUN_TOKEN_FILE")) tokenFile_ = env;
  }
  if (!tokenFile_.empty()) {
    tokenFile_ = std::filesystem::absolute(tokenFile_).string();
    token_ = readToken(tokenFile_, conf.tokenFile.empty() ? "FSDPRUN_TOKEN_FILE" : "--rdzv_conf token_file");
  }
  storeHost_ = plan_.endpoint.host;
  storePort_ = plan_.endpoint.port;
  if (plan_.mayHost) {
    const rendezvous::ServerOptions serverOptions{
        .host = plan_.bindHost,
        .port = static_cast<std::uint16_t>(plan_.endpoint.port),
        .token = token_,
        .allowPytorchClients = conf.allowPytorchClients,
        .pytorchRunId = options_.rdzvId};
    try {
      server_ = std::make_unique<rendezvous::StoreServer>(serverOptions);
    } catch (const NetworkError& e) {
      if (plan_.bindHost == "::") {  // no IPv6 here: the IPv4 wildcard then
        auto v4 = serverOptions;
        v4.host = "0.0.0.0";
        try {
          server_ = std::make_unique<rendezvous::StoreServer>(v4);
        } catch (const NetworkError&) {
        }
      }
      if (!server_) {
        const auto holder = portHolder(plan_.endpoint.port);
        if (plan_.mustHost) {
          throw ConfigError("--rdzv_endpoint " + plan_.endpoint.str() +
                            ": cannot serve the rendezvous here (is_host=true): " + e.what() +
                            (holder ? " (held by " + *holder + ")" : ""));
        }
        log::info("rendezvous port {} is taken{}: joining the server there", plan_.endpoint.port,
                  holder ? " by " + *holder : "");
      }
    }
    if (server_) log::info("serving the rendezvous of run '{}' on {}", options_.rdzvId, plan_.endpoint.str());
  }
  connect();
  startSnapshotKeeper();
  if (!server_ && conf.storeProxy) {
    try {
      proxy_ = std::make_unique<rendezvous::StoreProxy>(
          rendezvous::ProxyOptions{.serverHost = storeHost_,
                                   .serverPort = static_cast<std::uint16_t>(storePort_),
                                   .runId = options_.rdzvId,
                                   .token = token_,
                                   .connectTimeout = std::chrono::seconds(10)});
      log::info("workers reach the store through this node's proxy on 127.0.0.1:{}", proxy_->port());
    } catch (const Error& e) {
      // e.g. a server older than MUX: the workers connect to it themselves, as before.
      log::warn("no store proxy on this node ({}): workers connect to {} directly", e.what(),
                endpointName());
    }
  }
}

void Agent::startSnapshotKeeper() {
  if (options_.maxRestarts == 0 || options_.snapshotMemoryLimit == 0) return;
  try {
    keeper_ = std::make_unique<SnapshotKeeper>(KeeperOptions{.runId = options_.rdzvId,
                                                             .memoryLimit = options_.snapshotMemoryLimit,
                                                             .listenAddress = address_,
                                                             .token = token_});
    log::debug("snapshot keeper on @{} and {}", keeper_->socketName(), keeper_->peerEndpoint());
  } catch (const Error& e) {
    log::warn("no in-memory snapshots on this node ({}): restarts resume from disk checkpoints", e.what());
  }
}

void Agent::connect() {
  const auto start = Clock::now();
  const Deadline deadline = Deadline::after(options_.rdzvConf.joinTimeout);
  std::string lastError;
  // A service that accepted a connection and never answered the handshake says more than a
  // later attempt that ran out of time while connecting (on a loaded machine the last attempt
  // may get only the deadline's last milliseconds): kept and named in the final error.
  std::string handshakeError;
  for (;;) {
    // Short attempts, so that a stop signal is honoured while the endpoint is not up yet.
    try {
      client_ = rendezvous::RendezvousClient::connect(
          storeHost_, static_cast<std::uint16_t>(storePort_),
          {.connectTimeout = std::min<std::chrono::milliseconds>(2000ms, deadline.remaining()),
           .runId = options_.rdzvId,
           .token = token_});
      break;
    } catch (const rendezvous::HandshakeTimeout& e) {
      lastError = handshakeError = e.what();
    } catch (const TimeoutError& e) {
      lastError = e.what();
    } catch (const NetworkError& e) {
      lastError = e.what();
    } catch (const ProtocolError& e) {
      const auto holder = portHolder(storePort_);
      throw ConfigError("--rdzv_endpoint " + endpointName() +
                        ": something answers there but it is not an fsdprun rendezvous server" +
                        (holder ? " (" + *holder + ")" : "") + ": " + e.what());
    }
    for (int sig : signals_.take()) {
      if (isStopSignal(sig)) throw StopRequested{sig};
    }
    if (deadline.expired()) {
      const auto holder = plan_.embedded ? std::nullopt : portHolder(storePort_);
      throw ConfigError("--rdzv_endpoint " + endpointName() + ": unreachable after " +
                        std::to_string(elapsedMs(start)) + " ms (join_timeout " +
                        std::to_string(options_.rdzvConf.joinTimeout.count() / 1000.0).substr(0, 6) +
                        " s; " + (handshakeError.empty() ? "last error: " + lastError : handshakeError) + ")" +
                        (holder ? "; the port is held by " + *holder : ""));
    }
  }
  address_ = !options_.localAddr.empty() ? options_.localAddr
             : plan_.embedded            ? std::string("127.0.0.1")
                                         : client_->localAddress();
  node_ = plan_.embedded ? hostName() : (options_.localAddr.empty() ? hostName() : options_.localAddr);
  if (options_.masterPort && (plan_.embedded || options_.rdzvBackend == "c10d")) {
    masterPort_ = *options_.masterPort;
  } else {
    masterPort_ = freePort(isAddressLiteral(address_) ? address_ : "0.0.0.0");
  }
}

rendezvous::JoinRequest Agent::joinRequest() const {
  rendezvous::JoinRequest join;
  join.node = node_;
  join.address = address_;
  join.localWorldSize = options_.nprocPerNode;
  join.preferredRank = plan_.preferredRank;
  join.masterPort = masterPort_;
  join.minNodes = plan_.embedded ? 1 : options_.minNodes;
  join.maxNodes = plan_.embedded ? 1 : options_.maxNodes;
  join.maxRestarts = options_.maxRestarts;
  join.lastCallTimeout = options_.rdzvConf.lastCallTimeout;
  join.joinTimeout = options_.rdzvConf.joinTimeout;
  join.heartbeatTimeout = options_.rdzvConf.heartbeatTimeout;
  return join;
}

void Agent::waitForActivity(std::vector<pollfd>& fds, Clock::time_point until) {
  fds.insert(fds.begin(), {pollfd{signals_.fd(), POLLIN, 0}, pollfd{client_->fd(), POLLIN, 0}});
  for (;;) {
    const auto now = Clock::now();
    if (now >= nextHeartbeat_ && !lost_) {
      try {
        client_->heartbeat();
      } catch (const Error& e) {
        lost_ = e.what();
      }
      nextHeartbeat_ = now + options_.rdzvConf.heartbeatInterval;
    }
    if (client_->hasBufferedEvent()) return;
    const auto wake = std::min(until, nextHeartbeat_);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count();
    if (lost_) fds[1].events = 0;  // a broken connection stays readable
    const int r = ::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<long long>(ms, 0, 1 << 30)));
    if (r < 0 && errno != EINTR) throwErrno("poll", errno);
    if (r > 0 || Clock::now() >= until) return;
  }
}

std::optional<rendezvous::RendezvousEvent> Agent::takeEvent() {
  if (lost_) return std::nullopt;
  try {
    return client_->nextEvent(0ms);
  } catch (const Error& e) {
    lost_ = e.what();
    return std::nullopt;
  }
}

std::variant<Assignment, AgentResult> Agent::joinRound() {
  try {
    client_->sendJoin(joinRequest());
  } catch (const Error& e) {
    lost_ = e.what();
  }
  for (;;) {
    if (lost_) return ended(1, "lost the rendezvous server " + endpointName() + ": " + *lost_);
    std::vector<pollfd> fds;
    waitForActivity(fds, Clock::time_point::max());
    for (int sig : signals_.take()) {
      if (isStopSignal(sig)) {
        return ended(128 + sig, "received " + signalName(sig) + " while waiting for the rendezvous");
      }
    }
    while (auto event = takeEvent()) {
      switch (event->kind) {
        case EventKind::kAssigned: return event->assignment;
        case EventKind::kRunFinished: return ended(0, event->reason);
        case EventKind::kRunFailed: return ended(1, event->reason, event->failure);
        case EventKind::kRunClosed: return ended(1, "the run was closed: " + event->reason);
        case EventKind::kJoinFailed:
        case EventKind::kDisconnect:
          return ended(1, "rendezvous at " + endpointName() + " refused node " + node_ + ": " +
                              event->reason);
        case EventKind::kRoundEnded: break;  // news of a round this node has already left
      }
    }
  }
}

void Agent::startStandby(const Assignment& a, const std::string& runDir, const detail::OutputOptions& output) {
  // As the restart after this round would be if the group restarts as it is: the same ranks,
  // the next restart count (the round and the store are handed over when it comes).
  Assignment next = a;
  next.restartCount = a.restartCount + 1;
  const std::string attemptDir = runDir + "/attempt_" + std::to_string(next.restartCount);
  try {
    standby_ = std::make_unique<detail::WorkerGroup>(workerSpecs(next, attemptDir), output, attemptDir, guardian_,
                                                     /*standby=*/true);
  } catch (const Error& e) {
    log::warn("--standby: cannot start the standby workers ({}); a restart starts new ones", e.what());
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
  }
  return specs;
}

std::optional<AgentResult> Agent::runRound(const Assignment& a) {
  restarts_ = a.restartCount;
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
  if (standby_) {
    std::string why;
    if (standby_->activate(specs, why)) {
      standing = std::move(standby_);
      log::info("round {}: the standby workers take over", a.round);
    } else {
      log::info("round {}: the standby workers do not fit it ({}): starting new ones", a.round, why);
    }
    standby_.reset();
  }
  if (!standing) standing = std::make_unique<detail::WorkerGroup>(std::move(specs), output, attemptDir, guardian_);
  detail::WorkerGroup& group = *standing;
  auto watchdog = detail::startHangWatchdog(options_, a, group,
                                            {node_, storeHost_, storePort_, options_.rdzvId, token_});
  // The spares for the next restart start once this round's workers are past their own start-up
  // (they would compete with it for the CPUs).
  auto standbyAt = options_.standby && a.restartCount < options_.maxRestarts ? Clock::now() + kStandbyDelay
                                                                              : Clock::time_point::max();

  enum class State { kRunning, kSucceeded, kStopping } state = State::kRunning;
  std::optional<Verdict> verdict;
  std::optional<int> stopSignal;
  auto killAt = Clock::time_point::max();
  // Signals the workers once; the shutdown timeout starts with the first stop.
  const auto stopGroup = [&](int sig) {
    group.signalAll(sig);
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
          stopGroup(sig);
        }
      } else {
        group.signalAll(sig);  // e.g. SIGUSR1 from Slurm before the time limit
      }
    }

    for (const auto& exit : group.reap()) {
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
      stopGroup(SIGTERM);
    }
    if (watchdog) {
      // Taken whatever the state, so that its descriptor never stays readable.
      const auto report = watchdog->take();
      if (report && state == State::kRunning) {
        // A worker failure: counted against --max_restarts; the stuck workers are killed.
        log::error("{}", report->text);
        const Failure f = detail::hangFailure(*report, a.restartCount, group, attemptDir, node_);
        try {
          client_->endRound("the job hung: " + report->summary, f.toJson());
        } catch (const Error& e) {
          lost_ = e.what();
        }
        stopGroup(SIGKILL);  // stuck: nothing to wait for
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
        case EventKind::kAssigned: break;  // cannot happen while a member
      }
    }
    if (!verdict && lost_) {
      verdict = Verdict{Verdict::kClosed,
                        "lost the rendezvous server " + endpointName() + ": " + *lost_, ""};
    }
    if (verdict && state == State::kRunning) stopGroup(SIGTERM);

    if (Clock::now() >= killAt && group.running() > 0) {
      log::warn("{} worker(s) still running {} ms after the stop signal: sending SIGKILL",
                group.running(), options_.shutdownTimeout.count());
      group.signalAll(SIGKILL);
      killAt = Clock::time_point::max();
    }
    if (group.running() > 0) continue;
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
        return std::nullopt;
      case Verdict::kFinished: return ended(0, verdict->reason);
      case Verdict::kFailed: return ended(1, verdict->reason, verdict->failure);
      case Verdict::kClosed: return ended(1, verdict->reason);
    }
  }
}

AgentResult Agent::run() {
  try {
    startRendezvous();
  } catch (const StopRequested& stop) {
    return ended(128 + stop.sig, "received " + signalName(stop.sig) +
                                     " while connecting to the rendezvous at " + endpointName());
  }
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

}  // namespace

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
  Agent agent(options, command);
  return agent.run();
}

}  // namespace fsdp::launcher
