// What a connection reads: the first bytes that tell the dialect, our frames, the streams of a
// multiplexed connection (a node's store proxy), and the connection's end.
#include <boost/asio/experimental/awaitable_operators.hpp>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "pytorch_dialect.hpp"
#include "server_state.hpp"
#include "../session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;
using detail::TimePoint;

std::string peerName(const tcp::socket& socket) {
  boost::system::error_code ec;
  const auto ep = socket.remote_endpoint(ec);
  if (ec) return "unknown peer";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

void logCoroutineError(const char* what, std::exception_ptr e) {
  if (!e) return;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    log::error("store server: {} ended by an unexpected error: {}", what, ex.what());
  }
}

Session::Session(StoreServer::Impl& server, tcp::socket socket)
    : server_(server),
      socket_(std::move(socket)),
      main_(std::make_shared<Stream>(socket_.get_executor(), 0)),
      id_(server.nextSession++) {}

awaitable<void> Session::run() {
  server_.sessions.emplace(id_, this);
  ++server_.stats.connectionsOpen;
  boost::system::error_code ec;
  socket_.non_blocking(true, ec);
  try {
    co_await reader();
  } catch (const std::exception& e) {
    log::warn("store server: connection {} ended: {}", peer(), e.what());
  }
  finish();
}

awaitable<void> Session::reader() {
  try {
    // The first bytes may take as long as the client likes; they tell the dialect.
    if (!co_await fill(1, std::nullopt)) co_return;
    if (in_[0] == static_cast<std::uint8_t>(kMagic & 0xff)) {
      co_await serveFramed();
    } else if (server_.allowPytorch) {
      Run& run = server_.bindRun(server_.options.pytorchRunId);
      main_->run = &run;
      std::vector<std::uint8_t> initial(in_.begin() + static_cast<std::ptrdiff_t>(inStart_),
                                        in_.begin() + static_cast<std::ptrdiff_t>(inEnd_));
      co_await servePytorchDialect(
          socket_, std::move(initial), run.store, server_.options.limits,
          server_.options.frameTimeout, [this] { return closed_; },
          [this](std::vector<std::uint8_t> bytes) { send(std::move(bytes)); },
          [this] { return waitForRoom(); });
    } else {
      ++server_.stats.authFailures;
      log::warn(
          "store server: closing connection from {}: PyTorch TCPStore clients are off "
          "(the server has a job token; enable them explicitly)",
          peer());
    }
  } catch (const ProtocolError& e) {
    ++server_.stats.protocolErrors;
    log::warn("store server: closing connection from {}: protocol error: {}", peer(), e.what());
  } catch (const TimeoutError& e) {
    log::warn("store server: closing connection from {}: {}", peer(), e.what());
  } catch (const boost::system::system_error& e) {
    const auto code = e.code();
    if (code != asio::error::eof && code != asio::error::operation_aborted &&
        code != asio::error::connection_reset && code != asio::error::bad_descriptor) {
      log::warn("store server: connection from {} failed: {}", peer(), code.message());
    }
  }
}

// "host:port" of the peer, for messages only (a syscall: not on the hot path).
std::string Session::peer() const {
  if (closed_) return "a closed connection";
  return peerName(socket_);
}

