// What a connection sends: replies held while its reader works, the write queue of a client
// that reads slowly, and the bound on both (back-pressure, then closing a client that reads
// nothing).
#include <boost/asio/experimental/awaitable_operators.hpp>

#include "fsdp/common/log.hpp"
#include "server_state.hpp"
#include "../session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using namespace asio::experimental::awaitable_operators;

void Session::send(std::vector<std::uint8_t> frame) {
  if (closed_) return;
  if (mux_) {
    // Many streams answer in one turn of the loop: their replies leave in one write.
    held_.insert(held_.end(), frame.begin(), frame.end());
    if (!flushPosted_) {
      flushPosted_ = true;
      asio::post(socket_.get_executor(), [self = shared_from_this()] {
        self->flushPosted_ = false;
        self->write(std::exchange(self->held_, {}));
      });
    }
    return;
  }
  if (held_.empty()) {
    if (holding_) {
      held_ = std::move(frame);
    } else {
      write(std::move(frame));
    }
    return;
  }
  held_.insert(held_.end(), frame.begin(), frame.end());
  if (!holding_) write(std::exchange(held_, {}));
}

void Session::release() {
  holding_ = false;
  if (!mux_ && !held_.empty()) write(std::exchange(held_, {}));
}

void Session::closeAfterFlush() {
  release();
  if (!writing_) {
    close();
  } else {
    closeAfterFlush_ = true;
  }
}

void Session::wakeRoom() {
  if (room_) room_->cancel();
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  boost::system::error_code ec;
  socket_.close(ec);
  main_->parked.cancel();
  for (auto& [number, stream] : streams_) stream->parked.cancel();
  if (room_) room_->cancel();
}

// Writes at once when the socket takes it (the usual case); otherwise queues the rest for a
// writer coroutine started on demand, so a connection costs no writer while idle.
void Session::write(std::vector<std::uint8_t> frame) {
  if (frame.empty() || closed_) return;
  if (outbox_.empty() && !writing_) {
    boost::system::error_code ec;
    const std::size_t n = socket_.write_some(asio::buffer(frame), ec);
    if (!ec && n == frame.size()) {
      if (room_) room_->cancel();  // a reader stalled on held bytes re-checks
      return;
    }
    if (ec && ec != asio::error::would_block && ec != asio::error::try_again) {
      close();
      return;
    }
    frame.erase(frame.begin(), frame.begin() + static_cast<std::ptrdiff_t>(n));
  }
  // The reader stops at the cap, but pushed frames (round events, watched keys' changes) do
  // not come from requests: a client that reads none of them is closed well past the cap
  // (past 4 x the cap plus a largest value, which a reply read under the cap cannot reach).
  const std::size_t cap = server_.options.maxQueuedBytes;
  if (cap > 0 && !mux_ && queuedBytes_ > 4 * cap + server_.options.limits.maxValueBytes) {
    log::warn(
        "store server: closing connection from {}: it does not read what it is sent ({} bytes "
        "unread; the cap is {} bytes)",
        peer(), queuedBytes_ + frame.size(), cap);
    ++server_.stats.slowReadersClosed;
    close();
    return;
  }
  queue(std::move(frame));
  if (!writing_) {
    writing_ = true;
    asio::co_spawn(socket_.get_executor(), writer(shared_from_this()),
                   [](std::exception_ptr e) { logCoroutineError("writer", e); });
  }
}

void Session::queue(std::vector<std::uint8_t> frame) {
  queuedBytes_ += frame.size();
  server_.queuedBytes += frame.size();
  server_.stats.queuedBytesPeak = std::max<std::uint64_t>(server_.stats.queuedBytesPeak,
                                                          server_.queuedBytes);
  outbox_.push_back(std::move(frame));
}

void Session::dequeue() {
  const std::size_t total = server_.options.maxQueuedBytesTotal;
  const bool wasOver = total > 0 && server_.queuedBytes > total;
  queuedBytes_ -= outbox_.front().size();
  server_.queuedBytes -= outbox_.front().size();
  outbox_.erase(outbox_.begin());
  // Back under the server-wide cap: every connection stalled by it may read again.
  if (wasOver && server_.queuedBytes <= total) server_.wakeStalled();
}

bool Session::overCap() const {
  const std::size_t cap = server_.options.maxQueuedBytes;
  const std::size_t total = server_.options.maxQueuedBytesTotal;
  return (cap > 0 && unsentBytes() > cap) ||
         (total > 0 && unsentBytes() > 0 && server_.queuedBytes > total);
}

// `self` keeps the session alive until the outbox is written.
awaitable<void> Session::writer([[maybe_unused]] std::shared_ptr<Session> self) {
  while (!outbox_.empty() && !closed_) {
    asio::steady_timer timer(socket_.get_executor(), asio::steady_timer::clock_type::now() +
                                                         server_.options.frameTimeout);
    auto result = co_await (asio::async_write(socket_, asio::buffer(outbox_.front()),
                                              asio::as_tuple(kUseAwaitable)) ||
                            timer.async_wait(asio::as_tuple(kUseAwaitable)));
    if (result.index() == 1 && !closed_) {  // (closed already: counted where it was closed)
      log::warn("store server: closing connection from {}: it read nothing of its replies for {} ms",
                peer(), server_.options.frameTimeout.count());
      ++server_.stats.slowReadersClosed;
      close();
    } else if (result.index() == 0 && std::get<0>(std::get<0>(result))) {
      close();  // the peer went away
    }
    if (!outbox_.empty()) dequeue();
    if (room_ && !overCap()) room_->cancel();
  }
  while (!outbox_.empty()) dequeue();  // closed: nothing more will be written
  writing_ = false;
  if (room_) room_->cancel();
  if (closeAfterFlush_) close();
}

awaitable<bool> Session::waitForRoom() {
  // A client that pipelines many requests gets a turn, not the loop: after a batch, whatever
  // else is ready (other clients, the acceptor) runs first.
  if (++sinceYield_ == kRequestsPerTurn) {
    sinceYield_ = 0;
    co_await asio::post(socket_.get_executor(), kUseAwaitable);
  }
  if (!overCap()) co_return !closed_;
  // What the reader held goes out (or into the queue) first, and what is pushed while it
  // waits leaves at once: the client may be reading, and must be able to catch up.
  holding_ = false;
  if (!held_.empty()) write(std::exchange(held_, {}));
  if (!room_) room_ = std::make_unique<asio::steady_timer>(socket_.get_executor());
  const auto deadline = asio::steady_timer::clock_type::now() + server_.options.frameTimeout;
  ++server_.stats.connectionsStalled;
  server_.stalled.insert(id_);
  while (!closed_ && overCap()) {
    room_->expires_at(deadline);
    auto [ec] = co_await room_->async_wait(asio::as_tuple(kUseAwaitable));
    if (!ec && !closed_ && overCap()) {
      log::warn(
          "store server: closing connection from {}: {} bytes of replies left unread for {} ms "
          "(caps: {} bytes per connection, {} bytes unread on the server: {}); it was not read "
          "from meanwhile",
          peer(), unsentBytes(), server_.options.frameTimeout.count(),
          server_.options.maxQueuedBytes, server_.options.maxQueuedBytesTotal,
          server_.queuedBytes);
      ++server_.stats.slowReadersClosed;
      close();
    }
  }
  --server_.stats.connectionsStalled;
  server_.stalled.erase(id_);
  co_return !closed_;
}

}  // namespace fsdp::rendezvous
