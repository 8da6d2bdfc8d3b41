#pragma once
// A small HTTP/1.1 server for Prometheus scrapes: GET /metrics, nothing else. One thread,
// poll() over non-blocking sockets, so that no client (silent, slow, or one that never reads)
// can hold up the others or the owner.

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace fsdp {

struct MetricsHttpOptions {
  // A client is closed when its request head has not arrived this long after it connected,
  // or when its reply has made no progress (nothing sent) for this long; both are closed with
  // a reset. A client sent its whole reply gets this long again to close its end.
  std::chrono::milliseconds idleTimeout = std::chrono::seconds(5);
  // Connections open at once. A client accepted beyond it takes the place of one whose reply
  // is all sent (the server waits for those to close, a little, so as not to reset them);
  // without such a one, it is closed at once, unanswered, so that it learns at once (rather
  // than waiting in the listen backlog for a slot).
  int maxConnections = 32;
  // A request head (request line and headers) longer than this gets 431 and a close.
  std::size_t maxHeadBytes = 8 * 1024;
};

// Serves GET /metrics with the text `render` returns ("text/plain; version=0.0.4;
// charset=utf-8"); HEAD /metrics gives the same head without the body. A query string is
// ignored. Any other path is 404, any other method on /metrics 405, a malformed request 400.
// Every reply carries "Connection: close" and the connection closes after it.
//
// `render` is called on the server thread, once per GET or HEAD /metrics; it must be safe to
// call from that thread while the owner goes on. When it throws, the reply is 500 with the
// exception's message as the body, and the server goes on. The thread never throws; client
// mishaps are logged at debug, a failing render at warn.
//
// The public members are safe to call from any thread.
class MetricsHttpServer {
 public:
  // Binds host:port (port 0: a free port; host "" or "0.0.0.0": every IPv4 interface; else an
  // IPv4 address or a name that resolves to one), listens and starts the thread. Throws
  // fsdp::Error naming host:port and the reason ("cannot serve metrics on 0.0.0.0:9400:
  // Address already in use"), std::invalid_argument on a port outside [0, 65535] or an empty
  // `render`.
  MetricsHttpServer(std::string host, int port, std::function<std::string()> render,
                    MetricsHttpOptions options = {});
  // Stops the thread and closes every connection. Returns within milliseconds, unless a
  // render() is under way: that one is waited for.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (the one chosen when 0 was asked for).
  int port() const;
  // "http://host:port/metrics" with the bound port; host as given, "" shown as "0.0.0.0".
  std::string url() const;

 private:
  class Loop;
  std::unique_ptr<Loop> loop_;
};

}  // namespace fsdp
