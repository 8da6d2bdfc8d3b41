#include "fsdp/rendezvous/store_proxy.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <functional>
#include <future>
#include <optional>
#include <thread>
#include <unordered_map>

#include "connection.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;

namespace {

// A client's replies waiting beyond this many bytes: it does not read them; it is closed.
constexpr std::size_t kMaxQueuedBytes = 256u << 20;


}  // namespace

// Sends what the socket takes at once; queues the rest for a writer started on demand.
class ProxyOutbox {
 public:
  explicit ProxyOutbox(tcp::socket& socket) : socket_(socket) {}

  // False when the socket failed or the queue is over its bound (the caller closes). `owner`
  // is kept alive until the queue is written (a client; nothing for the server connection,
  // which lives as long as the loop).
  bool write(std::vector<std::uint8_t> bytes, std::shared_ptr<void> owner) {
    if (bytes.empty()) return true;
    if (queued_.empty() && !writing_) {
      boost::system::error_code ec;
      const std::size_t n = socket_.write_some(asio::buffer(bytes), ec);
      if (!ec && n == bytes.size()) return true;
      if (ec && ec != asio::error::would_block && ec != asio::error::try_again) return false;
      bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    }
    queued_.insert(queued_.end(), bytes.begin(), bytes.end());
    if (queued_.size() > maxQueued) return false;
    if (!writing_) {
      writing_ = true;
      asio::co_spawn(socket_.get_executor(), drain(std::move(owner)), asio::detached);
    }
    return true;
  }
  bool writing() const { return writing_; }
  // Bytes given to write() and not written yet.
  std::size_t unwritten() const { return queued_.size() + inFlight_; }
  std::function<void()> onDrained;  // called when a writer finished (or failed)
  std::size_t maxQueued = kMaxQueuedBytes;  // past this, write() fails
  // What is queued must be written within this (0: no bound), else onStalled is called and
  // the rest dropped.
  std::chrono::milliseconds writeTimeout{0};
  std::function<void()> onStalled;

 private:
  awaitable<void> drain([[maybe_unused]] std::shared_ptr<void> owner) {
    while (!queued_.empty()) {
      auto batch = std::exchange(queued_, {});
      inFlight_ = batch.size();
      boost::system::error_code ec;
      if (writeTimeout.count() > 0) {
        asio::steady_timer timer(socket_.get_executor(), writeTimeout);
        auto result = co_await (
            asio::async_write(socket_, asio::buffer(batch), asio::as_tuple(kUseAwaitable)) ||
            timer.async_wait(asio::as_tuple(kUseAwaitable)));
        if (result.index() == 1) {
          inFlight_ = 0;
          queued_.clear();
          if (onStalled) onStalled();
          break;
        }
        ec = std::get<0>(std::get<0>(result));
      } else {
        std::tie(ec, std::ignore) = co_await asio::async_write(socket_, asio::buffer(batch),
                                                               asio::as_tuple(kUseAwaitable));
      }
      inFlight_ = 0;
      if (ec) {
        queued_.clear();
        break;
      }
    }
    writing_ = false;
    if (onDrained) onDrained();
  }
  tcp::socket& socket_;
  std::vector<std::uint8_t> queued_;
  std::size_t inFlight_ = 0;
  bool writing_ = false;
};

namespace {

std::vector<std::uint8_t> endStreamFrame(std::uint16_t stream) {
  auto frame = encodeRequest({.op = Op::kEndStream});
  setFrameStream(frame, stream);
  return frame;
}

}  // namespace

// One local client: a stream of the server connection.
struct ProxyClient : std::enable_shared_from_this<ProxyClient> {
  ProxyClient(tcp::socket s, std::uint16_t number) : socket(std::move(s)), stream(number), out(socket) {}
  tcp::socket socket;
  std::uint16_t stream;
  ProxyOutbox out;
  bool closed = false;
  bool endedByServer = false;  // the server said END_STREAM: its number is free again
  bool closeWhenDrained = false;

