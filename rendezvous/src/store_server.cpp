// The store server's front: binding, accepting connections, starting and stopping the loop.
// What happens on a connection is in server/ (see server/server_state.hpp).
#include "fsdp/rendezvous/store_server.hpp"

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <future>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "server/server_state.hpp"
#include "session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;
using detail::TimePoint;

awaitable<void> readExact(tcp::socket& socket, asio::mutable_buffer buffer, TimePoint deadline,
                          const char* what) {
  boost::system::error_code ec;
  std::size_t got = 0;
  while (got < buffer.size()) {
    const std::size_t n = socket.read_some(buffer + got, ec);
    got += n;
    if (ec == asio::error::would_block || ec == asio::error::try_again) break;
    if (ec) throw boost::system::system_error(ec);
  }
  if (got == buffer.size()) co_return;
  asio::steady_timer timer(socket.get_executor(), deadline);
  auto result = co_await (asio::async_read(socket, buffer + got, kUseAwaitable) ||
                          timer.async_wait(kUseAwaitable));
  if (result.index() == 1) throw TimeoutError(std::string("timed out reading ") + what);
}

awaitable<void> StoreServer::Impl::accept() {
  boost::system::error_code ec;
  acceptor.non_blocking(true, ec);
  for (;;) {
    // Wait until connections are queued, then take every one of them: when thousands of
    // ranks connect at once, a slow drain overflows the listen backlog and each dropped SYN
    // costs its client a one-second retransmit.
    auto [waitError] =
        co_await acceptor.async_wait(tcp::acceptor::wait_read, asio::as_tuple(kUseAwaitable));
    if (waitError == asio::error::operation_aborted || stopped) co_return;
    for (int taken = 1;; ++taken) {
      // A connection storm must not starve the connections already served: after a batch,
      // what else is ready runs before the next.
      if (taken % 32 == 0) co_await asio::post(io, kUseAwaitable);
      if (stopped) co_return;
      tcp::socket socket(io);
      acceptor.accept(socket, ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) break;
      if (ec) {
        // e.g. EMFILE: log and keep accepting; the listener must survive.
        log::warn("store server: accept failed: {}", ec.message());
        asio::steady_timer pause(io, std::chrono::milliseconds(10));
        co_await pause.async_wait(asio::as_tuple(kUseAwaitable));
        break;
      }
      ++stats.connectionsAccepted;
      if (options.maxConnections > 0 && sessions.size() >= options.maxConnections) {
        log::warn(
            "store server: refusing connection from {}: {} connections open (--max_connections)",
            peerName(socket), sessions.size());
        socket.close(ec);
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);
      auto session = std::make_shared<Session>(*this, std::move(socket));
      asio::co_spawn(io, session->run(),
                     [session](std::exception_ptr e) { logCoroutineError("a session", e); });
    }
  }
}

StoreServer::StoreServer(ServerOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->allowPytorch = impl_->options.allowPytorchClients.value_or(impl_->options.token.empty());
  const std::string where = impl_->options.host + ":" + std::to_string(impl_->options.port);
  try {
    const auto address = asio::ip::make_address(impl_->options.host);
    const tcp::endpoint endpoint(address, impl_->options.port);
    impl_->acceptor.open(endpoint.protocol());
    impl_->acceptor.set_option(tcp::acceptor::reuse_address(true));
    impl_->acceptor.bind(endpoint);
    impl_->acceptor.listen(asio::socket_base::max_listen_connections);
    reserveDescriptorTable(kDescriptorSlots);
  } catch (const boost::system::system_error& e) {
    throw NetworkError("store server: cannot listen on " + where + ": " + e.code().message(),
                       where);
  }
  asio::co_spawn(impl_->io, impl_->accept(),
                 [](std::exception_ptr e) { logCoroutineError("accepting", e); });
  asio::co_spawn(impl_->io, impl_->sweepRuns(),
                 [](std::exception_ptr e) { logCoroutineError("the run sweeper", e); });
  impl_->thread = std::thread([impl = impl_.get()] { impl->io.run(); });
  log::debug("store server listening on {}:{}", impl_->options.host, port());
}

StoreServer::~StoreServer() { stop(); }

std::uint16_t StoreServer::port() const { return impl_->acceptor.local_endpoint().port(); }

const std::string& StoreServer::host() const { return impl_->options.host; }

void StoreServer::stop() {
  if (!impl_->thread.joinable()) return;
  asio::post(impl_->io, [impl = impl_.get()] {
    boost::system::error_code ec;
    impl->acceptor.close(ec);
    for (auto& [id, run] : impl->runs)
      impl->deliver(*run, run->rounds.close("server shutting down"));
    impl->stopped = true;
    impl->sweep.cancel();
    bool flushing = false;
    for (auto& [id, session] : impl->sessions) {
      flushing = flushing || session->writing();
      session->closeAfterFlush();
    }
    const auto finish = [impl] {
      for (auto& [id, session] : impl->sessions) session->close();
      for (auto& [id, run] : impl->runs) run->tick->cancel();
      impl->io.stop();
    };
    if (!flushing) {
      finish();  // every goodbye already left (the usual case): no reason to wait
      return;
    }
    // Give queued goodbyes a moment to leave, then close whatever is still open.
    auto timer = std::make_shared<asio::steady_timer>(impl->io, std::chrono::milliseconds(200));
    timer->async_wait([timer, finish](boost::system::error_code) { finish(); });
  });
  impl_->thread.join();
}

ServerStats StoreServer::stats() const {
  if (!impl_->thread.joinable()) return impl_->stats;
  // Bounded: a loop that is stopping runs no more handlers, and a caller (a /metrics scrape) must
  // not wait on it forever.
  auto result = std::make_shared<std::promise<ServerStats>>();
  auto future = result->get_future();
  asio::post(impl_->io, [this, result] {
    ServerStats snapshot = impl_->stats;
    snapshot.runs = impl_->runs.size();
    snapshot.queuedBytes = impl_->queuedBytes;
    for (const auto& [id, run] : impl_->runs) {
      snapshot.perRun.push_back({.id = id, .round = run->rounds.round(), .restarts = run->rounds.restartCount(),
                                 .members = run->rounds.memberCount(), .waiting = run->rounds.waitingCount(),
                                 .sessions = run->sessions, .keys = run->store.size(),
                                 .keyBytes = run->store.bytesHeld()});
    }
    result->set_value(std::move(snapshot));
  });
  if (future.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    throw Error("the rendezvous server did not answer for its figures within 5 s (stopping?)");
  }
  return future.get();
}

}  // namespace fsdp::rendezvous
