// The metrics HTTP server: the request parsing and replies (pure functions), then the poll loop
// that owns the sockets.
#include "fsdp/common/metrics_http.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kMetricsType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kTextType = "text/plain; charset=utf-8";
// How long accepting stops after the process ran out of descriptors (or memory): the listen
// socket stays readable meanwhile, and polling it would spin.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

// One owner of a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// The offset just past the blank line that ends a request head ("\r\n\r\n", or bare "\n"
// line ends, which some clients send), or npos while it has not all arrived.
std::size_t headEnd(std::string_view buf) {
  for (std::size_t i = 0; i < buf.size(); ++i) {
    if (buf[i] != '\n') continue;
    if (i + 1 < buf.size() && buf[i + 1] == '\n') return i + 2;
    if (i + 2 < buf.size() && buf[i + 1] == '\r' && buf[i + 2] == '\n') return i + 3;
  }
  return std::string_view::npos;
}

std::string reply(int status, std::string_view reason, std::string_view contentType,
                  std::string_view body, bool withBody, std::string_view extraHeaders = {}) {
  std::string out;
  out.reserve(200 + (withBody ? body.size() : 0));
  out += "HTTP/1.1 " + std::to_string(status) + " ";
  out += reason;
  out += "\r\nContent-Type: ";
  out += contentType;
  out += "\r\nContent-Length: " + std::to_string(body.size());
  out += "\r\nConnection: close\r\n";
  out += extraHeaders;
  out += "\r\n";
  if (withBody) out += body;
  return out;
}

bool isTokenChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

// The whole reply to one request head (the bytes up to and including its blank line).
std::string respond(std::string_view head, const std::function<std::string()>& render,
                    const std::string& peer) {
  std::string_view line = head.substr(0, head.find('\n'));
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  // request-line = method SP request-target SP HTTP-version, single spaces.
  constexpr auto npos = std::string_view::npos;
  const std::size_t sp1 = line.find(' ');
  const std::size_t sp2 = sp1 == npos ? npos : line.find(' ', sp1 + 1);
  const std::string_view method = line.substr(0, sp1);
  const std::string_view target = sp2 == npos ? "" : line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = sp2 == npos ? "" : line.substr(sp2 + 1);
  if (sp2 == npos || version.find(' ') != npos || method.empty() ||
      !std::all_of(method.begin(), method.end(), isTokenChar) || target.empty() ||
      target.front() != '/') {
    log::debug("metrics http: {}: malformed request line", peer);
    return reply(400, "Bad Request", kTextType, "malformed request line\n", true);
  }
  if (version.substr(0, 7) != "HTTP/1.") {
    log::debug("metrics http: {}: unsupported version", peer);
    return reply(505, "HTTP Version Not Supported", kTextType, "HTTP/1.x only\n", true);
  }
  const bool isHead = method == "HEAD";
  const std::string_view path = target.substr(0, target.find('?'));
  if (path != "/metrics") {
    log::debug("metrics http: {}: no such path: {}", peer, path);
    return reply(404, "Not Found", kTextType, "not found; metrics are at /metrics\n", !isHead);
  }
  if (method != "GET" && !isHead) {
    log::debug("metrics http: {}: method {} not allowed", peer, method);
    return reply(405, "Method Not Allowed", kTextType, "only GET and HEAD\n", true,
                 "Allow: GET, HEAD\r\n");
  }
  try {
    const std::string body = render();
    return reply(200, "OK", kMetricsType, body, !isHead);
  } catch (const std::exception& e) {
    log::warn("metrics http: rendering the metrics for {} failed: {}", peer, e.what());
    return reply(500, "Internal Server Error", kTextType, std::string(e.what()) + "\n", !isHead);
  } catch (...) {  // not silenced: a reply and a log line, like any other failure
    log::warn("metrics http: rendering the metrics for {} failed: unknown exception", peer);
    return reply(500, "Internal Server Error", kTextType, "unknown exception\n", !isHead);
  }
}

std::string peerName(const sockaddr_in& addr) {
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof(ip));
  return std::string(ip) + ":" + std::to_string(ntohs(addr.sin_port));
}

bool wouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK; }

}  // namespace

