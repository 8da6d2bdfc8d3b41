#include "fsdp/rendezvous/store_server.hpp"

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <future>
#include <list>
#include <thread>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/rendezvous/kv_store.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;
constexpr auto kUseAwaitable = asio::use_awaitable;

namespace {

// Reads exactly buffer.size() bytes before `deadline`; throws TimeoutError when the timer
// wins and boost::system::system_error on socket errors (EOF included).
awaitable<void> readWithDeadline(tcp::socket& socket, asio::mutable_buffer buffer,
                                 asio::steady_timer::time_point deadline, const char* what) {
  asio::steady_timer timer(socket.get_executor(), deadline);
  auto result = co_await (asio::async_read(socket, buffer, kUseAwaitable) ||
                          timer.async_wait(kUseAwaitable));
  if (result.index() == 1) throw TimeoutError(std::string("timed out reading ") + what);
}

awaitable<void> writeWithDeadline(tcp::socket& socket, const std::vector<std::uint8_t>& bytes,
                                  asio::steady_timer::time_point deadline) {
  asio::steady_timer timer(socket.get_executor(), deadline);
  auto result = co_await (asio::async_write(socket, asio::buffer(bytes), kUseAwaitable) ||
                          timer.async_wait(kUseAwaitable));
  if (result.index() == 1) throw TimeoutError("timed out writing a reply");
}

std::string peerName(const tcp::socket& socket) {
  boost::system::error_code ec;
  const auto ep = socket.remote_endpoint(ec);
  if (ec) return "unknown peer";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

}  // namespace

struct StoreServer::Impl {
  ServerOptions options;
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  KvStore store;
  StoreService service{store};
  ServerStats stats;
  std::list<tcp::socket*> sockets;  // open sessions, closed on stop()
  std::thread thread;
  bool stopped = false;

  awaitable<void> accept() {
    for (;;) {
      auto [ec, socket] = co_await acceptor.async_accept(asio::as_tuple(kUseAwaitable));
      if (ec == asio::error::operation_aborted) co_return;
      if (ec) {
        // e.g. EMFILE: log and keep accepting; the listener must survive.
        log::warn("store server: accept failed: {}", ec.message());
        asio::steady_timer pause(io, std::chrono::milliseconds(10));
        co_await pause.async_wait(asio::as_tuple(kUseAwaitable));
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);
      ++stats.connectionsAccepted;
      asio::co_spawn(io, session(std::move(socket)), [](std::exception_ptr e) {
        // session() handles what it expects; anything else ends that session only.
        if (!e) return;
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          log::error("store server: session ended by an unexpected error: {}", ex.what());
        }
      });
    }
  }

  awaitable<void> session(tcp::socket socket) {
    const std::string peer = peerName(socket);
    ++stats.connectionsOpen;
    auto self = sockets.insert(sockets.end(), &socket);
    try {
      for (;;) {
        std::array<std::uint8_t, kHeaderSize> header{};
        // Wait for the first byte without a deadline (idle is normal), the rest with one.
        co_await asio::async_read(socket, asio::buffer(header.data(), 1), kUseAwaitable);
        const auto frameDeadline = asio::steady_timer::clock_type::now() + options.frameTimeout;
        co_await readWithDeadline(socket, asio::buffer(header.data() + 1, kHeaderSize - 1),
                                  frameDeadline, "a frame header");
        const Header h = decodeHeader(header, options.limits);
        std::vector<std::uint8_t> body(h.bodyLength);
        co_await readWithDeadline(socket, asio::buffer(body), frameDeadline, "a frame body");
        const Request req = decodeRequest(h.op, body, options.limits);
        Response resp = co_await answer(req);
        ++stats.requestsServed;
        co_await writeWithDeadline(socket, encodeResponse(h.op, resp),
                                   asio::steady_timer::clock_type::now() + options.frameTimeout);
      }
    } catch (const ProtocolError& e) {
      ++stats.protocolErrors;
      log::warn("store server: closing connection from {}: protocol error: {}", peer, e.what());
    } catch (const TimeoutError& e) {
      log::warn("store server: closing connection from {}: {}", peer, e.what());
    } catch (const boost::system::system_error& e) {
      if (e.code() != asio::error::eof && e.code() != asio::error::operation_aborted &&
          e.code() != asio::error::connection_reset) {
        log::warn("store server: connection from {} failed: {}", peer, e.code().message());
      }
    }
    sockets.erase(self);
    --stats.connectionsOpen;
  }

  // Answers one request; parks it server side while it has to wait.
  awaitable<Response> answer(const Request& req) {
    const auto deadline =
        asio::steady_timer::clock_type::now() + std::chrono::milliseconds(req.timeoutMs);
    for (;;) {
      std::optional<Response> resp;
      try {
        resp = service.tryHandle(req);
      } catch (const ProtocolError& e) {
        // A semantic error (ADD on a non-integer) is the client's problem, not the link's.
        co_return Response{Status::kError, 0, e.what(), {}};
      }
      if (resp) co_return std::move(*resp);
      if (asio::steady_timer::clock_type::now() >= deadline) {
        Response timeout{Status::kTimeout, 0, {}, {}};
        for (const auto& key : req.keys) {
          if (!store.contains(key)) timeout.value += (timeout.value.empty() ? "" : ", ") + key;
        }
        co_return timeout;
      }
      asio::steady_timer timer(io, deadline);
      const auto id = store.watch(req.keys, [&timer] { timer.cancel(); });
      co_await timer.async_wait(asio::as_tuple(kUseAwaitable));
      store.unwatch(id);
      if (stopped) throw boost::system::system_error(asio::error::operation_aborted);
    }
  }
};

StoreServer::StoreServer(ServerOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  const std::string where = impl_->options.host + ":" + std::to_string(impl_->options.port);
  try {
    const auto address = asio::ip::make_address(impl_->options.host);
    const tcp::endpoint endpoint(address, impl_->options.port);
    impl_->acceptor.open(endpoint.protocol());
    impl_->acceptor.set_option(tcp::acceptor::reuse_address(true));
    impl_->acceptor.bind(endpoint);
    impl_->acceptor.listen(asio::socket_base::max_listen_connections);
  } catch (const boost::system::system_error& e) {
    throw NetworkError("store server: cannot listen on " + where + ": " + e.code().message(), where);
  }
  asio::co_spawn(impl_->io, impl_->accept(), [](std::exception_ptr e) {
    if (e) std::rethrow_exception(e);
  });
  impl_->thread = std::thread([impl = impl_.get()] { impl->io.run(); });
  log::debug("store server listening on {}:{}", impl_->options.host, port());
}

StoreServer::~StoreServer() { stop(); }

std::uint16_t StoreServer::port() const { return impl_->acceptor.local_endpoint().port(); }

const std::string& StoreServer::host() const { return impl_->options.host; }

void StoreServer::stop() {
  if (!impl_->thread.joinable()) return;
  asio::post(impl_->io, [impl = impl_.get()] {
    impl->stopped = true;
    boost::system::error_code ec;
    impl->acceptor.close(ec);
    for (auto* socket : impl->sockets) socket->close(ec);
    impl->io.stop();
  });
  impl_->thread.join();
}

ServerStats StoreServer::stats() const {
  if (!impl_->thread.joinable()) return impl_->stats;
  std::promise<ServerStats> result;
  asio::post(impl_->io, [&] { result.set_value(impl_->stats); });
  return result.get_future().get();
}

}  // namespace fsdp::rendezvous