// Makes at least `n` unread bytes available in in_[inStart_, inEnd_). Takes whatever the
// kernel holds in one read (several pipelined frames at once); waits without a deadline only
// between frames, when `deadline` is nullopt. Returns false when the peer closed the
// connection: that is how every session ends, so it is a value, not an exception (unwinding
// was half of the server's CPU with thousands of short-lived clients).
awaitable<bool> Session::fill(std::size_t n, std::optional<TimePoint> deadline) {
  if (inEnd_ - inStart_ >= n) co_return true;
  if (inStart_ > 0) {
    std::copy(in_.begin() + static_cast<std::ptrdiff_t>(inStart_),
              in_.begin() + static_cast<std::ptrdiff_t>(inEnd_), in_.begin());
    inEnd_ -= inStart_;
    inStart_ = 0;
  }
  if (in_.size() < std::max(n, readSize_)) in_.resize(std::max(n, readSize_));
  while (inEnd_ < n) {
    boost::system::error_code ec;
    const std::size_t got =
        socket_.read_some(asio::buffer(in_.data() + inEnd_, in_.size() - inEnd_), ec);
    inEnd_ += got;
    // A full buffer: a client that pipelines; read more at once from now on.
    if (inEnd_ == in_.size() && readSize_ < kMaxReadSize) readSize_ *= 2;
    if (!ec) continue;
    if (ec != asio::error::would_block && ec != asio::error::try_again) {
      if (ec == asio::error::eof || ec == asio::error::connection_reset ||
          ec == asio::error::bad_descriptor || ec == asio::error::operation_aborted) {
        co_return false;
      }
      throw boost::system::system_error(ec);
    }
    release();  // replies held while handling what was read leave before waiting for more
    if (!deadline) {
      auto [waitError] =
          co_await socket_.async_wait(tcp::socket::wait_read, asio::as_tuple(kUseAwaitable));
      if (waitError) co_return false;
      continue;
    }
    asio::steady_timer timer(socket_.get_executor(), *deadline);
    auto result =
        co_await (socket_.async_wait(tcp::socket::wait_read, asio::as_tuple(kUseAwaitable)) ||
                  timer.async_wait(asio::as_tuple(kUseAwaitable)));
    if (result.index() == 1) throw TimeoutError("timed out reading a frame");
    if (std::get<0>(std::get<0>(result))) co_return false;
  }
  co_return true;
}

awaitable<void> Session::serveFramed() {
  const auto& limits = server_.options.limits;
  for (;;) {
    // A client that does not read its replies is not read either (each pipelined frame
    // counts, not only each read from the socket).
    if (!co_await waitForRoom()) co_return;
    // Idle between frames is normal; once a frame has started, the rest has a deadline.
    if (!co_await fill(1, std::nullopt)) co_return;
    const auto frameDeadline =
        asio::steady_timer::clock_type::now() + server_.options.frameTimeout;
    if (!co_await fill(kHeaderSize, frameDeadline)) co_return;
    const Header h = decodeHeader(std::span(in_.data() + inStart_, kHeaderSize), limits);
    if (!co_await fill(kHeaderSize + h.bodyLength, frameDeadline)) co_return;
    if (h.stream != 0 && !mux_) {
      throw ProtocolError("a frame on stream " + std::to_string(h.stream) +
                          " of a connection that did not ask for MUX");
    }
    std::optional<Request> req;
    try {
      req = decodeRequest(h.op, std::span(in_.data() + inStart_ + kHeaderSize, h.bodyLength),
                          limits);
    } catch (const ProtocolError& e) {
      // A bad body on a stream is that stream's fault (a proxy forwards its clients' bytes):
      // it ends that stream only. A bad header ended the connection above.
      if (h.stream == 0) throw;
      ++server_.stats.protocolErrors;
      log::warn("store server: ending stream {} of {}: protocol error: {}", h.stream, peer(),
                e.what());
      if (auto it = streams_.find(h.stream); it != streams_.end()) endStream(*it->second);
    }
    inStart_ += kHeaderSize + h.bodyLength;
    if (inStart_ == inEnd_) {
      inStart_ = inEnd_ = 0;
      if (in_.size() > kMaxReadSize)
        std::vector<std::uint8_t>().swap(in_);  // give back a big frame's buffer
    }
    if (!req) continue;
    ++server_.stats.requestsServed;
    if (mux_) {
      dispatch(h.stream, std::move(*req), kHeaderSize + h.bodyLength);
      continue;
    }
    holding_ = true;
    if (!co_await handleFramed(*main_, *req)) co_return;
    if (closed_) co_return;
  }
}

