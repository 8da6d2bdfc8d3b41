// The agent's side of the rendezvous: serving it (embedded, or as the endpoint's host),
// connecting, joining rounds, heartbeats, and moving the run to a successor when the server is
// lost (agent_state.hpp).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <thread>

#include "agent_state.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/sha256.hpp"
#include "fsdp/launcher/net.hpp"

namespace fsdp::launcher::detail {

using namespace std::chrono_literals;
using rendezvous::EventKind;

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
    connect(Deadline::after(options_.rdzvConf.joinTimeout));
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
  connect(Deadline::after(options_.rdzvConf.joinTimeout));
  startSnapshotKeeper();
  startProxy();
}

void Agent::startProxy() {
  proxy_.reset();
  if (server_ || !options_.rdzvConf.storeProxy) return;
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
    log::warn("no store proxy on this node ({}): workers connect to {} directly", e.what(), endpointName());
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

bool Agent::tryConnect(const Deadline& deadline, std::string& error) {
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
      // A server whose node went silent (powered off, cut off) closes nothing: unacknowledged
      // heartbeats end the connection after the heartbeat timeout instead.
      const auto silent = static_cast<unsigned>(options_.rdzvConf.heartbeatTimeout.count());
      ::setsockopt(client_->fd(), IPPROTO_TCP, TCP_USER_TIMEOUT, &silent, sizeof(silent));
      return true;
    } catch (const rendezvous::HandshakeTimeout& e) {
      error = handshakeError = e.what();
    } catch (const TimeoutError& e) {
      error = e.what();
    } catch (const NetworkError& e) {
      error = e.what();
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
      if (!handshakeError.empty()) error = handshakeError;
      return false;
    }
  }
}

