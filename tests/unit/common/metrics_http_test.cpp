// The metrics HTTP server over real loopback sockets, and the Prometheus text writer.
#include "fsdp/common/metrics_http.hpp"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/prometheus_text.hpp"
#include "raw_socket.hpp"

namespace fsdp {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Every wait in these tests is bounded by this; none should come near it.
constexpr auto kGenerous = 10s;

// A connected socket, closed by its destructor.
class Client {
 public:
  explicit Client(int port, int receiveBuffer = 0)
      : fd_(testing::connectLoopback(static_cast<std::uint16_t>(port), kGenerous, receiveBuffer)) {}
  ~Client() {
    if (fd_ >= 0) ::close(fd_);
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  int fd() const { return fd_; }

  bool send(const std::string& bytes) const {
    std::size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<std::size_t>(n);
    }
    return true;
  }

  // Everything until the server closes (or the receive timeout passes).
  std::string readAll() const {
    std::string out;
    char buf[65536];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return out;
      out.append(buf, static_cast<std::size_t>(n));
    }
  }

 private:
  int fd_;
};

struct Response {
  int status = 0;
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;

  std::string header(const std::string& name) const {
    const auto it = headers.find(name);
    return it == headers.end() ? "(absent)" : it->second;
  }
};

Response parse(const std::string& raw) {
  Response r;
  const std::size_t end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return r;
  r.status = std::stoi(raw.substr(9, 3));
  std::size_t pos = raw.find("\r\n") + 2;
  while (pos < end) {
    const std::size_t eol = raw.find("\r\n", pos);
    const std::string line = raw.substr(pos, eol - pos);
    const std::size_t colon = line.find(':');
    std::string name = line.substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    r.headers[name] = line.substr(line.find_first_not_of(' ', colon + 1));
    pos = eol + 2;
  }
  r.body = raw.substr(end + 4);
  return r;
}

Response request(int port, const std::string& bytes) {
  Client c(port);
  EXPECT_GE(c.fd(), 0);
  EXPECT_TRUE(c.send(bytes));
  return parse(c.readAll());
}

Response get(int port, const std::string& target) {
  return request(port, "GET " + target + " HTTP/1.1\r\nHost: localhost\r\n\r\n");
}

MetricsHttpOptions shortTimeout() { return {.idleTimeout = 300ms}; }

// True when the server has closed `fd` (reset or FIN) within kGenerous, without reading from
// it: a client that does not read must not make the server's reply progress.
bool hangsUpWithoutReading(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  const auto deadline = Clock::now() + kGenerous;
  while (Clock::now() < deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const int ready = ::poll(&p, 1, static_cast<int>(left.count()));
    if (ready > 0) return (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) != 0;
  }
  return false;
}

TEST(MetricsHttp, ServesTheRenderedTextWithThePrometheusContentType) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string("up 1\n"); });
  const Response r = get(server.port(), "/metrics");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.header("content-type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(r.header("content-length"), "5");
  EXPECT_EQ(r.header("connection"), "close");
  EXPECT_EQ(r.body, "up 1\n");
}

TEST(MetricsHttp, AcceptsAQueryStringAndHttp10AndBareNewlines) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string("up 1\n"); });
  EXPECT_EQ(get(server.port(), "/metrics?x=1&y=2").body, "up 1\n");
  EXPECT_EQ(request(server.port(), "GET /metrics HTTP/1.0\r\n\r\n").status, 200);
  EXPECT_EQ(request(server.port(), "GET /metrics HTTP/1.1\nHost: a\n\n").status, 200);
}

TEST(MetricsHttp, HeadGivesTheHeadWithoutTheBody) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string("up 1\n"); });
  const Response r = request(server.port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.header("content-length"), "5");
  EXPECT_EQ(r.body, "");
}

TEST(MetricsHttp, OtherPathsAreNotFound) {
  int renders = 0;
  MetricsHttpServer server("127.0.0.1", 0, [&] { return std::to_string(++renders); });
  for (const char* path : {"/", "/metric", "/metricsx", "/metrics/", "/metrics/x", "/x?/metrics"}) {
    EXPECT_EQ(get(server.port(), path).status, 404) << path;
  }
  EXPECT_EQ(get(server.port(), "/metrics").body, "1");  // render ran for /metrics only
}

