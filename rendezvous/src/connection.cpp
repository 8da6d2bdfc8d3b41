#include "connection.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/common/sha256.hpp"

namespace fsdp::rendezvous::detail {
namespace {

// Waits until fd is ready for `events` or the deadline passes.
void pollUntil(int fd, short events, const Deadline& deadline, const std::string& what,
               const std::string& endpoint) {
  for (;;) {
    const auto left = deadline.remaining();
    if (left.count() <= 0 && deadline.expired()) {
      throw TimeoutError("store " + what + ": no progress before the deadline (server " + endpoint +
                         ")");
    }
    pollfd pfd{fd, events, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left.count(), 1 << 30)));
    if (r > 0) return;
    if (r < 0 && errno != EINTR) {
      throw NetworkError(errnoMessage("store " + what + ": poll", errno), endpoint);
    }
  }
}

void sendAll(int fd, const std::vector<std::uint8_t>& bytes, const Deadline& deadline,
             const std::string& endpoint) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollUntil(fd, POLLOUT, deadline, "send", endpoint);
    } else if (n < 0 && errno != EINTR) {
      throw NetworkError(errnoMessage("store send to " + endpoint, errno), endpoint);
    }
  }
}

// One non-blocking connect to `addr`, bounded by `deadline`; the fd or -1 with `error` set.
int connectTo(const sockaddr* addr, socklen_t len, int family, const Deadline& deadline,
              std::string& error) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = errnoMessage("socket", errno);
    return -1;
  }
  if (::connect(fd, addr, len) == 0 || errno == EINPROGRESS) {
    pollfd pfd{fd, POLLOUT, 0};
    const auto left = std::max<long long>(deadline.remaining().count(), 1);
    if (::poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1 << 30))) == 1) {
      int soError = 0;
      socklen_t soLen = sizeof(soError);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soError, &soLen);
      if (soError == 0) {
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
      }
      error = std::strerror(soError);
    } else {
      error = "connect timed out";
    }
  } else {
    error = std::strerror(errno);
  }
  ::close(fd);
  return -1;
}

// One non-blocking connect attempt to any address of host:port, bounded by `deadline`.
// Returns the fd or -1 with `error` set.
int tryConnect(const std::string& host, std::uint16_t port, const Deadline& deadline,
               std::string& error) {
  // A numeric IPv4 address (the common case on a cluster) needs no resolver round.
  sockaddr_in numeric{};
  if (::inet_pton(AF_INET, host.c_str(), &numeric.sin_addr) == 1) {
    numeric.sin_family = AF_INET;
    numeric.sin_port = htons(port);
    return connectTo(reinterpret_cast<const sockaddr*>(&numeric), sizeof(numeric), AF_INET,
                     deadline, error);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &result);
  if (rc != 0) {
    error = std::string("cannot resolve host: ") + ::gai_strerror(rc);
    return -1;
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(result, ::freeaddrinfo);
  for (addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    const int fd = connectTo(ai->ai_addr, ai->ai_addrlen, ai->ai_family, deadline, error);
    if (fd >= 0) return fd;
  }
  return -1;
}

}  // namespace

