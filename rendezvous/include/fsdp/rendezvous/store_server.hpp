#pragma once
// The store server: serves fsdprun's framed protocol on one TCP port from one event-loop
// thread it owns. Waiting requests (GET of a missing key, WAIT) are parked server side and
// woken when the key is written; clients never poll.
//
// Thread-safety: construct, port() and stop() from one thread. The destructor stops the
// server and joins its thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/rendezvous/protocol.hpp"

namespace fsdp::rendezvous {

struct ServerOptions {
  std::string host = "127.0.0.1";  // bind address; "0.0.0.0" or "::" for every interface
  std::uint16_t port = 0;          // 0 = a free port chosen by the kernel
  Limits limits;
  // Once the first byte of a frame has arrived, the rest must arrive within this time. An
  // idle connection between frames is normal (a worker trains for hours between requests);
  // a closed one is noticed at once.
  std::chrono::milliseconds frameTimeout{30000};
  // The job token. When set, every connection of our protocol must prove it (HMAC
  // challenge-response) before anything else; it is never logged.
  std::string token;
  // Serve PyTorch's TCPStore clients (who cannot authenticate) on the same port. Default: on
  // without a token, off with one.
  std::optional<bool> allowPytorchClients;
  // The run whose keys PyTorch clients see.
  std::string pytorchRunId = "default";
  // Bytes a connection may have been sent and not read (replies, pushed events). Over this the
  // server stops reading the connection until its client reads (back-pressure); a client that
  // reads nothing for frameTimeout meanwhile is closed, logged. Frames pushed without a request
  // close a connection (not a proxy's) that lets 4 x this accumulate. 0 = unbounded.
  std::size_t maxQueuedBytes = 4u << 20;
  // The same over every connection: past it, only connections with nothing unread are read.
  std::size_t maxQueuedBytesTotal = 256u << 20;
  // Connections beyond this many are closed at once (logged); 0 = no limit.
  std::size_t maxConnections = 0;
  // A run with no connection and no activity for this long is dropped with its keys.
  std::chrono::milliseconds runIdleTtl{600000};
};

struct ServerStats {
  std::uint64_t connectionsAccepted = 0;
  std::uint64_t connectionsOpen = 0;
  std::uint64_t streamsOpen = 0;  // clients multiplexed on proxies' connections
  std::uint64_t requestsServed = 0;
  std::uint64_t protocolErrors = 0;
  std::uint64_t authFailures = 0;
  std::uint64_t slowReadersClosed = 0;  // closed for reading nothing over maxQueuedBytes
  std::uint64_t connectionsStalled = 0;  // not read now: their clients do not read replies
  std::uint64_t queuedBytes = 0;         // replies and events written to no socket yet
  std::uint64_t queuedBytesPeak = 0;     // the most queuedBytes has been
  std::uint64_t runs = 0;  // runs held now
  // Per run held now (for /metrics).
  struct Run {
    std::string id;
    int round = -1;            // the newest round formed (-1: none yet)
    int restarts = 0;          // rounds ended by a failure
    std::size_t members = 0;   // agents in the round that runs
    std::size_t waiting = 0;   // agents waiting to join (spares included)
    std::size_t sessions = 0;  // store clients of the run (agents, proxies' streams, workers)
    std::size_t keys = 0;
    std::size_t keyBytes = 0;
  };
  std::vector<Run> perRun;
};

class StoreServer {
 public:
  // Binds and starts serving. Throws NetworkError naming the address when bind fails.
  explicit StoreServer(ServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // The bound port (the kernel's choice when options.port was 0).
  std::uint16_t port() const;
  const std::string& host() const;
  // Stops accepting, tells every rendezvous agent (RUN_CLOSED "server shutting down"), closes
  // every connection, joins the thread. Idempotent.
  void stop();
  // A snapshot, taken on the server thread.
  ServerStats stats() const;

  struct Impl;  // opaque: the event loop's state

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::rendezvous