TEST(MetricsHttp, OtherMethodsAreNotAllowed) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string("up 1\n"); });
  const Response post =
      request(server.port(), "POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello");
  EXPECT_EQ(post.status, 405);
  EXPECT_EQ(post.header("allow"), "GET, HEAD");
  EXPECT_EQ(request(server.port(), "DELETE /metrics HTTP/1.1\r\n\r\n").status, 405);
}

TEST(MetricsHttp, MalformedOrOversizedRequestsAreRefused) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string("up 1\n"); });
  EXPECT_EQ(request(server.port(), "GET\r\n\r\n").status, 400);
  EXPECT_EQ(request(server.port(), "GET  /metrics HTTP/1.1\r\n\r\n").status, 400);
  EXPECT_EQ(request(server.port(), "GET metrics HTTP/1.1\r\n\r\n").status, 400);
  EXPECT_EQ(request(server.port(), "GET /metrics SPDY/3\r\n\r\n").status, 505);
  // A head over 8 KiB, whether or not it ever ends.
  const std::string big = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(9000, 'a') + "\r\n";
  EXPECT_EQ(request(server.port(), big).status, 431);
  EXPECT_EQ(request(server.port(), big + "\r\n").status, 431);
  EXPECT_EQ(get(server.port(), "/metrics").status, 200);
}

TEST(MetricsHttp, ARenderThatThrowsGives500AndTheServerGoesOn) {
  std::atomic<int> calls{0};
  MetricsHttpServer server("127.0.0.1", 0, [&]() -> std::string {
    if (calls++ == 0) throw std::runtime_error("collector exploded");
    return "up 1\n";
  });
  const Response bad = get(server.port(), "/metrics");
  EXPECT_EQ(bad.status, 500);
  EXPECT_NE(bad.body.find("collector exploded"), std::string::npos);
  const Response good = get(server.port(), "/metrics");
  EXPECT_EQ(good.status, 200);
  EXPECT_EQ(good.body, "up 1\n");
}

TEST(MetricsHttp, PortZeroBindsAFreePortThatTheUrlNames) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string(); });
  ASSERT_GT(server.port(), 0);
  EXPECT_EQ(server.url(), "http://127.0.0.1:" + std::to_string(server.port()) + "/metrics");
  MetricsHttpServer any("", 0, [] { return std::string("any\n"); });
  EXPECT_EQ(any.url(), "http://0.0.0.0:" + std::to_string(any.port()) + "/metrics");
  EXPECT_EQ(get(any.port(), "/metrics").body, "any\n");  // reachable over loopback too
}

TEST(MetricsHttp, ABusyPortThrowsNamingThePortAndTheReason) {
  MetricsHttpServer first("127.0.0.1", 0, [] { return std::string(); });
  const std::string port = std::to_string(first.port());
  try {
    MetricsHttpServer second("127.0.0.1", first.port(), [] { return std::string(); });
    FAIL() << "bound a port in use";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("127.0.0.1:" + port), std::string::npos) << what;
    EXPECT_NE(what.find("in use"), std::string::npos) << what;
  }
  // An address of no interface here (TEST-NET-1).
  EXPECT_THROW(MetricsHttpServer("192.0.2.1", 0, [] { return std::string(); }), Error);
}

TEST(MetricsHttp, AClientThatNeverReadsAHugeReplyHoldsUpNoOneAndIsClosed) {
  std::atomic<int> calls{0};
  MetricsHttpServer server(
      "127.0.0.1", 0,
      [&] { return calls++ == 0 ? std::string(16 << 20, 'x') : std::string("small\n"); },
      shortTimeout());
  Client stalled(server.port(), /*receiveBuffer=*/4096);
  ASSERT_GE(stalled.fd(), 0);
  ASSERT_TRUE(stalled.send("GET /metrics HTTP/1.1\r\n\r\n"));
  pollfd p{stalled.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 10'000), 1);  // its reply has begun: the server is stuck on it, if ever

  const auto start = Clock::now();
  const Response other = get(server.port(), "/metrics");
  EXPECT_EQ(other.status, 200);
  EXPECT_EQ(other.body, "small\n");
  EXPECT_LT(Clock::now() - start, 5s);

  EXPECT_TRUE(hangsUpWithoutReading(stalled.fd()));
  EXPECT_LT(stalled.readAll().size(), std::size_t{16 << 20});  // it never got the whole reply
}

TEST(MetricsHttp, AClientThatLeavesMidReplyDoesNotHurtTheServer) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string(16 << 20, 'x'); });
  {
    Client leaver(server.port());
    ASSERT_TRUE(leaver.send("GET /metrics HTTP/1.1\r\n\r\n"));
    pollfd p{leaver.fd(), POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 10'000), 1);
  }  // closed with the reply unread: the server's next send fails (no SIGPIPE)
  EXPECT_EQ(get(server.port(), "/metrics").body.size(), std::size_t{16 << 20});
}

