#include "fsdp/rendezvous/store_server.hpp"

#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <deque>
#include <future>
#include <thread>
#include <unordered_map>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/process.hpp"
#include "fsdp/common/sha256.hpp"
#include "fsdp/rendezvous/kv_store.hpp"
#include "fsdp/rendezvous/round.hpp"
#include "pytorch_dialect.hpp"
#include "session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;
constexpr auto kUseAwaitable = asio::use_awaitable;
using TimePoint = asio::steady_timer::clock_type::time_point;

namespace {

std::string peerName(const tcp::socket& socket) {
  boost::system::error_code ec;
  const auto ep = socket.remote_endpoint(ec);
  if (ec) return "unknown peer";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

}  // namespace

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

// Where torch.distributed's env:// init keys everything when it uses the agent's store
// (TORCHELASTIC_USE_AGENT_STORE): PrefixStore("/worker/attempt_<n>"), which reaches the wire
// as "//worker/attempt_<n>/..." (PyTorch joins prefixes with a '/').
constexpr const char* kPytorchWorkerPrefixes[] = {"/worker/", "//worker/"};

struct Run {
  std::string id;
  KvStore store;
  StoreService service{store};
  RoundState rounds;
  std::size_t sessions = 0;
  TimePoint lastActive;
  std::unique_ptr<asio::steady_timer> tick;
  bool dropped = false;
};

class Session;

// One logical client: a connection's own (stream 0), or one stream of a multiplexed
// connection (a node's store proxy), with its own handshake, run and parked request.
struct Stream {
  Stream(const asio::any_io_executor& executor, std::uint16_t number)
      : parked(executor), number(number) {}
  asio::steady_timer parked;  // a waiting request sleeps here until woken or timed out
  std::uint16_t number;
  Run* run = nullptr;
  std::string runId;
  std::string clientNonce;
  std::string serverNonce;
  bool authenticated = false;
  bool joined = false;
  bool ended = false;          // its client went away, or the server ended it
  bool busy = false;           // multiplexed: a handler is working through `queue`
  std::deque<Request> queue;   // multiplexed: read and not handled yet, in order
};

struct StoreServer::Impl {
  // Declared before io so that they outlive it: the coroutines still suspended when the server
  // stops are destroyed with io, and their cleanup unregisters watches from their run's store.
  // (Each run's timer, bound to io, is freed before io in ~Impl.)
  std::unordered_map<std::string, std::unique_ptr<Run>> runs;
  ServerOptions options;
  bool allowPytorch = true;
  asio::io_context io{1};
  tcp::acceptor acceptor{io};
  asio::steady_timer sweep{io};
  ServerStats stats;
  std::unordered_map<AgentId, Session*> sessions;
  AgentId nextSession = 1;
  std::thread thread;
  bool stopped = false;

  ~Impl() {
    for (auto& [id, run] : runs) run->tick.reset();
  }
  awaitable<void> accept();
  awaitable<void> sweepRuns();
  awaitable<void> tickRun(Run* run);
  Run& bindRun(const std::string& id);
  void rearm(Run& run);
  void deliver(Run& run, const std::vector<Event>& events);
};

// One connection. Reads requests in order; writes replies and pushed events through one
// outbox, so that events from other sessions never interleave with a half-written frame.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(StoreServer::Impl& server, tcp::socket socket)
      : server_(server),
        socket_(std::move(socket)),
        main_(std::make_shared<Stream>(socket_.get_executor(), 0)),
        id_(server.nextSession++) {}