// Multiplexed: hands a request to its stream, whose handler works through them in order
// (one stream's wait holds up no other). A stream starts with HELLO; anything else for a
// stream this connection does not have (one the server just ended) is dropped.
void Session::dispatch(std::uint16_t number, Request req, std::size_t bytes) {
  std::shared_ptr<Stream> stream;
  if (number == 0) {
    stream = main_;
  } else if (auto it = streams_.find(number); it != streams_.end()) {
    stream = it->second;
  } else if (req.op == Op::kHello) {
    stream = std::make_shared<Stream>(socket_.get_executor(), number);
    streams_.emplace(number, stream);
    ++server_.stats.streamsOpen;
  } else {
    return;
  }
  if (req.op == Op::kEndStream && number != 0) {
    endStream(*stream);
    return;
  }
  // A stream's client sends while its request waits (legal, and bounded): past the cap it is
  // ended, not the connection (the proxy's other clients keep being served). The cap is at
  // least one largest frame, so that a single large request is never refused for its size.
  const std::size_t cap =
      server_.options.maxQueuedBytes == 0
          ? 0
          : std::max<std::size_t>(server_.options.maxQueuedBytes,
                                  server_.options.limits.maxBodyBytes + kHeaderSize);
  if (cap > 0 && stream->busy && stream->queuedBytes + bytes > cap) {
    log::warn(
        "store server: ending stream {} of {}: {} bytes of requests queued behind a waiting "
        "one, over the cap of {} bytes",
        number, peer(), stream->queuedBytes + bytes, cap);
    ++server_.stats.slowReadersClosed;
    endStream(*stream);
    return;
  }
  stream->queuedBytes += bytes;
  stream->queue.push_back({std::move(req), bytes});
  if (stream->busy) return;
  stream->busy = true;
  asio::co_spawn(socket_.get_executor(), serveStream(shared_from_this(), stream),
                 asio::detached);
}

// `self` keeps the session alive while the stream works.
awaitable<void> Session::serveStream([[maybe_unused]] std::shared_ptr<Session> self,
                            std::shared_ptr<Stream> stream) {
  while (!stream->queue.empty() && !stream->ended && !closed_) {
    const Request req = std::move(stream->queue.front().first);
    stream->queuedBytes -= stream->queue.front().second;
    stream->queue.pop_front();
    bool keep = false;
    try {
      keep = co_await handleFramed(*stream, req);
    } catch (const ProtocolError& e) {
      ++server_.stats.protocolErrors;
      log::warn("store server: ending stream {} of {}: protocol error: {}", stream->number,
                peer(), e.what());
    } catch (const std::exception&) {
      // ended or closed while it waited
    }
    if (keep) continue;
    if (stream->number == 0) {
      closeAfterFlush();
    } else {
      endStream(*stream);
    }
  }
  stream->busy = false;
}

// Ends a stream: its wait is dropped, its run released, and the proxy learns it with
// END_STREAM (the ack when the proxy ended it; the order to close its client otherwise).
void Session::endStream(Stream& stream) {
  if (stream.ended) return;
  stream.ended = true;
  stream.parked.cancel();
  stream.queue.clear();
  stream.queuedBytes = 0;
  unbind(stream);
  --server_.stats.streamsOpen;
  auto frame = encodeRequest({.op = Op::kEndStream});
  setFrameStream(frame, stream.number);
  send(std::move(frame));
  streams_.erase(stream.number);  // last: `stream` may be owned by the map alone
}

// A reply on the stream it answers (stream 0: the bytes of an ordinary connection).
void Session::reply(Stream& stream, std::vector<std::uint8_t> frame) {
  if (stream.ended) return;
  if (stream.number != 0) setFrameStream(frame, stream.number);
  send(std::move(frame));
}

std::string Session::what(const Stream& s) const {
  return s.number == 0 ? std::string("connection") : "stream " + std::to_string(s.number);
}

void Session::finish() {
  release();  // a held reply may still leave (and start the writer) before the close
  if (writing_) {
    closeAfterFlush();  // let a queued goodbye (an error reply) leave first
  } else {
    close();
  }
  server_.sessions.erase(id_);
  --server_.stats.connectionsOpen;
  for (auto& [number, stream] : streams_) {
    stream->ended = true;
    unbind(*stream);
    --server_.stats.streamsOpen;
  }
  streams_.clear();
  Run* run = main_->run;
  unbind(*main_);
  if (run != nullptr && main_->joined && !server_.stopped) {
    server_.deliver(*run, run->rounds.leave(id_, "connection closed", Clock::now()));
    server_.rearm(*run);
  }
}

}  // namespace fsdp::rendezvous