TEST(MetricsHttp, AClientThatSendsNothingIsClosedAfterTheDeadline) {
  MetricsHttpServer server(
      "127.0.0.1", 0, [] { return std::string("up 1\n"); }, shortTimeout());
  const auto start = Clock::now();
  Client silent(server.port());
  ASSERT_GE(silent.fd(), 0);
  EXPECT_TRUE(testing::closedWithin(silent.fd(), kGenerous));
  EXPECT_GE(Clock::now() - start, 250ms);  // not before its deadline (300 ms after accept)
  EXPECT_EQ(get(server.port(), "/metrics").status, 200);
}

TEST(MetricsHttp, ConnectionsBeyondTheCapAreClosedAndTheRestServed) {
  MetricsHttpServer server("127.0.0.1", 0, [] { return std::string("up 1\n"); },
                           {.idleTimeout = 30s, .maxConnections = 32});
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < 40; ++i) {
    clients.push_back(std::make_unique<Client>(server.port()));
    ASSERT_GE(clients.back()->fd(), 0);
  }
  // Exactly 8 are hung up on, unasked; wait for them.
  std::vector<bool> closed(clients.size(), false);
  int closedCount = 0;
  const auto deadline = Clock::now() + kGenerous;
  while (closedCount < 8 && Clock::now() < deadline) {
    std::vector<pollfd> fds;
    for (std::size_t i = 0; i < clients.size(); ++i) {
      fds.push_back({closed[i] ? -1 : clients[i]->fd(), POLLIN, 0});
    }
    ASSERT_GT(::poll(fds.data(), fds.size(), 10'000), 0);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents != 0 && !closed[i]) {
        closed[i] = true;
        ++closedCount;
        EXPECT_TRUE(clients[i]->readAll().empty());
      }
    }
  }
  ASSERT_EQ(closedCount, 8);
  for (std::size_t i = 0; i < clients.size(); ++i) {
    if (closed[i]) continue;
    ASSERT_TRUE(clients[i]->send("GET /metrics HTTP/1.1\r\n\r\n"));
    EXPECT_EQ(parse(clients[i]->readAll()).status, 200) << "client " << i;
  }
  EXPECT_EQ(get(server.port(), "/metrics").status, 200);
}

TEST(MetricsHttp, TheDestructorReturnsPromptlyWithClientsConnected) {
  auto server = std::make_unique<MetricsHttpServer>("127.0.0.1", 0,
                                                    [] { return std::string(16 << 20, 'x'); });
  Client silent(server->port());
  Client stalled(server->port(), /*receiveBuffer=*/4096);
  ASSERT_TRUE(stalled.send("GET /metrics HTTP/1.1\r\n\r\n"));
  pollfd p{stalled.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 10'000), 1);
  const auto start = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - start, 2s);  // ~100 ms is the goal; seconds is what a loaded CI proves
  EXPECT_TRUE(testing::closedWithin(silent.fd(), kGenerous));
  EXPECT_TRUE(hangsUpWithoutReading(stalled.fd()));
}

// ---- Prometheus text ------------------------------------------------------------------------