// The thread and everything it owns. Only the constructor, port() and url() touch it from
// outside; the rest is the thread's own.
class MetricsHttpServer::Loop {
 public:
  Loop(std::string host, int port, std::function<std::string()> render, MetricsHttpOptions options)
      : host_(std::move(host)), render_(std::move(render)), options_(options) {
    if (port < 0 || port > 65535) {
      throw std::invalid_argument("metrics http: port " + std::to_string(port) +
                                  " outside [0, 65535]");
    }
    if (!render_) throw std::invalid_argument("metrics http: empty render function");
    if (host_.empty()) host_ = "0.0.0.0";
    const std::string where = "cannot serve metrics on " + host_ + ":" + std::to_string(port);

    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::inet_pton(AF_INET, host_.c_str(), &addr.sin_addr) != 1) {
      addrinfo hints{};
      hints.ai_family = AF_INET;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* found = nullptr;
      const int rc = ::getaddrinfo(host_.c_str(), nullptr, &hints, &found);
      if (rc != 0 || found == nullptr) {
        throw Error(where + ": cannot resolve the host: " +
                    (rc == EAI_SYSTEM ? errnoMessage("getaddrinfo", errno) : ::gai_strerror(rc)));
      }
      addr.sin_addr = reinterpret_cast<const sockaddr_in*>(found->ai_addr)->sin_addr;
      ::freeaddrinfo(found);
    }
    listen_ = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (listen_.get() < 0) throwErrno(where, errno);
    const int one = 1;  // a restarted agent rebinds its port despite connections in TIME_WAIT
    if (::setsockopt(listen_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0) {
      throwErrno(where, errno);
    }
    if (::bind(listen_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(listen_.get(), SOMAXCONN) != 0) {
      throwErrno(where, errno);
    }
    sockaddr_in bound{};
    socklen_t len = sizeof(bound);
    if (::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      throwErrno(where, errno);
    }
    port_ = ntohs(bound.sin_port);
    wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (wake_.get() < 0) throwErrno(where + ": eventfd", errno);
    thread_ = std::thread([this] { run(); });
  }

  ~Loop() {
    stop_.store(true);
    const std::uint64_t one = 1;
    // An eventfd write of 1 fails only when the counter would overflow, i.e. it is set already.
    [[maybe_unused]] const ssize_t n = ::write(wake_.get(), &one, sizeof(one));
    thread_.join();
  }

  int port() const { return port_; }
  const std::string& host() const { return host_; }

 private:
  enum class State { kReading, kWriting, kDraining };
  struct Conn {
    Fd fd;
    std::string peer;
    State state = State::kReading;
    std::string in;   // the request head so far
    std::string out;  // the reply
    std::size_t sent = 0;
    Clock::time_point deadline;
  };

  void run() {
    try {
      loop();
    } catch (const std::exception& e) {
      log::error("metrics http: the server on {}:{} stopped: {}", host_, port_, e.what());
    } catch (...) {  // never let an exception end the process from this thread
      log::error("metrics http: the server on {}:{} stopped: unknown exception", host_, port_);
    }
  }

  void loop() {
    std::vector<pollfd> fds;
    while (!stop_.load()) {
      const auto now = Clock::now();
      const bool accepting = now >= acceptPausedUntil_;
      fds.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      fds.push_back({accepting ? listen_.get() : -1, POLLIN, 0});
      auto next = accepting ? Clock::time_point::max() : acceptPausedUntil_;
      for (const Conn& c : conns_) {
        const short events = c.state == State::kWriting ? POLLOUT : POLLIN;
        fds.push_back({c.fd.get(), events, 0});
        next = std::min(next, c.deadline);
      }
      int timeoutMs = -1;
      if (next != Clock::time_point::max()) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
        timeoutMs = static_cast<int>(std::clamp<long long>(left, 0, 60'000));
      }
      const int ready = ::poll(fds.data(), fds.size(), timeoutMs);
      if (ready < 0) {
        if (errno == EINTR) continue;
        // EINVAL/ENOMEM: nothing here can fix it; wait a little for the owner's stop.
        log::warn("metrics http: {}", errnoMessage("poll", errno));
        pollfd wake{wake_.get(), POLLIN, 0};
        ::poll(&wake, 1, static_cast<int>(kAcceptPause.count()));
        continue;
      }
      if (fds[0].revents != 0) break;            // stop_ is set
      const std::size_t polled = conns_.size();  // accept() below appends
      for (std::size_t i = 0; i < polled; ++i) {
        if (fds[i + 2].revents != 0) serve(conns_[i]);
      }
      std::erase_if(conns_, [](const Conn& c) { return c.fd.get() < 0; });
      if (fds[1].revents != 0) acceptAll();
      const auto after = Clock::now();
      for (Conn& c : conns_) {
        if (c.fd.get() >= 0 && after >= c.deadline) {
          if (c.state != State::kDraining) {
            log::debug("metrics http: {}: closed after {} ms without progress", c.peer,
                       options_.idleTimeout.count());
            resetConnection(c);
          }
          c.fd.reset();
        }
      }
      std::erase_if(conns_, [](const Conn& c) { return c.fd.get() < 0; });
    }
    for (Conn& c : conns_) {
      if (c.state != State::kDraining) resetConnection(c);
    }
    conns_.clear();
  }

  // Closes with a reset rather than a FIN: the kernel drops what the client has not taken of
  // the reply (megabytes, maybe) at once instead of keeping it, orphaned, for minutes; and the
  // client learns at once that nothing more comes.
  static void resetConnection(Conn& c) {
    const linger now{1, 0};
    ::setsockopt(c.fd.get(), SOL_SOCKET, SO_LINGER, &now, sizeof(now));
    c.fd.reset();
  }

  void acceptAll() {
    for (;;) {
      sockaddr_in addr{};
      socklen_t len = sizeof(addr);
      Fd fd(::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len,
                      SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (fd.get() < 0) {
        const int err = errno;
        if (wouldBlock(err)) return;
        if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
        // EMFILE, ENFILE, ENOBUFS, ENOMEM: try again a little later.
        log::warn("metrics http: {}", errnoMessage("accept on port " + std::to_string(port_), err));
        acceptPausedUntil_ = Clock::now() + kAcceptPause;
        return;
      }
      const std::string peer = peerName(addr);
      if (static_cast<int>(conns_.size()) >= options_.maxConnections) {
        // A connection whose reply is all sent (waiting for its client to close) makes room;
        // without one, the newcomer is closed unanswered.
        const auto done = std::find_if(conns_.begin(), conns_.end(),
                                       [](const Conn& c) { return c.state == State::kDraining; });
        if (done == conns_.end()) {
          log::debug("metrics http: {}: refused, {} connections open already", peer, conns_.size());
          continue;  // `fd` closes here
        }
        conns_.erase(done);
      }
      Conn& c = conns_.emplace_back();
      c.fd = std::move(fd);
      c.peer = peer;
      // The whole head must arrive within the timeout, however slowly it trickles in.
      c.deadline = Clock::now() + options_.idleTimeout;
    }
  }

  void serve(Conn& c) {
    try {
      if (c.state == State::kReading)
        readHead(c);
      else if (c.state == State::kWriting)
        writeReply(c);
      else
        drain(c);
    } catch (const std::exception& e) {  // e.g. bad_alloc for a reply: that client only
      log::warn("metrics http: {}: {}", c.peer, e.what());
      c.fd.reset();
    }
  }

  void readHead(Conn& c) {
    char buf[4096];
    for (;;) {
      // Never hold more than one byte past the limit: enough to tell that it is exceeded.
      const std::size_t room = std::min(sizeof(buf), options_.maxHeadBytes + 1 - c.in.size());
      const ssize_t n = ::recv(c.fd.get(), buf, room, 0);
      if (n < 0 && wouldBlock(errno)) return;
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        log::debug("metrics http: {}: {} before its request was complete", c.peer,
                   n == 0 ? std::string("closed") : errnoMessage("recv", errno));
        c.fd.reset();
        return;
      }
      c.in.append(buf, static_cast<std::size_t>(n));
      const std::size_t end = headEnd(c.in);
      if (end != std::string::npos && end <= options_.maxHeadBytes) {
        startReply(c, respond(std::string_view(c.in).substr(0, end), render_, c.peer));
        return;
      }
      if (c.in.size() > options_.maxHeadBytes) {
        log::debug("metrics http: {}: request head over {} bytes", c.peer, options_.maxHeadBytes);
        startReply(c, reply(431, "Request Header Fields Too Large", kTextType,
                            "request head too large\n", true));
        return;
      }
    }
  }

  void startReply(Conn& c, std::string out) {
    c.in.clear();
    c.in.shrink_to_fit();
    c.out = std::move(out);
    c.sent = 0;
    c.state = State::kWriting;
    c.deadline = Clock::now() + options_.idleTimeout;
    writeReply(c);  // most replies fit the socket buffer at once
  }

  void writeReply(Conn& c) {
    while (c.sent < c.out.size()) {
      const ssize_t n = ::send(c.fd.get(), c.out.data() + c.sent, c.out.size() - c.sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (wouldBlock(errno)) return;
        if (errno == EINTR) continue;
        log::debug("metrics http: {}: {}", c.peer, errnoMessage("send", errno));
        c.fd.reset();
        return;
      }
      c.sent += static_cast<std::size_t>(n);
      c.deadline = Clock::now() + options_.idleTimeout;
    }
    // All sent. Half-close and read what the client still sends until it closes: closing with
    // unread bytes (a request body, say) would reset the connection, and a reset can discard
    // the reply before the client has read it. The deadline is not renewed from here on.
    std::string().swap(c.out);
    ::shutdown(c.fd.get(), SHUT_WR);
    c.state = State::kDraining;
  }

  void drain(Conn& c) {
    char buf[4096];
    // A bounded number of reads per wake-up, so that a client that keeps sending cannot hold
    // the thread; the deadline closes it.
    for (int reads = 0; reads < 16; ++reads) {
      const ssize_t n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
      if (n > 0) continue;
      if (n < 0 && wouldBlock(errno)) return;
      if (n < 0 && errno == EINTR) continue;
      c.fd.reset();  // EOF or an error: either way, done
      return;
    }
  }

  std::string host_;
  std::function<std::string()> render_;
  MetricsHttpOptions options_;
  int port_ = 0;
  Fd listen_;
  Fd wake_;
  std::atomic<bool> stop_{false};
  std::vector<Conn> conns_;
  Clock::time_point acceptPausedUntil_;
  std::thread thread_;  // last: starts when everything above exists
};

MetricsHttpServer::MetricsHttpServer(std::string host, int port,
                                     std::function<std::string()> render,
                                     MetricsHttpOptions options)
    : loop_(std::make_unique<Loop>(std::move(host), port, std::move(render), options)) {}

MetricsHttpServer::~MetricsHttpServer() = default;

int MetricsHttpServer::port() const { return loop_->port(); }

std::string MetricsHttpServer::url() const {
  return "http://" + loop_->host() + ":" + std::to_string(loop_->port()) + "/metrics";
}

}  // namespace fsdp
