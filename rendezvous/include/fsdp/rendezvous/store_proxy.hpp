#pragma once
// A node's store proxy: the local clients of our framed protocol (the node's workers) connect
// to it, and it carries all of them to the store server on one connection (MUX), each client
// a stream. The server then holds one connection per node instead of one per rank. The proxy
// reads frame headers only: handshakes (the job token included) and requests pass through
// unchanged, so every client still proves the token to the server itself.
//
// A client that sends a malformed header is closed alone; a client that goes away ends its
// stream (its waits are dropped server side). When the server connection is lost, every
// client is closed and the proxy stops accepting.
//
// Thread-safety: construct, port(), stats() and stop() from one thread; the proxy runs on a
// thread of its own.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "fsdp/rendezvous/protocol.hpp"

namespace fsdp::rendezvous {

struct ProxyOptions {
  std::string serverHost;
  std::uint16_t serverPort = 0;
  std::string runId = "default";  // the proxy's own HELLO; each client names its own run
  std::string token;              // proves the proxy's own connection
  std::string host = "127.0.0.1";  // where the node's clients connect
  std::uint16_t port = 0;          // 0: a free port
  Limits limits;
  std::chrono::milliseconds connectTimeout{30000};
  // A local client whose replies pass this many unread bytes is not read until it reads them
  // (back-pressure; the server connection and the other clients go on); one that reads none
  // of them for unreadTimeout is closed, logged.
  std::size_t maxUnreadBytes = 4u << 20;
  std::chrono::milliseconds unreadTimeout{30000};
};

struct ProxyStats {
  std::uint64_t clientsAccepted = 0;
  std::uint64_t clientsOpen = 0;
  std::uint64_t framesUp = 0;       // client frames forwarded to the server
  std::uint64_t framesDown = 0;     // server frames forwarded to clients
  std::uint64_t protocolErrors = 0;
  std::uint64_t slowReadersClosed = 0;  // clients closed for not reading their replies
  std::uint64_t streamsInUse = 0;   // numbers taken: open clients, and closed ones the server
                                    // has not acknowledged yet
  bool serverConnected = true;
};

class StoreProxy {
 public:
  // Connects to the server (HELLO, AUTH when there is a token, MUX) and listens. Throws what
  // StoreClient::connect throws, or NetworkError when it cannot listen.
  explicit StoreProxy(ProxyOptions options);
  ~StoreProxy();
  StoreProxy(const StoreProxy&) = delete;
  StoreProxy& operator=(const StoreProxy&) = delete;

  std::uint16_t port() const;
  // Closes every client and the server connection, joins the thread. Idempotent.
  void stop();
  ProxyStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp::rendezvous