TEST(PrometheusText, WritesAGoldenText) {
  prom::TextWriter w;
  w.family("fsdp_steps", "counter", "Training steps done.");
  w.sample("fsdp_steps_total", {{"rank", "0"}}, 12);
  w.sample("fsdp_steps_total", {{"rank", "1"}}, 12);
  w.family("fsdp_loss", "gauge", "Loss of the last step.");
  w.sample({}, 0.125);
  w.family("fsdp_up", "gauge", "1 while the job runs.");
  w.sample({{"job", "mnist"}, {"node", "n1"}}, 1);
  EXPECT_EQ(w.take(),
            "# HELP fsdp_steps Training steps done.\n"
            "# TYPE fsdp_steps counter\n"
            "fsdp_steps_total{rank=\"0\"} 12\n"
            "fsdp_steps_total{rank=\"1\"} 12\n"
            "# HELP fsdp_loss Loss of the last step.\n"
            "# TYPE fsdp_loss gauge\n"
            "fsdp_loss 0.125\n"
            "# HELP fsdp_up 1 while the job runs.\n"
            "# TYPE fsdp_up gauge\n"
            "fsdp_up{job=\"mnist\",node=\"n1\"} 1\n");
  EXPECT_EQ(w.take(), "");
  w.family("fsdp_up", "gauge", "again, after take()");  // take() forgets the families
}

TEST(PrometheusText, EscapesLabelValuesAndHelp) {
  EXPECT_EQ(prom::escapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(prom::escapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");
  prom::TextWriter w;
  w.family("m", "gauge", "line one\nline \\two");
  w.sample({{"path", "C:\\x \"y\"\n"}}, 2);
  EXPECT_EQ(w.take(),
            "# HELP m line one\\nline \\\\two\n# TYPE m gauge\n"
            "m{path=\"C:\\\\x \\\"y\\\"\\n\"} 2\n");
}

TEST(PrometheusText, FormatsIntegersPlainlyAndOtherValuesShortest) {
  EXPECT_EQ(prom::formatValue(0), "0");
  EXPECT_EQ(prom::formatValue(-0.0), "0");
  EXPECT_EQ(prom::formatValue(42), "42");
  EXPECT_EQ(prom::formatValue(-7), "-7");
  EXPECT_EQ(prom::formatValue(1e15), "1000000000000000");
  EXPECT_EQ(prom::formatValue(9007199254740991.0), "9007199254740991");  // 2^53 - 1
  EXPECT_EQ(prom::formatValue(0.1), "0.1");
  EXPECT_EQ(prom::formatValue(1.5e-7), "1.5e-07");
  EXPECT_EQ(std::stod(prom::formatValue(1e300)), 1e300);
  EXPECT_EQ(std::stod(prom::formatValue(2.0 / 3.0)), 2.0 / 3.0);
  EXPECT_EQ(prom::formatValue(std::nan("")), "NaN");
  EXPECT_EQ(prom::formatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(prom::formatValue(-std::numeric_limits<double>::infinity()), "-Inf");
}

TEST(PrometheusText, BadNamesAndMisuseThrow) {
  EXPECT_TRUE(prom::isValidMetricName("a:b_c9"));
  EXPECT_TRUE(prom::isValidLabelName("_x9"));
  prom::TextWriter w;
  EXPECT_THROW(w.sample({}, 1), std::logic_error);  // before any family
  EXPECT_THROW(w.family("", "gauge", ""), std::invalid_argument);
  EXPECT_THROW(w.family("9lives", "gauge", ""), std::invalid_argument);
  EXPECT_THROW(w.family("a-b", "gauge", ""), std::invalid_argument);
  EXPECT_THROW(w.family("ok", "gauges", ""), std::invalid_argument);
  w.family("ok", "gauge", "");
  EXPECT_THROW(w.family("ok", "counter", ""), std::logic_error);
  EXPECT_THROW(w.sample({{"a:b", "v"}}, 1), std::invalid_argument);
  EXPECT_THROW(w.sample({{"1a", "v"}}, 1), std::invalid_argument);
  EXPECT_THROW(w.sample({{"", "v"}}, 1), std::invalid_argument);
  EXPECT_THROW(w.sample({{"a", "1"}, {"a", "2"}}, 1), std::invalid_argument);
  EXPECT_THROW(w.sample("other_total", {}, 1), std::invalid_argument);
  EXPECT_THROW(w.sample("ok total", {}, 1), std::invalid_argument);
  EXPECT_EQ(w.take(), "# HELP ok \n# TYPE ok gauge\n");  // nothing half-written
}

}  // namespace
}  // namespace fsdp
