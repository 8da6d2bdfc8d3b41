#pragma once
// An agent's rendezvous connection: one long-lived TCP connection, one JOIN per round, the
// answer pushed by the server when the round completes, then pushed events (ROUND_ENDED,
// RUN_CLOSED) while the round runs. Heartbeats keep a silent-but-alive agent in the round.
//
// Thread-safety: none; one agent thread owns it (poll fd() in its event loop).

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "fsdp/common/error.hpp"
#include "fsdp/rendezvous/round.hpp"
#include "fsdp/rendezvous/store_client.hpp"

namespace fsdp::rendezvous {

namespace detail {
class Connection;
}

// The run was closed (job finished or gave up, server shutting down); final.
// The endpoint accepted the connection but did not answer the handshake in time (another
// service on that port?).
class HandshakeTimeout : public TimeoutError {
 public:
  using TimeoutError::TimeoutError;
};

class RunClosedError : public Error {
 public:
  using Error::Error;
};

struct RendezvousEvent {
  EventKind kind = EventKind::kRoundEnded;
  Assignment assignment;
  std::string reason;
  std::string failure;  // JSON object of the worker failure behind it; empty when none
};

class RendezvousClient {
 public:
  static std::unique_ptr<RendezvousClient> connect(const std::string& host, std::uint16_t port,
                                                   const ClientOptions& options);
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  // Joins the next round and blocks until it completes. Throws RunClosedError, Error (the
  // server refused the join, e.g. join timeout, naming how many nodes came), TimeoutError.
  Assignment join(const JoinRequest& request, std::chrono::milliseconds timeout);
  // Sends JOIN without waiting; the assignment arrives as an event (nextEvent). For callers
  // that drive many agents from one thread (benchmarks).
  void sendJoin(const JoinRequest& request);
  void heartbeat();
  // Asks every member to restart (ends the round for all). With a `failure` (a JSON object
  // describing a failed worker) the restart counts against the run's max_restarts.
  void endRound(const std::string& reason, const std::string& failure = "");
  // Tells the server that every worker of this node exited 0.
  void succeeded();
  // Ends the run for everyone, for good.
  void closeRun(const std::string& reason);
  // Waits up to `timeout` for a pushed event; nullopt when none came. Throws NetworkError
  // when the server closed the connection.
  std::optional<RendezvousEvent> nextEvent(std::chrono::milliseconds timeout);
  // Readable when an event arrives (for poll()); check hasBufferedEvent() first, since an
  // event read together with an earlier one waits in memory, not in the socket.
  int fd() const;
  bool hasBufferedEvent() const;
  const std::string& endpoint() const;
  // This end's address on the connection ("10.0.0.5"): the interface that routes to the
  // server, which is the one the other nodes can reach.
  std::string localAddress() const;

 private:
  explicit RendezvousClient(std::unique_ptr<detail::Connection> connection);
  std::unique_ptr<detail::Connection> connection_;
};

}  // namespace fsdp::rendezvous