  awaitable<void> run() {
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

  // Sends a frame (see write()). While this session's reader handles the frames it has read,
  // replies are held and leave together when it waits again (a HELLO pipelined with a
  // request: one segment back, one wake-up of the client); anything sent while it is parked
  // leaves at once, held replies first.
  void send(std::vector<std::uint8_t> frame) {
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

  // Sends what the reader held; from now on, sends leave at once.
  void release() {
    holding_ = false;
    if (!mux_ && !held_.empty()) write(std::exchange(held_, {}));
  }

  // Closes once everything queued has been written.
  void closeAfterFlush() {
    release();
    if (!writing_) {
      close();
    } else {
      closeAfterFlush_ = true;
    }
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ec;
    socket_.close(ec);
    main_->parked.cancel();
    for (auto& [number, stream] : streams_) stream->parked.cancel();
  }

  AgentId id() const { return id_; }
  bool writing() const { return writing_; }

 private:
  // Writes at once when the socket takes it (the usual case); otherwise queues the rest for a
  // writer coroutine started on demand, so a connection costs no writer while idle.
  void write(std::vector<std::uint8_t> frame) {
    if (frame.empty()) return;
    if (outbox_.empty() && !writing_) {
      boost::system::error_code ec;
      const std::size_t n = socket_.write_some(asio::buffer(frame), ec);
      if (!ec && n == frame.size()) return;
      if (ec && ec != asio::error::would_block && ec != asio::error::try_again) {
        close();
        return;
      }
      frame.erase(frame.begin(), frame.begin() + static_cast<std::ptrdiff_t>(n));
    }
    outbox_.push_back(std::move(frame));
    if (!writing_) {
      writing_ = true;
      asio::co_spawn(socket_.get_executor(), writer(shared_from_this()), [](std::exception_ptr e) {
        if (!e) return;
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          log::warn("store server: {}", ex.what());
        }
      });
    }
  }

  awaitable<void> reader() {
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
            [this](std::vector<std::uint8_t> bytes) { send(std::move(bytes)); });
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

  // `self` keeps the session alive until the outbox is written.
  awaitable<void> writer([[maybe_unused]] std::shared_ptr<Session> self) {
    while (!outbox_.empty() && !closed_) {
      asio::steady_timer timer(socket_.get_executor(), asio::steady_timer::clock_type::now() +
                                                           server_.options.frameTimeout);
      auto result = co_await (asio::async_write(socket_, asio::buffer(outbox_.front()),
                                                asio::as_tuple(kUseAwaitable)) ||
                              timer.async_wait(asio::as_tuple(kUseAwaitable)));
      if (result.index() == 1) {
        log::warn("store server: closing connection from {}: it does not read its replies", peer());
        close();
      } else if (std::get<0>(std::get<0>(result))) {
        close();  // the peer went away
      }
      if (!outbox_.empty()) outbox_.erase(outbox_.begin());
    }
    writing_ = false;
    if (closeAfterFlush_) close();
  }

  // "host:port" of the peer, for messages only (a syscall: not on the hot path).
  std::string peer() const {
    if (closed_) return "a closed connection";
    return peerName(socket_);
  }

  // Makes at least `n` unread bytes available in in_[inStart_, inEnd_). Takes whatever the
  // kernel holds in one read (several pipelined frames at once); waits without a deadline only
  // between frames, when `deadline` is nullopt. Returns false when the peer closed the
  // connection: that is how every session ends, so it is a value, not an exception (unwinding
  // was half of the server's CPU with thousands of short-lived clients).
  awaitable<bool> fill(std::size_t n, std::optional<TimePoint> deadline) {
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

  awaitable<void> serveFramed() {
    const auto& limits = server_.options.limits;
    for (;;) {
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
        dispatch(h.stream, std::move(*req));
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
  void dispatch(std::uint16_t number, Request req) {
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
    stream->queue.push_back(std::move(req));
    if (stream->busy) return;
    stream->busy = true;
    asio::co_spawn(socket_.get_executor(), serveStream(shared_from_this(), stream),
                   asio::detached);
  }

  // `self` keeps the session alive while the stream works.
  awaitable<void> serveStream([[maybe_unused]] std::shared_ptr<Session> self,
                              std::shared_ptr<Stream> stream) {
    while (!stream->queue.empty() && !stream->ended && !closed_) {
      const Request req = std::move(stream->queue.front());
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
  void endStream(Stream& stream) {
    if (stream.ended) return;
    stream.ended = true;
    stream.parked.cancel();
    stream.queue.clear();
    unbind(stream);
    --server_.stats.streamsOpen;
    auto frame = encodeRequest({.op = Op::kEndStream});
    setFrameStream(frame, stream.number);
    send(std::move(frame));
    streams_.erase(stream.number);  // last: `stream` may be owned by the map alone
  }

  // A reply on the stream it answers (stream 0: the bytes of an ordinary connection).
  void reply(Stream& stream, std::vector<std::uint8_t> frame) {
    if (stream.ended) return;
    if (stream.number != 0) setFrameStream(frame, stream.number);
    send(std::move(frame));
  }

  // Handles one request of `s`. Returns false when `s` must end after its error reply: the
  // caller closes the connection (stream 0) or ends the stream.
  awaitable<bool> handleFramed(Stream& s, const Request& req) {
    if (req.op == Op::kHello) {
      if (!s.runId.empty()) throw ProtocolError("HELLO sent twice");
      s.runId = req.keys[0];
      if (s.runId.empty()) throw ProtocolError("HELLO with an empty run id");
      Response resp;
      if (!server_.options.token.empty()) {
        s.serverNonce = randomBytes(16);
        s.clientNonce = req.value;
        resp.number = 1;
        resp.value = s.serverNonce;
      } else {
        s.authenticated = true;
        bind(s);
      }
      reply(s, encodeResponse(req.op, resp));
      co_return true;
    }
    if (req.op == Op::kAuth) {
      if (s.runId.empty() || s.authenticated || s.serverNonce.empty()) {
        throw ProtocolError("AUTH out of order");
      }
      const auto mac =
          hmacSha256(server_.options.token, authMessage(s.runId, s.clientNonce, s.serverNonce));
      const std::string expected(reinterpret_cast<const char*>(mac.data()), mac.size());
      if (!constantTimeEqual(expected, req.value)) {
        ++server_.stats.authFailures;
        log::warn("store server: {} from {} failed authentication for run '{}'", what(s), peer(),
                  s.runId);
        reply(s, encodeResponse(req.op, Response{Status::kError, 0, "authentication failed", {}}));
        co_return false;
      }
      s.authenticated = true;
      bind(s);
      reply(s, encodeResponse(req.op, Response{}));
      co_return true;
    }
    if (!s.authenticated || s.run == nullptr) {
      ++server_.stats.authFailures;
      log::warn("store server: closing {} from {}: {} before HELLO/AUTH", what(s), peer(),
                opName(req.op));
      reply(s, encodeResponse(
                   req.op,
                   Response{Status::kError, 0, "not authenticated: send HELLO (and AUTH) first", {}}));
      co_return false;
    }
    if (req.op == Op::kMux) {
      if (mux_ || s.joined) throw ProtocolError("MUX on a stream, twice, or after JOIN");
      reply(s, encodeResponse(req.op, Response{}));
      release();    // the reply leaves as an ordinary connection's would,
      mux_ = true;  // and everything after it as streams
      co_return true;
    }
    if (req.op == Op::kEndStream) throw ProtocolError("END_STREAM on a connection's own stream");
    Run& run = *s.run;
    run.lastActive = asio::steady_timer::clock_type::now();
    const auto now = Clock::now();
    const bool rendezvousOp = req.op == Op::kJoin || req.op == Op::kHeartbeat ||
                              req.op == Op::kEndRound || req.op == Op::kSucceeded ||
                              req.op == Op::kCloseRun;
    if (rendezvousOp && mux_) {
      // A member's events go to its connection, and its connection's end is its leaving:
      // an agent joins on a connection of its own.
      reply(s, encodeResponse(req.op, Response{Status::kError, 0,
                                               opName(req.op) + " is not multiplexed: an agent "
                                               "joins on a connection of its own", {}}));
      co_return true;
    }
    switch (req.op) {
      case Op::kJoin: {
        s.joined = true;
        server_.deliver(run, run.rounds.join(id_, decodeJoin(req.value), now));
        server_.rearm(run);
        co_return true;
      }
      case Op::kHeartbeat:
        run.rounds.heartbeat(id_, now);
        co_return true;
      case Op::kEndRound:
        server_.deliver(run, run.rounds.endRound(id_, req.value, now, req.value2));
        server_.rearm(run);
        co_return true;
      case Op::kSucceeded:
        server_.deliver(run, run.rounds.succeeded(id_));
        server_.rearm(run);
        co_return true;
      case Op::kCloseRun:
        log::info("store server: run '{}' closed by {}: {}", run.id, peer(), req.value);
        server_.deliver(run, run.rounds.close(req.value));
        server_.rearm(run);
        co_return true;
      default:
        break;
    }
    if (req.op == Op::kAddWait) {
      auto resp = co_await addWait(s, run, req);
      reply(s, encodeResponse(req.op, resp));
      co_return true;
    }
    if (req.op == Op::kSet || req.op == Op::kAppend || req.op == Op::kMultiSet) {
      std::uint64_t adding = 0;
      for (const auto& k : req.keys) adding += k.size();
      adding += req.value.size();
      for (const auto& v : req.values) adding += v.size();
      if (run.store.bytesHeld() + adding > server_.options.limits.maxRunBytes) {
        throw ProtocolError(
            "run '" + run.id + "' would hold " + std::to_string(run.store.bytesHeld() + adding) +
            " bytes, over the limit of " + std::to_string(server_.options.limits.maxRunBytes));
      }
    }
    auto resp = co_await answer(s, run, req);
    reply(s, encodeResponse(req.op, resp));
    co_return true;
  }

  // The counter barrier: add once, then park until the counter reaches the target.
  awaitable<Response> addWait(Stream& s, Run& run, const Request& req) {
    const auto target = parseInt(req.value);
    if (!target)
      co_return Response{
          Status::kError, 0, "ADD_WAIT: target '" + req.value + "' is not an integer", {}};
    std::int64_t value = 0;
    try {
      value = run.store.add(req.keys[0], req.number);
    } catch (const ProtocolError& e) {
      co_return Response{Status::kError, 0, e.what(), {}};
    }
    if (value >= *target) co_return Response{Status::kOk, value, {}, {}};
    park();
    s.parked.expires_after(std::chrono::milliseconds(req.timeoutMs));
    bool reached = false;
    const auto watch = run.store.watchCounter(req.keys[0], *target, [&s, &reached] {
      reached = true;
      s.parked.cancel();
    });
    co_await s.parked.async_wait(asio::as_tuple(kUseAwaitable));
    if (!reached) run.store.unwatch(watch);
    if (closed_ || s.ended) throw boost::system::system_error(asio::error::operation_aborted);
    const auto now = parseInt(run.store.get(req.keys[0]).value_or("0")).value_or(0);
    if (!reached) co_return Response{Status::kTimeout, now, req.keys[0], {}};
    co_return Response{Status::kOk, now, {}, {}};
  }

  // Answers one store request; parks it server side while it has to wait.
  awaitable<Response> answer(Stream& s, Run& run, const Request& req) {
    const auto deadline =
        asio::steady_timer::clock_type::now() + std::chrono::milliseconds(req.timeoutMs);
    for (;;) {
      std::optional<Response> resp;
      try {
        resp = run.service.tryHandle(req);
      } catch (const ProtocolError& e) {
        co_return Response{Status::kError, 0, e.what(), {}};
      }
      if (resp) co_return std::move(*resp);
      if (asio::steady_timer::clock_type::now() >= deadline) {
        Response timeout{Status::kTimeout, 0, {}, {}};
        for (const auto& key : req.keys) {
          if (!run.store.contains(key)) timeout.value += (timeout.value.empty() ? "" : ", ") + key;
        }
        co_return timeout;
      }
      park();
      s.parked.expires_at(deadline);
      const auto watch = run.store.watch(req.keys, [&s] { s.parked.cancel(); });
      co_await s.parked.async_wait(asio::as_tuple(kUseAwaitable));
      run.store.unwatch(watch);
      if (closed_ || s.ended) throw boost::system::system_error(asio::error::operation_aborted);
    }
  }

  void bind(Stream& s) { s.run = &server_.bindRun(s.runId); }

  void unbind(Stream& s) {
    if (s.run == nullptr) return;
    --s.run->sessions;
    s.run->lastActive = asio::steady_timer::clock_type::now();
    s.run = nullptr;
  }

  // A request is about to wait: events pushed meanwhile leave at once, with what an ordinary
  // connection's reader held (a HELLO reply goes with its request's, the usual case).
  void park() { holding_ = false; }

  std::string what(const Stream& s) const {
    return s.number == 0 ? std::string("connection") : "stream " + std::to_string(s.number);
  }

  void finish() {
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

  StoreServer::Impl& server_;
  tcp::socket socket_;
  std::shared_ptr<Stream> main_;  // the connection's own client
  // Multiplexed (after MUX): the streams by number, and whether a flush of held_ is posted.
  std::unordered_map<std::uint16_t, std::shared_ptr<Stream>> streams_;
  bool mux_ = false;
  bool flushPosted_ = false;
  AgentId id_;
  // Frames the socket did not take at once (rare: a slow reader). A vector rather than a
  // deque, which would allocate 576 bytes up front for every connection.
  std::vector<std::vector<std::uint8_t>> outbox_;
  bool closed_ = false;
  bool closeAfterFlush_ = false;
  bool writing_ = false;
  bool holding_ = false;  // the reader is handling what it read: replies wait in held_
  std::vector<std::uint8_t> held_;
  // Received bytes; [inStart_, inEnd_) not parsed yet. Small at first: a fresh server's
  // first thousands of connections pay a page fault for every 4 KiB they touch, and most
  // clients send a frame or two of a few dozen bytes.
  static constexpr std::size_t kMaxReadSize = 64 * 1024;
  std::size_t readSize_ = 512;
  std::vector<std::uint8_t> in_;
  std::size_t inStart_ = 0;
  std::size_t inEnd_ = 0;
};

Run& StoreServer::Impl::bindRun(const std::string& id) {
  auto& slot = runs[id];
  if (!slot) {
    slot = std::make_unique<Run>();
    slot->id = id;
    slot->tick = std::make_unique<asio::steady_timer>(io);
    slot->tick->expires_at(TimePoint::max());
    asio::co_spawn(io, tickRun(slot.get()), [](std::exception_ptr e) {
      if (!e) return;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        log::error("store server: round timer failed: {}", ex.what());
      }
    });
    log::debug("store server: run '{}' created", id);
  }
  ++slot->sessions;
  slot->lastActive = asio::steady_timer::clock_type::now();
  return *slot;
}

void StoreServer::Impl::rearm(Run& run) {
  const auto next = run.rounds.nextDeadline();
  // RoundState's clock is std::chrono::steady_clock, the same as the timer's.
  run.tick->expires_at(next ? *next : TimePoint::max());
}

awaitable<void> StoreServer::Impl::tickRun(Run* run) {
  while (!run->dropped && !stopped) {
    auto [ec] = co_await run->tick->async_wait(asio::as_tuple(kUseAwaitable));
    if (run->dropped || stopped) co_return;
    if (ec) continue;  // re-armed: wait for the new deadline
    deliver(*run, run->rounds.tick(Clock::now()));
    rearm(*run);
  }
}

void StoreServer::Impl::deliver(Run& run, const std::vector<Event>& events) {
  const bool pytorchRun = allowPytorch && run.id == options.pytorchRunId;
  bool assigned = false;
  for (Event event : events) {
    if (event.kind == EventKind::kAssigned) {
      assigned = true;
      event.assignment.pytorchStore = pytorchRun;
    }
    const auto it = sessions.find(event.agent);
    if (it == sessions.end()) continue;
    Session& session = *it->second;
    Response resp;
    resp.number = static_cast<std::int64_t>(event.kind);
    resp.value = encodeEventPayload(event);
    session.send(encodeResponse(Op::kEvent, resp));
    if (event.kind == EventKind::kDisconnect || event.kind == EventKind::kJoinFailed) {
      session.closeAfterFlush();
    }
  }
  // PyTorch's clients of a round key everything under /worker/attempt_<restart count>, and a
  // round after a membership change keeps the count: drop what the previous round left (its
  // workers are gone: every member stopped them before re-joining).
  if (assigned && pytorchRun) {
    std::size_t dropped = 0;
    for (const char* prefix : kPytorchWorkerPrefixes) dropped += run.store.removePrefix(prefix);
    if (dropped > 0)
      log::debug("store server: run '{}': dropped {} keys of the previous round", run.id, dropped);
  }
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
    for (;;) {
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
      asio::co_spawn(io, session->run(), [session](std::exception_ptr e) {
        if (!e) return;
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          log::error("store server: session ended by an unexpected error: {}", ex.what());
        }
      });
    }
  }
}

awaitable<void> StoreServer::Impl::sweepRuns() {
  const auto every = std::max(std::chrono::milliseconds(100), options.runIdleTtl / 4);
  while (!stopped) {
    sweep.expires_after(every);
    co_await sweep.async_wait(asio::as_tuple(kUseAwaitable));
    if (stopped) co_return;
    const auto now = asio::steady_timer::clock_type::now();
    for (auto it = runs.begin(); it != runs.end();) {
      Run& run = *it->second;
      if (run.sessions == 0 && now - run.lastActive >= options.runIdleTtl) {
        log::info("store server: dropping idle run '{}' ({} keys)", run.id, run.store.size());
        run.dropped = true;
        run.tick->cancel();
        // The ticker coroutine still refers to the timer: let it finish before freeing.
        asio::post(io, [owned = std::shared_ptr<Run>(std::move(it->second))] {});
        it = runs.erase(it);
      } else {
        ++it;
      }
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
  const auto logError = [](std::exception_ptr e) {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      log::error("store server: {}", ex.what());
    }
  };
  asio::co_spawn(impl_->io, impl_->accept(), logError);
  asio::co_spawn(impl_->io, impl_->sweepRuns(), logError);
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
  std::promise<ServerStats> result;
  asio::post(impl_->io, [&] {
    ServerStats snapshot = impl_->stats;
    snapshot.runs = impl_->runs.size();
    result.set_value(snapshot);
  });
  return result.get_future().get();
}

}  // namespace fsdp::rendezvous