void Agent::connect(const Deadline& deadline) {
  const auto start = Clock::now();
  std::string error;
  if (!tryConnect(deadline, error)) {
    const auto holder = plan_.embedded ? std::nullopt : portHolder(storePort_);
    throw ConfigError("--rdzv_endpoint " + endpointName() + ": unreachable after " +
                      std::to_string(elapsedMs(start)) + " ms (join_timeout " +
                      std::to_string(options_.rdzvConf.joinTimeout.count() / 1000.0).substr(0, 6) + " s; " +
                      (error.find("handshake") != std::string::npos ? error : "last error: " + error) + ")" +
                      (holder ? "; the port is held by " + *holder : ""));
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

bool Agent::isMe(const rendezvous::Successor& s) const {
  // Agents that share a host share node_ and address_: only the id tells them apart.
  if (!s.agentId.empty()) return s.agentId == agentId_;
  return s.node == node_ && s.address == address_;
}

bool Agent::failover() {
  if (plan_.embedded || server_ || successors_.empty()) return false;
  const std::string lostServer = endpointName();
  log::warn("lost the rendezvous server {} ({}): the run moves to the first successor that answers", lostServer,
            *lost_);
  client_.reset();
  proxy_.reset();
  // Each survivor tries the successors in the same order, and successor k's turn ends `turn`
  // after the k-th: it serves once the ones before it had theirs, and the others wait on it until
  // its turn is over (even when they came to it early, passing over themselves). A turn is longer
  // than the spread between survivors noticing a silent server.
  const auto turn = std::max<std::chrono::milliseconds>(10s, 2 * options_.rdzvConf.heartbeatTimeout);
  const auto start = Clock::now();
  const int port = plan_.endpoint.port;
  // Who this node waits for once the run has moved: the last round's other members.
  std::string waitedFor = "the lost server at " + lostServer;
  for (const auto& s : successors_) {
    if (!isMe(s)) waitedFor += ", node " + s.node + " (" + s.address + ", agent " + s.agentId + ")";
  }
  for (std::size_t k = 0; k < successors_.size(); ++k) {
    const auto& s = successors_[k];
    const auto turnEnds = start + static_cast<int>(k + 1) * turn;
    storeHost_ = s.address;
    storePort_ = port;
    if (isMe(s)) {
      const rendezvous::ServerOptions serving{.host = isAddressLiteral(address_) ? address_ : std::string("::"),
                                              .port = static_cast<std::uint16_t>(port),
                                              .token = token_,
                                              .allowPytorchClients = options_.rdzvConf.allowPytorchClients,
                                              .pytorchRunId = options_.rdzvId};
      // The lost server's socket on a shared address can outlive the loss by milliseconds (its
      // process still exits: a kernel frees its memory before its descriptors), and its workers
      // no longer hold this agent back once they re-form in process: the bind is tried again for
      // a moment before another server there is assumed.
      std::string why;
      const auto until = Clock::now() + std::chrono::milliseconds(1500);
      for (;;) {
        try {
          server_ = std::make_unique<rendezvous::StoreServer>(serving);
          break;
        } catch (const NetworkError& e) {
          why = e.what();
        }
        if (Clock::now() >= until) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
      if (!server_) {
        // Another agent of this run on the same address may serve there already (agents that
        // share a host): joined as a client, not passed over. Else the next successor's turn.
        const auto holder = portHolder(port);
        log::warn("cannot serve the rendezvous on {}:{} ({}{}): joining whoever serves there, else the next "
                  "successor takes over",
                  address_, port, why, holder ? ", held by " + *holder : "");
      }
      if (server_) {
        log::warn("serving the rendezvous of run '{}' on {}:{} in place of {}", options_.rdzvId, address_, port,
                  lostServer);
      }
    }
    std::string error;
    const auto tried = Clock::now();
    const auto wait = server_ ? std::chrono::milliseconds(10s)
                              : std::max<std::chrono::milliseconds>(
                                    2s, std::chrono::duration_cast<std::chrono::milliseconds>(turnEnds - tried));
    bool connected = false;
    try {
      connected = tryConnect(Deadline::after(wait), error);
    } catch (const ConfigError& e) {  // something else answers there: not this run's server
      error = e.what();
    }
    if (connected) {
      log::warn("run '{}' goes on with the rendezvous at {}:{} (node {})", options_.rdzvId, s.address, port, s.node);
      // Every survivor reaches the server within the successors' turns: whoever has not joined
      // by then (plus a heartbeat timeout for the spread in noticing the loss) is gone.
      failoverWait_ = std::chrono::duration_cast<std::chrono::milliseconds>(
          static_cast<int>(successors_.size() + 1) * turn + options_.rdzvConf.heartbeatTimeout);
      failoverWaitedFor_ = waitedFor;
      lost_.reset();
      nextHeartbeat_ = Clock::now();
      startProxy();
      return true;
    }
    serving(nullptr);
    server_.reset();
    log::warn("successor {} ({}:{}) did not answer in {} ms (last error: {}): trying the next", s.node, s.address, port,
              elapsedMs(tried), error);
  }
  return false;
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
  // After the rendezvous moved, the last round's members come back within the failover's turns;
  // past them nobody else of that round is coming.
  if (failoverWait_) join.joinTimeout = std::min(join.joinTimeout, *failoverWait_);
  join.agentId = agentId_;
  join.heartbeatTimeout = options_.rdzvConf.heartbeatTimeout;
  if (last_) {
    join.lastRound = last_->round;
    join.lastRank = last_->nodeRank;
    join.restarts = last_->restartCount;
  }
  join.program = program_;
  join.servesRendezvous = server_ != nullptr;
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
    if (lost_) {
      const std::string why = "lost the rendezvous server " + endpointName() + ": " + *lost_;
      if (!failover()) return ended(1, why);
      try {
        client_->sendJoin(joinRequest());
      } catch (const Error& e) {
        lost_ = e.what();
      }
      continue;
    }
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
        case EventKind::kDisconnect: {
          std::string why = "rendezvous at " + endpointName() + " refused node " + node_ + ": " + event->reason;
          if (failoverWait_ && event->kind == EventKind::kJoinFailed) {
            why += "; after the rendezvous moved this node waited " +
                   std::to_string(failoverWait_->count() / 1000.0).substr(0, 5) +
                   " s (the successors' turns and a heartbeat timeout, not the join timeout) for the last "
                   "round's other members: " + failoverWaitedFor_;
          }
          return ended(1, why);
        }
        case EventKind::kRoundEnded: break;  // news of a round this node has already left
        case EventKind::kSpare:
          log::warn("{}", event->reason);
          successors_ = event->assignment.successors;
          break;
      }
    }
  }
}

}  // namespace fsdp::launcher::detail
