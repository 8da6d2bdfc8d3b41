#pragma once
// One TCP connection of our framed protocol, client side: connect with backoff, the
// HELLO/AUTH handshake, and frame I/O bounded by deadlines. Private to the rendezvous part.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/common/deadline.hpp"
#include "fsdp/rendezvous/protocol.hpp"
#include "fsdp/rendezvous/store_client.hpp"

namespace fsdp::rendezvous::detail {

struct ConnectParams {
  std::string host;
  std::uint16_t port = 0;
  std::chrono::milliseconds connectTimeout{30000};
  std::string runId = "default";
  std::string token;
  Limits limits;
};

class Connection {
 public:
  // Connects (retrying with exponential backoff and jitter until connectTimeout) and
  // authenticates. Throws TimeoutError naming the endpoint and the last error, Error when the
  // server refuses the token. Without a token, HELLO's reply is read with the first
  // request's, so "this server requires a token" surfaces there.
  static Connection open(const ConnectParams& params);
  // The same, from a public client's options.
  static Connection open(const std::string& host, std::uint16_t port,
                         const ClientOptions& options) {
    return open({.host = host,
                 .port = port,
                 .connectTimeout = options.connectTimeout,
                 .runId = options.runId,
                 .token = options.token,
                 .limits = options.limits});
  }
  Connection(Connection&& other) noexcept;
  Connection& operator=(Connection&&) = delete;
  Connection(const Connection&) = delete;
  ~Connection();

  void send(const std::vector<std::uint8_t>& bytes, const Deadline& deadline);
  // Reads one frame; TimeoutError when none completes before the deadline.
  std::pair<Header, std::vector<std::uint8_t>> receive(const Deadline& deadline);
  // Sends a request and reads its response, checking that the reply is for `op`.
  Response call(const Request& request, const Deadline& deadline);
  // Sends a held HELLO and reads its reply now (for callers that poll fd() for pushed events).
  void completeHandshake(const Deadline& deadline);
  // Ends the connection with a reset instead of the FIN handshake when it is destroyed: for
  // clients whose every request has been answered, so that nothing either side sent can be
  // lost. It spares both ends the closing handshake (a third of the server's work for a
  // connection that makes one request) and the client a TIME_WAIT socket (an ephemeral port
  // held for a minute, per rank, on hosts that start thousands).
  void resetOnClose() { resetOnClose_ = true; }
  int fd() const { return fd_; }
  // Gives the socket up to the caller (who closes it); the connection must have no bytes
  // buffered. -1 afterwards.
  int release();
  // Whether received bytes wait in the buffer (poll(fd) would not show them).
  bool buffered() const { return end_ > start_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  Connection(int fd, std::string endpoint, Limits limits)
      : fd_(fd), endpoint_(std::move(endpoint)), limits_(limits) {}
  void handshake(const ConnectParams& params, const Deadline& deadline);
  std::pair<Header, std::vector<std::uint8_t>> readFrame(const Deadline& deadline);
  Response checkHelloReply(const Header& h, const std::vector<std::uint8_t>& body);
  int fd_;
  bool helloPending_ = false;  // HELLO's reply not read yet (clients without a token)
  bool resetOnClose_ = false;
  // HELLO of a client without a token, not sent yet: it leaves with the first request, in the
  // same segment (one send, one wake-up of the server instead of two).
  std::vector<std::uint8_t> unsentHello_;
  std::string endpoint_;
  Limits limits_;
  void fill(std::size_t n, const Deadline& deadline);
  std::vector<std::uint8_t> in_;  // received bytes; [start_, end_) not parsed yet
  std::size_t start_ = 0;
  std::size_t end_ = 0;
};

}  // namespace fsdp::rendezvous::detail