Connection Connection::open(const ConnectParams& params) {
  const std::string endpoint = params.host + ":" + std::to_string(params.port);
  const auto start = Deadline::Clock::now();
  const Deadline deadline = Deadline::after(params.connectTimeout);
  std::optional<std::mt19937> jitter;  // seeded on the first retry only
  std::chrono::milliseconds backoff(10);
  // A SYN dropped by a full listen backlog (thousands of ranks connecting at once) is resent
  // by the kernel only after a second; a fresh attempt after a short wait is much faster.
  std::chrono::milliseconds attemptTimeout(100);
  std::string error;
  int attempts = 0;
  for (;;) {
    ++attempts;
    const int fd =
        tryConnect(params.host, params.port, deadline.min(Deadline::after(attemptTimeout)), error);
    attemptTimeout = std::min(attemptTimeout * 2, std::chrono::milliseconds(2000));
    if (fd >= 0) {
      Connection connection(fd, endpoint, params.limits);
      connection.handshake(params, deadline.min(Deadline::after(std::chrono::seconds(30))));
      return connection;
    }
    if (deadline.expired()) break;
    // Exponential backoff with jitter, never past the deadline.
    if (!jitter) jitter.emplace(std::random_device{}());
    std::uniform_int_distribution<long long> spread(backoff.count() / 2, backoff.count());
    const auto pause = std::min(std::chrono::milliseconds(spread(*jitter)), deadline.remaining());
    std::this_thread::sleep_for(pause);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  throw TimeoutError("cannot connect to store server " + endpoint + " after " +
                     std::to_string(elapsedMs(start)) + " ms (" + std::to_string(attempts) +
                     " attempts; last error: " + error + ")");
}

Connection::Connection(Connection&& other) noexcept
    : fd_(other.fd_),
      helloPending_(other.helloPending_),
      resetOnClose_(other.resetOnClose_),
      unsentHello_(std::move(other.unsentHello_)),
      endpoint_(std::move(other.endpoint_)),
      limits_(other.limits_),
      in_(std::move(other.in_)),
      start_(other.start_),
      end_(other.end_) {
  other.fd_ = -1;
}

Connection::~Connection() {
  if (fd_ < 0) return;
  if (resetOnClose_) {
    // An abortive close (RST): see resetOnClose().
    const linger abortive{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &abortive, sizeof(abortive));
  }
  ::close(fd_);
}

int Connection::release() {
  if (buffered()) throw ProtocolError("store server " + endpoint_ + " sent more than was asked");
  return std::exchange(fd_, -1);
}

void Connection::handshake(const ConnectParams& params, const Deadline& deadline) {
  // The nonce only matters to a token proof; a client without a token sends none.
  const std::string clientNonce = params.token.empty() ? std::string() : randomBytes(16);
  auto hello = encodeRequest({.op = Op::kHello, .keys = {params.runId}, .value = clientNonce});
  if (params.token.empty()) {
    // Nothing to prove: HELLO leaves with the first request, and its reply is checked before
    // that request's reply is read. Saves a round trip and a segment per connection, which is
    // what thousands of ranks starting at once pay for.
    unsentHello_ = std::move(hello);
    helloPending_ = true;
    return;
  }
  send(hello, deadline);
  auto [h, body] = readFrame(deadline);
  const Response reply = checkHelloReply(h, body);
  if (reply.number == 0) return;
  const auto mac = hmacSha256(params.token, authMessage(params.runId, clientNonce, reply.value));
  call({.op = Op::kAuth,
        .value = std::string(reinterpret_cast<const char*>(mac.data()), mac.size())},
       deadline);
}

Response Connection::checkHelloReply(const Header& h, const std::vector<std::uint8_t>& body) {
  if (h.op != Op::kHello) {
    throw ProtocolError("store server " + endpoint_ + " answered " + opName(h.op) + " to HELLO");
  }
  Response reply = decodeResponse(body, limits_);
  if (reply.status == Status::kError) {
    throw Error("store HELLO failed on server " + endpoint_ + ": " + reply.value);
  }
  if (reply.number != 0 && helloPending_) {
    throw ConfigError("store server " + endpoint_ +
                      " requires a job token, and none was given "
                      "(FSDPRUN_TOKEN_FILE or --rdzv_conf token_file=...)");
  }
  return reply;
}

void Connection::completeHandshake(const Deadline& deadline) {
  if (!helloPending_) return;
  if (!unsentHello_.empty()) send({}, deadline);
  auto [h, body] = readFrame(deadline);
  checkHelloReply(h, body);
  helloPending_ = false;
}

void Connection::send(const std::vector<std::uint8_t>& bytes, const Deadline& deadline) {
  if (unsentHello_.empty()) {
    sendAll(fd_, bytes, deadline, endpoint_);
    return;
  }
  std::vector<std::uint8_t> both = std::move(unsentHello_);
  unsentHello_.clear();
  both.insert(both.end(), bytes.begin(), bytes.end());
  sendAll(fd_, both, deadline, endpoint_);
}

std::pair<Header, std::vector<std::uint8_t>> Connection::receive(const Deadline& deadline) {
  completeHandshake(deadline);
  return readFrame(deadline);
}

void Connection::fill(std::size_t n, const Deadline& deadline) {
  if (end_ - start_ >= n) return;
  if (start_ > 0) {
    std::copy(in_.begin() + static_cast<std::ptrdiff_t>(start_),
              in_.begin() + static_cast<std::ptrdiff_t>(end_), in_.begin());
    end_ -= start_;
    start_ = 0;
  }
  // Replies are small: 512 bytes unless a frame needs more (4 KiB per rank is a page fault
  // per rank, thousands of times over on a host that starts thousands of ranks).
  if (in_.size() < std::max<std::size_t>(n, 512)) in_.resize(std::max<std::size_t>(n, 512));
  while (end_ < n) {
    // A reply is rarely there the instant after its request went out: wait first, then read
    // (one syscall fewer than a read that would fail with EAGAIN).
    pollUntil(fd_, POLLIN, deadline, "receive", endpoint_);
    const ssize_t got = ::recv(fd_, in_.data() + end_, in_.size() - end_, 0);
    if (got > 0) {
      end_ += static_cast<std::size_t>(got);
    } else if (got == 0) {
      throw NetworkError("store server " + endpoint_ + " closed the connection", endpoint_);
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      throw NetworkError(errnoMessage("store receive from " + endpoint_, errno), endpoint_);
    }
  }
}

std::pair<Header, std::vector<std::uint8_t>> Connection::readFrame(const Deadline& deadline) {
  // One recv usually brings the whole reply (and sometimes the next pushed event too).
  fill(kHeaderSize, deadline);
  const Header h = decodeHeader(std::span(in_.data() + start_, kHeaderSize), limits_);
  fill(kHeaderSize + h.bodyLength, deadline);
  const auto* body = in_.data() + start_ + kHeaderSize;
  std::vector<std::uint8_t> out(body, body + h.bodyLength);
  start_ += kHeaderSize + h.bodyLength;
  if (start_ == end_) {
    start_ = end_ = 0;
    if (in_.size() > (1u << 20))
      std::vector<std::uint8_t>().swap(in_);  // give back a big frame's buffer
  }
  return {h, std::move(out)};
}

Response Connection::call(const Request& request, const Deadline& deadline) {
  send(encodeRequest(request), deadline);
  auto [h, body] = receive(deadline);
  if (h.op != request.op) {
    throw ProtocolError("store server " + endpoint_ + " answered " + opName(h.op) + " to " +
                        opName(request.op));
  }
  Response resp = decodeResponse(body, limits_);
  if (resp.status == Status::kError) {
    throw Error("store " + opName(request.op) + " failed on server " + endpoint_ + ": " +
                resp.value);
  }
  return resp;
}

}  // namespace fsdp::rendezvous::detail