  void close() {
    if (closed) return;
    closed = true;
    boost::system::error_code ec;
    socket.close(ec);
  }
  void send(std::vector<std::uint8_t> frame) {
    if (closed) return;
    if (!out.write(std::move(frame), shared_from_this())) {
      if (out.unwritten() > out.maxQueued) {
        log::warn("store proxy: closing local client of stream {}: {} bytes of replies unread",
                  stream, out.unwritten());
        ++*slowReadersClosed;
      }
      close();
    }
  }
  // The reader waits here while the client's unread replies are over the bound.
  asio::steady_timer* room = nullptr;
  std::uint64_t* slowReadersClosed = nullptr;  // the proxy's counter
  void closeAfterFlush() {
    if (!out.writing()) {
      close();
    } else {
      closeWhenDrained = true;
    }
  }
};

struct StoreProxy::Impl {
  ProxyOptions options;
  asio::io_context io{1};
  // Keeps run() going after the server was lost (nothing else left to wait for), so that
  // stats() and stop() are still served.
  asio::executor_work_guard<asio::io_context::executor_type> keepRunning{io.get_executor()};
  tcp::acceptor acceptor{io};
  tcp::socket server{io};
  ProxyOutbox serverOut{server};
  std::vector<std::uint8_t> pendingUp;  // client frames of this turn of the loop
  bool flushPosted = false;
  // Stream numbers in use: a client's from its accept until the server's END_STREAM.
  std::unordered_map<std::uint16_t, std::shared_ptr<ProxyClient>> streams;
  std::uint16_t nextStream = 1;
  std::uint16_t port = 0;
  ProxyStats stats;
  bool stopped = false;
  std::thread thread;

  // Frames from every client in one turn of the loop leave in one write.
  void sendUp(std::vector<std::uint8_t> frame) {
    if (stopped) return;
    ++stats.framesUp;
    pendingUp.insert(pendingUp.end(), frame.begin(), frame.end());
    if (flushPosted) return;
    flushPosted = true;
    asio::post(io, [this] {
      flushPosted = false;
      if (!stopped && !serverOut.write(std::exchange(pendingUp, {}), nullptr)) {
        serverLost("write failed");
      }
    });
  }

  std::optional<std::uint16_t> allocate() {
    for (int tries = 0; tries < 65535; ++tries) {
      const std::uint16_t n = nextStream;
      nextStream = nextStream == 65535 ? 1 : static_cast<std::uint16_t>(nextStream + 1);
      if (!streams.contains(n)) return n;
    }
    return std::nullopt;
  }

  void serverLost(const std::string& why) {
    if (stopped) return;
    log::error("store proxy: lost the store server {}:{} ({}): closing its {} local clients",
               options.serverHost, options.serverPort, why, stats.clientsOpen);
    stats.serverConnected = false;
    shutdown();
  }

  void shutdown() {
    stopped = true;
    boost::system::error_code ec;
    acceptor.close(ec);
    server.close(ec);
    for (auto& [n, client] : streams) client->close();
  }

