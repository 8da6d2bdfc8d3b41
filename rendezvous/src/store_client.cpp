#include "fsdp/rendezvous/store_client.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "fsdp/common/deadline.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::rendezvous {
namespace {

// Waits until fd is ready for `events` or the deadline passes.
void pollUntil(int fd, short events, const Deadline& deadline, const std::string& what,
               const std::string& endpoint) {
  for (;;) {
    const auto left = deadline.remaining();
    if (left.count() <= 0 && deadline.expired()) {
      throw TimeoutError("store " + what + ": no progress before the deadline (server " +
                         endpoint + ")");
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

void recvAll(int fd, std::uint8_t* out, std::size_t size, const Deadline& deadline,
             const std::string& endpoint) {
  std::size_t got = 0;
  while (got < size) {
    const ssize_t n = ::recv(fd, out + got, size - got, 0);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
    } else if (n == 0) {
      throw NetworkError("store server " + endpoint + " closed the connection", endpoint);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollUntil(fd, POLLIN, deadline, "receive", endpoint);
    } else if (errno != EINTR) {
      throw NetworkError(errnoMessage("store receive from " + endpoint, errno), endpoint);
    }
  }
}

// One non-blocking connect attempt to any address of host:port, bounded by `deadline`.
// Returns the fd or -1 with `error` set.
int tryConnect(const std::string& host, std::uint16_t port, const Deadline& deadline,
               std::string& error) {
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
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      error = errnoMessage("socket", errno);
      continue;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 || errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      const auto left = std::max<long long>(deadline.remaining().count(), 1);
      if (::poll(&pfd, 1, static_cast<int>(std::min<long long>(left, 1 << 30))) == 1) {
        int soError = 0;
        socklen_t len = sizeof(soError);
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soError, &len);
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
  }
  return -1;
}

}  // namespace

std::unique_ptr<StoreClient> StoreClient::connect(const std::string& host, std::uint16_t port,
                                                  ClientOptions options) {
  const std::string endpoint = host + ":" + std::to_string(port);
  const auto start = Deadline::Clock::now();
  const Deadline deadline = Deadline::after(options.connectTimeout);
  std::mt19937 jitter(std::random_device{}());
  std::chrono::milliseconds backoff(10);
  std::string error;
  int attempts = 0;
  for (;;) {
    ++attempts;
    const int fd = tryConnect(host, port, deadline, error);
    if (fd >= 0) {
      return std::unique_ptr<StoreClient>(new StoreClient(fd, endpoint, std::move(options)));
    }
    if (deadline.expired()) break;
    // Exponential backoff with jitter, never past the deadline.
    std::uniform_int_distribution<long long> spread(backoff.count() / 2, backoff.count());
    const auto pause = std::min(std::chrono::milliseconds(spread(jitter)), deadline.remaining());
    std::this_thread::sleep_for(pause);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  throw TimeoutError("cannot connect to store server " + endpoint + " after " +
                     std::to_string(elapsedMs(start)) + " ms (" + std::to_string(attempts) +
                     " attempts; last error: " + error + ")");
}

StoreClient::StoreClient(int fd, std::string endpoint, ClientOptions options)
    : fd_(fd), endpoint_(std::move(endpoint)), options_(std::move(options)) {}

StoreClient::~StoreClient() { ::close(fd_); }

Response StoreClient::call(Request request, std::chrono::milliseconds waitTimeout) {
  request.timeoutMs = static_cast<std::uint32_t>(
      std::clamp<long long>(waitTimeout.count(), 0, std::numeric_limits<std::uint32_t>::max()));
  // The server answers a wait by its own timeout; allow time for the reply on top.
  const Deadline deadline = Deadline::after(waitTimeout + std::chrono::seconds(30));
  const auto bytes = encodeRequest(request);
  std::scoped_lock lock(mutex_);
  sendAll(fd_, bytes, deadline, endpoint_);
  std::array<std::uint8_t, kHeaderSize> header{};
  recvAll(fd_, header.data(), header.size(), deadline, endpoint_);
  const Header h = decodeHeader(header, options_.limits);
  if (h.op != request.op) {
    throw ProtocolError("store server " + endpoint_ + " answered " + opName(h.op) + " to " +
                        opName(request.op));
  }
  std::vector<std::uint8_t> body(h.bodyLength);
  recvAll(fd_, body.data(), body.size(), deadline, endpoint_);
  Response resp = decodeResponse(body, options_.limits);
  if (resp.status == Status::kError) {
    throw Error("store " + opName(request.op) + " failed on server " + endpoint_ + ": " +
                resp.value);
  }
  return resp;
}

void StoreClient::set(const std::string& key, const std::string& value) {
  call({.op = Op::kSet, .keys = {key}, .value = value}, std::chrono::milliseconds(0));
}

std::string StoreClient::get(const std::string& key) { return get(key, options_.timeout); }

std::string StoreClient::get(const std::string& key, std::chrono::milliseconds timeout) {
  Response resp = call({.op = Op::kGet, .keys = {key}}, timeout);
  if (resp.status == Status::kTimeout) {
    throw TimeoutError("store.get: key [" + key + "] still missing after " +
                       std::to_string(timeout.count()) + " ms (server " + endpoint_ + ")");
  }
  return std::move(resp.value);
}

std::int64_t StoreClient::add(const std::string& key, std::int64_t delta) {
  return call({.op = Op::kAdd, .keys = {key}, .number = delta}, std::chrono::milliseconds(0))
      .number;
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  return call({.op = Op::kCheck, .keys = keys}, std::chrono::milliseconds(0)).number != 0;
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, options_.timeout); }

void StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const Response resp = call({.op = Op::kWait, .keys = keys}, timeout);
  if (resp.status == Status::kTimeout) {
    throw TimeoutError("store.wait: keys [" + resp.value + "] still missing after " +
                       std::to_string(timeout.count()) + " ms (server " + endpoint_ + ")");
  }
}

bool StoreClient::remove(const std::string& key) {
  return call({.op = Op::kDelete, .keys = {key}}, std::chrono::milliseconds(0)).number != 0;
}

std::int64_t StoreClient::numKeys() {
  return call({.op = Op::kNumKeys}, std::chrono::milliseconds(0)).number;
}

std::string StoreClient::compareSet(const std::string& key, const std::string& expected,
                                    const std::string& desired) {
  return call({.op = Op::kCompareSet, .keys = {key}, .value = expected, .value2 = desired},
              std::chrono::milliseconds(0))
      .value;
}

std::int64_t StoreClient::append(const std::string& key, const std::string& suffix) {
  return call({.op = Op::kAppend, .keys = {key}, .value = suffix}, std::chrono::milliseconds(0))
      .number;
}

std::vector<std::string> StoreClient::multiGet(const std::vector<std::string>& keys) {
  return call({.op = Op::kMultiGet, .keys = keys}, std::chrono::milliseconds(0)).values;
}

void StoreClient::multiSet(const std::vector<std::string>& keys,
                           const std::vector<std::string>& values) {
  call({.op = Op::kMultiSet, .keys = keys, .values = values}, std::chrono::milliseconds(0));
}

void StoreClient::ping() { call({.op = Op::kPing}, std::chrono::milliseconds(0)); }

}  // namespace fsdp::rendezvous
