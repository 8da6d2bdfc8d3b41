// Request routing for our framed protocol: the handshake (HELLO, and AUTH's HMAC
// challenge-response when the job has a token), rendezvous operations, and store operations,
// parked server side while they wait.
#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/sha256.hpp"
#include "server_state.hpp"
#include "../session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;

// HELLO names the run; with a job token the server answers a nonce and the client proves the
// token with AUTH (HMAC-SHA256 over the run and both nonces), compared in constant time.
bool Session::handshake(Stream& s, const Request& req) {
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
    return true;
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
      return false;
    }
    s.authenticated = true;
    bind(s);
    reply(s, encodeResponse(req.op, Response{}));
    return true;
  }
  throw ProtocolError("not a handshake: " + opName(req.op));
}

// Handles one request of `s`. Returns false when `s` must end after its error reply: the
// caller closes the connection (stream 0) or ends the stream.
awaitable<bool> Session::handleFramed(Stream& s, const Request& req) {
  if (req.op == Op::kHello || req.op == Op::kAuth) co_return handshake(s, req);
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
awaitable<Response> Session::addWait(Stream& s, Run& run, const Request& req) {
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
awaitable<Response> Session::answer(Stream& s, Run& run, const Request& req) {
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

void Session::bind(Stream& s) { s.run = &server_.bindRun(s.runId); }

void Session::unbind(Stream& s) {
  if (s.run == nullptr) return;
  --s.run->sessions;
  s.run->lastActive = asio::steady_timer::clock_type::now();
  s.run = nullptr;
}

}  // namespace fsdp::rendezvous