  awaitable<void> accept() {
    for (;;) {
      auto [ec, socket] = co_await acceptor.async_accept(asio::as_tuple(kUseAwaitable));
      if (stopped) co_return;
      if (ec) {
        if (ec == asio::error::operation_aborted) co_return;
        log::warn("store proxy: accept failed: {}", ec.message());
        asio::steady_timer pause(io, std::chrono::milliseconds(10));
        co_await pause.async_wait(asio::as_tuple(kUseAwaitable));
        continue;
      }
      const auto number = allocate();
      if (!number) {
        log::warn("store proxy: refusing a client: 65,535 streams in use");
        continue;
      }
      ++stats.clientsAccepted;
      ++stats.clientsOpen;
      boost::system::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      socket.non_blocking(true, ignored);
      auto client = std::make_shared<ProxyClient>(std::move(socket), *number);
      client->out.onDrained = [c = client.get()] {
        if (c->closeWhenDrained) c->close();
        if (c->room != nullptr) c->room->cancel();
      };
      // A client that reads its replies slower than this is not reading them.
      client->out.maxQueued = 4 * options.maxUnreadBytes + options.limits.maxValueBytes;
      client->out.writeTimeout = options.unreadTimeout;
      client->slowReadersClosed = &stats.slowReadersClosed;
      client->out.onStalled = [this, c = client.get()] {
        log::warn("store proxy: closing local client of stream {}: it read none of its replies "
                  "for {} ms",
                  c->stream, options.unreadTimeout.count());
        ++stats.slowReadersClosed;
        c->close();
      };
      streams.emplace(*number, client);
      asio::co_spawn(io, serveClient(client), asio::detached);
    }
  }

  // Forwards one client's frames, each stamped with its stream.
  awaitable<void> serveClient(std::shared_ptr<ProxyClient> client) {
    bool opened = false;
    try {
      for (;;) {
        if (client->out.unwritten() > options.maxUnreadBytes && !client->closed) {
          asio::steady_timer room(io, options.unreadTimeout);
          client->room = &room;
          auto [ec] = co_await room.async_wait(asio::as_tuple(kUseAwaitable));
          client->room = nullptr;
          if (!ec && client->out.unwritten() > options.maxUnreadBytes) {
            log::warn("store proxy: closing local client of stream {}: it read none of its {} "
                      "bytes of replies for {} ms",
                      client->stream, client->out.unwritten(), options.unreadTimeout.count());
            ++stats.slowReadersClosed;
            break;
          }
        }
        std::vector<std::uint8_t> frame(kHeaderSize);
        co_await asio::async_read(client->socket, asio::buffer(frame), kUseAwaitable);
        Header h;
        try {
          h = decodeHeader(frame, options.limits);
        } catch (const ProtocolError& e) {
          throw ProtocolError(std::string(e.what()) +
                              " (the node's store proxy speaks fsdprun's protocol only; PyTorch's "
                              "TCPStore clients connect to MASTER_ADDR:MASTER_PORT)");
        }
        if (h.stream != 0 || h.op == Op::kMux || h.op == Op::kEndStream) {
          throw ProtocolError(opName(h.op) + " on stream " + std::to_string(h.stream) +
                              ": a client of the proxy cannot multiplex");
        }
        // The server opens a stream with its HELLO and drops anything else on a number it does
        // not have: a client that starts otherwise would wait for an answer forever.
        if (!opened && h.op != Op::kHello) throw ProtocolError(opName(h.op) + " before HELLO");
        frame.resize(kHeaderSize + h.bodyLength);
        co_await asio::async_read(client->socket, asio::buffer(frame.data() + kHeaderSize, h.bodyLength),
                                  kUseAwaitable);
        if (client->closed || stopped) break;
        if (!opened) {
          decodeRequest(h.op, std::span(frame.data() + kHeaderSize, h.bodyLength), options.limits);
          opened = true;
        }
        setFrameStream(frame, client->stream);
        sendUp(std::move(frame));
      }
    } catch (const ProtocolError& e) {
      ++stats.protocolErrors;
      log::warn("store proxy: closing local client of stream {}: protocol error: {}", client->stream,
                e.what());
    } catch (const boost::system::system_error&) {
      // the client went away (or was closed)
    }
    --stats.clientsOpen;
    client->close();
    if (!opened) {
      // Nothing of it reached the server, which would drop an END_STREAM for a stream it does
      // not have and never acknowledge it: the number is free at once.
      streams.erase(client->stream);
    } else if (!client->endedByServer) {
      // Its number stays taken until the server's END_STREAM, after which nothing more of the
      // old stream can arrive.
      sendUp(endStreamFrame(client->stream));
    }
  }

  // Hands the server's frames to their streams' clients.
  awaitable<void> readServer() {
    std::string why = "connection closed";
    try {
      for (;;) {
        std::vector<std::uint8_t> frame(kHeaderSize);
        co_await asio::async_read(server, asio::buffer(frame), kUseAwaitable);
        const Header h = decodeHeader(frame, options.limits);
        frame.resize(kHeaderSize + h.bodyLength);
        co_await asio::async_read(server, asio::buffer(frame.data() + kHeaderSize, h.bodyLength),
                                  kUseAwaitable);
        const auto it = streams.find(h.stream);
        if (h.stream == 0 || it == streams.end()) continue;  // nothing of ours waits on stream 0
        const auto client = it->second;
        if (h.op == Op::kEndStream) {
          client->endedByServer = true;
          client->closeAfterFlush();
          streams.erase(it);
          continue;
        }
        ++stats.framesDown;
        setFrameStream(frame, 0);
        client->send(std::move(frame));
      }
    } catch (const ProtocolError& e) {
      why = std::string("protocol error: ") + e.what();
    } catch (const boost::system::system_error& e) {
      why = e.code().message();
    }
    serverLost(why);
  }
};

StoreProxy::StoreProxy(ProxyOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  const auto& o = impl_->options;
  // The handshake and MUX are synchronous: the proxy exists only once the server took it.
  auto connection = detail::Connection::open({.host = o.serverHost,
                                              .port = o.serverPort,
                                              .connectTimeout = o.connectTimeout,
                                              .runId = o.runId,
                                              .token = o.token,
                                              .limits = o.limits});
  connection.call({.op = Op::kMux}, Deadline::after(o.connectTimeout));
  const int fd = connection.release();
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
  boost::system::error_code ec;
  impl_->server.assign(local.ss_family == AF_INET6 ? tcp::v6() : tcp::v4(), fd, ec);
  if (ec) {
    ::close(fd);
    throw NetworkError("store proxy: " + ec.message(), o.serverHost);
  }
  impl_->server.non_blocking(true, ec);
  const std::string where = o.host + ":" + std::to_string(o.port);
  try {
    const tcp::endpoint endpoint(asio::ip::make_address(o.host), o.port);
    impl_->acceptor.open(endpoint.protocol());
    impl_->acceptor.set_option(tcp::acceptor::reuse_address(true));
    impl_->acceptor.bind(endpoint);
    impl_->acceptor.listen(asio::socket_base::max_listen_connections);
    reserveDescriptorTable(kDescriptorSlots);
    impl_->port = impl_->acceptor.local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    throw NetworkError("store proxy: cannot listen on " + where + ": " + e.code().message(), where);
  }
  asio::co_spawn(impl_->io, impl_->accept(), asio::detached);
  asio::co_spawn(impl_->io, impl_->readServer(), asio::detached);
  impl_->thread = std::thread([impl = impl_.get()] { impl->io.run(); });
  log::debug("store proxy on {}:{} for the store server {}:{}", o.host, port(), o.serverHost,
             o.serverPort);
}

StoreProxy::~StoreProxy() { stop(); }

std::uint16_t StoreProxy::port() const { return impl_->port; }

void StoreProxy::stop() {
  if (!impl_->thread.joinable()) return;
  asio::post(impl_->io, [impl = impl_.get()] {
    impl->shutdown();
    impl->keepRunning.reset();
    impl->io.stop();
  });
  impl_->thread.join();
}

ProxyStats StoreProxy::stats() const {
  const auto snapshot = [impl = impl_.get()] {
    ProxyStats s = impl->stats;
    s.streamsInUse = impl->streams.size();
    return s;
  };
  if (!impl_->thread.joinable()) return snapshot();
  std::promise<ProxyStats> result;
  asio::post(impl_->io, [&] { result.set_value(snapshot()); });
  return result.get_future().get();
}

}  // namespace fsdp::rendezvous
