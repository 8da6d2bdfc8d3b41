// PyTorch's TCPStore protocol. Requests are an opcode byte and fields with 8-byte little-endian
// lengths, no framing; replies carry no tag. WAIT answers asynchronously (one 0x00 when every
// key exists), so a parked wait never blocks reading the connection.
#include "pytorch_dialect.hpp"

#include <memory>
#include <optional>
#include <set>
#include <string_view>

#include "fsdp/common/error.hpp"
#include <boost/asio/experimental/awaitable_operators.hpp>

#include "fsdp/common/log.hpp"
#include "../session_io.hpp"

namespace fsdp::rendezvous {

namespace asio = boost::asio;
using asio::awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;

namespace {

constexpr std::uint32_t kValidateMagic = 0x3C85F7CE;

// The operations, independent of a dialect's numbering.
enum class PtOp {
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kNumKeys,
  kWatchKey,
  kDelete,
  kAppend,
  kMultiGet,
  kMultiSet,
  kCancelWait,
  kPing,
  kQueuePush,
  kQueuePop,
  kQueueLen,
  kListKeys
};

// Clients without VALIDATE speak one of two numberings, the same up to 6: PyTorch 1.13's
// (7 WATCH_KEY, 8 DELETE_KEY) and 2.1's, which dropped WATCH_KEY (7 DELETE_KEY, 8 APPEND,
// 9 MULTI_GET, 10 MULTI_SET, 11 CANCEL_WAIT). A connection starts undecided; what it sends
// decides (see decideLegacy), and from then on its table is fixed.
enum class Dialect { kUndecided, kV113, kV21, kCurrent };

const char* dialectName(Dialect d) {
  switch (d) {
    case Dialect::kUndecided:
      return "PyTorch 1.13 or 2.1";
    case Dialect::kV113:
      return "PyTorch 1.13";
    case Dialect::kV21:
      return "PyTorch 2.1";
    case Dialect::kCurrent:
      return "PyTorch 2.2+";
  }
  return "?";
}

std::optional<PtOp> legacyOp(Dialect dialect, std::uint8_t code) {
  static constexpr PtOp kCommon[] = {PtOp::kSet,   PtOp::kCompareSet, PtOp::kGet,    PtOp::kAdd,
                                     PtOp::kCheck, PtOp::kWait,       PtOp::kNumKeys};
  static constexpr PtOp kAfter113[] = {PtOp::kWatchKey, PtOp::kDelete};
  static constexpr PtOp kAfter21[] = {PtOp::kDelete, PtOp::kAppend, PtOp::kMultiGet,
                                      PtOp::kMultiSet, PtOp::kCancelWait};
  if (code < std::size(kCommon)) return kCommon[code];
  const std::size_t rest = code - std::size(kCommon);
  if (dialect == Dialect::kV113 && rest < std::size(kAfter113)) return kAfter113[rest];
  if (dialect == Dialect::kV21 && rest < std::size(kAfter21)) return kAfter21[rest];
  return std::nullopt;
}

std::optional<PtOp> currentOp(std::uint8_t code) {
  static constexpr PtOp kTable[] = {
      PtOp::kSet,      PtOp::kCompareSet, PtOp::kGet,    PtOp::kAdd,       PtOp::kCheck,
      PtOp::kWait,     PtOp::kNumKeys,    PtOp::kDelete, PtOp::kAppend,    PtOp::kMultiGet,
      PtOp::kMultiSet, PtOp::kCancelWait, PtOp::kPing,   PtOp::kQueuePush, PtOp::kQueuePop,
      PtOp::kQueueLen, PtOp::kListKeys};
  if (code >= 1 && code - 1 < static_cast<int>(std::size(kTable))) return kTable[code - 1];
  return std::nullopt;
}

// c10d's WatchResponseType, the first byte of everything sent on a watching connection.
enum class WatchReply : std::uint8_t {
  kKeyUpdated = 0,
  kKeyCreated = 1,
  kKeyDeleted = 2,
  kKeyCallbackRegistered = 3,  // the answer to WATCH_KEY itself
  kKeyAppended = 4,
};

class Writer {
 public:
  void u8(std::uint8_t v) { out_.push_back(v); }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  }
  void str(std::string_view s) {
    u64(s.size());
    out_.insert(out_.end(), s.begin(), s.end());
  }
  std::vector<std::uint8_t> take() { return std::move(out_); }

 private:
  std::vector<std::uint8_t> out_;
};

// Reads the fields of one request off the socket, each bounded by the request's deadline.
class FieldReader {
 public:
  FieldReader(tcp::socket& socket, const Limits& limits) : socket_(socket), limits_(limits) {}
  void startRequest(SteadyTimePoint deadline) { deadline_ = deadline; }
  // Bytes already read off the socket, served before it (in front of what is pending).
  void pushBack(const std::vector<std::uint8_t>& bytes) {
    pending_.insert(pending_.begin(), bytes.begin(), bytes.end());
  }
  bool hasPending() const { return !pending_.empty(); }
  // The next request's opcode: may wait without a deadline (an idle connection is fine).
  awaitable<std::uint8_t> opcode() {
    if (!pending_.empty()) {
      const std::uint8_t code = pending_.front();
      pending_.erase(pending_.begin());
      co_return code;
    }
    std::uint8_t code = 0;
    co_await asio::async_read(socket_, asio::buffer(&code, 1), asio::use_awaitable);
    co_return code;
  }

  awaitable<void> bytes(std::uint8_t* out, std::size_t n) {
    std::size_t taken = std::min(n, pending_.size());
    std::copy_n(pending_.begin(), taken, out);
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(taken));
    if (taken < n) {
      co_await readExact(socket_, asio::buffer(out + taken, n - taken), deadline_,
                         "a TCPStore request");
    }
  }
  std::uint64_t maxKeyBytes() const { return limits_.maxKeyBytes; }
  // The next u64 without consuming it.
  awaitable<std::uint64_t> peekU64() {
    std::array<std::uint8_t, 8> b{};
    co_await bytes(b.data(), b.size());
    pushBack(std::vector<std::uint8_t>(b.begin(), b.end()));
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{b[i]} << (8 * i);
    co_return v;
  }
  // Whether more than `n` bytes arrive with the request: what is buffered and what the socket
  // holds now or within a moment (a client writes each request in one write), consuming none.
  awaitable<bool> bytesFollow(std::uint64_t n) {
    if (n > limits_.maxKeyBytes + 8) co_return false;
    std::vector<std::uint8_t> head(n);  // the request so far arrives whole first
    co_await bytes(head.data(), n);
    pushBack(head);
    for (int round = 0; round < 2; ++round) {
      boost::system::error_code ec;
      std::vector<std::uint8_t> more(socket_.available(ec));
      if (!more.empty()) {
        const auto got = socket_.read_some(asio::buffer(more), ec);
        more.resize(got);
        pending_.insert(pending_.end(), more.begin(), more.end());
      }
      if (pending_.size() > n) co_return true;
      if (round == 1) break;
      asio::steady_timer timer(socket_.get_executor(), std::chrono::milliseconds(50));
      co_await (socket_.async_wait(tcp::socket::wait_read, asio::as_tuple(asio::use_awaitable)) ||
                timer.async_wait(asio::as_tuple(asio::use_awaitable)));
    }
    co_return false;
  }
  awaitable<std::uint64_t> u64() {
    std::array<std::uint8_t, 8> b{};
    co_await bytes(b.data(), b.size());
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{b[i]} << (8 * i);
    co_return v;
  }
  awaitable<std::uint32_t> u32() {
    std::array<std::uint8_t, 4> b{};
    co_await bytes(b.data(), b.size());
    co_return std::uint32_t{b[0]} | std::uint32_t{b[1]} << 8 | std::uint32_t{b[2]} << 16 |
        std::uint32_t{b[3]} << 24;
  }
  awaitable<std::string> str(std::uint64_t maxBytes, const char* what) {
    const auto n = co_await u64();
    if (n > maxBytes) {
      throw ProtocolError(std::string("TCPStore ") + what + " of " + std::to_string(n) +
                          " bytes exceeds the limit of " + std::to_string(maxBytes));
    }
    std::string s(n, '\0');
    co_await bytes(reinterpret_cast<std::uint8_t*>(s.data()), n);
    co_return s;
  }
  awaitable<std::string> key() { co_return co_await str(limits_.maxKeyBytes, "key"); }
  awaitable<std::string> value() { co_return co_await str(limits_.maxValueBytes, "value"); }
  awaitable<std::vector<std::string>> keys() {
    const auto n = co_await u64();
    if (n > limits_.maxKeysPerRequest) {
      throw ProtocolError("TCPStore request with " + std::to_string(n) +
                          " keys exceeds the limit of " +
                          std::to_string(limits_.maxKeysPerRequest));
    }
    std::vector<std::string> out;
    for (std::uint64_t i = 0; i < n; ++i) out.push_back(co_await key());
    co_return out;
  }

 private:
  tcp::socket& socket_;
  const Limits& limits_;
  SteadyTimePoint deadline_{};
  std::vector<std::uint8_t> pending_;
};

// The connection's one outstanding WAIT. As c10d's server counts it: answered once every key
// missing when it came has been written since (set, add, append, compare_set, multi_set; a
// delete does not count) or, for a queue, pushed to; a key set and deleted again before the
// answer still counts as written.
struct PendingWait {
  std::uint64_t id = 0;                // tells a stale callback of an earlier wait from this one
  std::set<std::string> missing;       // not written since the WAIT
  std::vector<KvStore::WatchId> observers;
  std::vector<KvStore::WatchId> queueWatches;
};

struct ConnectionState {
  KvStore& store;
  std::function<void(std::vector<std::uint8_t>)> send;
  std::optional<PendingWait> wait;
  std::uint64_t waits = 0;  // WAITs so far: the next one's id
  bool alive = true;
  std::vector<KvStore::WatchId> observers;  // WATCH_KEY registrations, until the connection ends
};

// What c10d's server sends a watcher when a key changes: the change type, the key, the old
// and the new value, each with a u64 length. As c10d's server does: a created key has no old
// value, a deleted one no new value, and an append carries only what was appended
// (KEY_APPENDED, since 2.0; a 1.13 client reads it as an update).
std::vector<std::uint8_t> watchUpdate(const KeyEvent& event) {
  Writer out;
  std::string_view oldValue = event.oldValue;
  std::string_view newValue = event.newValue;
  WatchReply type = WatchReply::kKeyUpdated;
  switch (event.kind) {
    case ChangeKind::kCreated:
      type = WatchReply::kKeyCreated;
      oldValue = {};
      break;
    case ChangeKind::kUpdated:
      break;
    case ChangeKind::kDeleted:
      type = WatchReply::kKeyDeleted;
      newValue = {};
      break;
    case ChangeKind::kAppended:
      type = WatchReply::kKeyAppended;
      newValue = newValue.substr(std::min(newValue.size(), oldValue.size()));
      oldValue = {};
      break;
  }
  out.u8(static_cast<std::uint8_t>(type));
  out.str(event.key);
  out.str(oldValue);
  out.str(newValue);
  return out.take();
}

void release(KvStore& store, const PendingWait& wait) {
  for (const auto id : wait.observers) store.unobserve(id);
  for (const auto id : wait.queueWatches) store.unwatchQueue(id);
}

void cancelWait(ConnectionState& state) {
  if (state.wait) {
    release(state.store, *state.wait);
    state.wait.reset();
  }
}

// `key` of wait `id` was written (or pushed to): when it was the last one missing, answers
// STOP_WAITING and returns true. Runs inside the store's callbacks: the watches are released
// from the event loop, later.
bool keyWritten(const std::weak_ptr<ConnectionState>& weak, std::uint64_t id,
                const std::string& key, const asio::any_io_executor& executor) {
  const auto s = weak.lock();
  if (!s || !s->alive || !s->wait || s->wait->id != id) return false;
  if (s->wait->missing.erase(key) == 0 || !s->wait->missing.empty()) return false;
  asio::post(executor, [s, wait = std::move(*s->wait)] { release(s->store, wait); });
  s->wait.reset();
  s->send({0x00});  // STOP_WAITING
  return true;
}

// Parks a WAIT on `keys`, of which some are missing now.
void armWait(const std::shared_ptr<ConnectionState>& state, std::vector<std::string> keys,
             const asio::any_io_executor& executor) {
  PendingWait wait{.id = ++state->waits};
  for (auto& key : keys) {
    if (!state->store.containsAll({key})) wait.missing.insert(std::move(key));
  }
  std::weak_ptr<ConnectionState> weak = state;
  for (const auto& key : wait.missing) {
    wait.observers.push_back(
        state->store.observe(key, [weak, id = wait.id, key, executor](const KeyEvent& event) {
          if (event.kind != ChangeKind::kDeleted) keyWritten(weak, id, key, executor);
        }));
    wait.queueWatches.push_back(state->store.watchQueue(
        key, [weak, id = wait.id, key, executor] { return keyWritten(weak, id, key, executor); }));
  }
  state->wait = std::move(wait);
}

void checkRunBytes(const KvStore& store, const Limits& limits, std::uint64_t adding) {
  if (store.bytesHeld() + adding > limits.maxRunBytes) {
    throw ProtocolError("TCPStore client would make the run hold " +
                        std::to_string(store.bytesHeld() + adding) + " bytes, over the limit of " +
                        std::to_string(limits.maxRunBytes));
  }
}

// Which numbering an undecided connection speaks, from its opcode `code` (read) and what
// follows: 7 is 1.13's WATCH_KEY only as a watch connection's first request, 2.1's
// DELETE_KEY otherwise; 9-11 exist in 2.1 only; 8 is 1.13's DELETE_KEY (key only; the client
// then waits for the reply) or 2.1's APPEND (key and value, sent in one write): told apart by
// whether bytes follow the key at once. Undecided for 0-6 and anything unknown.
awaitable<Dialect> decideLegacy(FieldReader& in, std::uint8_t code, bool sentRequest) {
  if (code == 7) co_return sentRequest ? Dialect::kV21 : Dialect::kV113;
  if (code >= 9 && code <= 11) co_return Dialect::kV21;
  if (code != 8) co_return Dialect::kUndecided;
  // Look past the key without consuming it.
  const auto keyLength = co_await in.peekU64();
  if (keyLength > in.maxKeyBytes()) co_return Dialect::kV113;  // refused as a key either way
  co_return (co_await in.bytesFollow(8 + keyLength)) ? Dialect::kV21 : Dialect::kV113;
}

}  // namespace

awaitable<void> servePytorchDialect(tcp::socket& socket, std::vector<std::uint8_t> initial,
                                    KvStore& store, const Limits& limits,
                                    std::chrono::milliseconds frameTimeout,
                                    const std::function<bool()>& closed,
                                    const std::function<void(std::vector<std::uint8_t>)>& send,
    const std::function<boost::asio::awaitable<bool>()>& room) {
  FieldReader in(socket, limits);
  const std::uint8_t first = initial.at(0);
  in.pushBack(std::vector<std::uint8_t>(initial.begin() + 1, initial.end()));
  auto state = std::make_shared<ConnectionState>(
      ConnectionState{.store = store, .send = send, .wait = std::nullopt, .waits = 0, .alive = true});
  struct Finish {
    std::shared_ptr<ConnectionState>& state;
    ~Finish() {
      state->alive = false;
      cancelWait(*state);
      for (const auto id : state->observers) state->store.unobserve(id);
    }
  } finish{state};
  const auto executor = socket.get_executor();

  // Tell the dialects apart: VALIDATE (00 CE F7 85 3C) starts the current one; anything else
  // is 1.13's, whose 00 is SET (a key length of ~1 GiB would be needed to look like VALIDATE).
  Dialect dialect = Dialect::kUndecided;
  bool sentRequest = false;  // anything before: 1.13 sends WATCH_KEY on a connection of its own
  std::optional<std::uint8_t> opcode = first;
  if (first == 0) {
    in.startRequest(SteadyTimePoint::clock::now() + frameTimeout);
    std::vector<std::uint8_t> next(4);
    co_await in.bytes(next.data(), next.size());
    const std::uint32_t magic = std::uint32_t{next[0]} | std::uint32_t{next[1]} << 8 |
                                std::uint32_t{next[2]} << 16 | std::uint32_t{next[3]} << 24;
    if (magic == kValidateMagic) {
      dialect = Dialect::kCurrent;
      opcode.reset();
    } else {
      in.pushBack(next);
    }
  }

  for (;;) {
    std::uint8_t code = 0;
    if (opcode) {
      code = *opcode;
      opcode.reset();
    } else {
      if (!co_await room()) co_return;  // a client that reads none of its replies
      code = co_await in.opcode();
    }
    if (closed()) co_return;
    in.startRequest(SteadyTimePoint::clock::now() + frameTimeout);
    if (dialect == Dialect::kUndecided) {
      const auto decided = co_await decideLegacy(in, code, sentRequest);
      if (decided != Dialect::kUndecided) {
        dialect = decided;
        log::debug("store server: a TCPStore client speaks {}'s protocol (opcode {})",
                   dialectName(dialect), code);
      }
    }
    sentRequest = true;
    const bool current = dialect == Dialect::kCurrent;
    // Undecided here means opcodes 0-6, the same in both.
    const auto op = current ? currentOp(code)
                            : legacyOp(dialect == Dialect::kUndecided ? Dialect::kV113 : dialect,
                                       code);
    if (!op) {
      throw ProtocolError("unknown TCPStore opcode " + std::to_string(code) + " (" +
                          dialectName(dialect) + " protocol)");
    }
    // A 1.13 client that timed out in WAIT sends its next request without cancelling: drop
    // the stale wait rather than answer it later and desynchronise the client.
    if (*op != PtOp::kCancelWait && state->wait) cancelWait(*state);
    Writer out;
    switch (*op) {
      case PtOp::kSet: {
        auto key = co_await in.key();
        auto value = co_await in.value();
        checkRunBytes(store, limits, key.size() + value.size());
        store.set(key, std::move(value));
        break;  // no reply
      }
      case PtOp::kCompareSet: {
        auto key = co_await in.key();
        auto expected = co_await in.value();
        auto desired = co_await in.value();
        checkRunBytes(store, limits, key.size() + desired.size());
        out.str(store.compareSet(key, expected, std::move(desired)));
        break;
      }
      case PtOp::kGet: {
        // A client WAITs before it GETs, so a missing key means it was deleted in between.
        // c10d's 1.13 server closes the connection then; 2.x's default (libuv) server answers
        // an empty value.
        const auto key = co_await in.key();
        const auto value = store.get(key);
        if (!value && !current) throw ProtocolError("TCPStore GET of missing key '" + key + "'");
        out.str(value.value_or(""));
        break;
      }
      case PtOp::kAdd: {
        const auto key = co_await in.key();
        const auto delta = static_cast<std::int64_t>(co_await in.u64());
        out.u64(static_cast<std::uint64_t>(store.add(key, delta)));
        break;
      }
      case PtOp::kCheck:
        out.u8(store.containsAll(co_await in.keys()) ? 0 : 1);
        break;
      case PtOp::kWait: {
        auto keys = co_await in.keys();
        if (store.containsAll(keys)) {
          out.u8(0);
        } else {
          armWait(state, std::move(keys), executor);
        }
        break;
      }
      case PtOp::kNumKeys:
        out.u64(store.size());
        break;
      case PtOp::kDelete:
        out.u64(store.remove(co_await in.key()) ? 1 : 0);
        break;
      case PtOp::kAppend: {
        const auto key = co_await in.key();
        const auto suffix = co_await in.value();
        checkRunBytes(store, limits, key.size() + suffix.size());
        store.append(key, suffix);
        break;  // no reply
      }
      case PtOp::kMultiGet: {
        const auto keys = co_await in.keys();
        for (const auto& key : keys) {
          const auto value = store.get(key);
          if (!value && !current) {
            throw ProtocolError("TCPStore MULTI_GET of missing key '" + key + "'");
          }
          out.str(value.value_or(""));  // as for GET
        }
        break;
      }
      case PtOp::kMultiSet: {
        const auto n = co_await in.u64();
        if (n > limits.maxKeysPerRequest) {
          throw ProtocolError("TCPStore MULTI_SET of " + std::to_string(n) +
                              " pairs exceeds the limit");
        }
        for (std::uint64_t i = 0; i < n; ++i) {
          auto key = co_await in.key();
          auto value = co_await in.value();
          checkRunBytes(store, limits, key.size() + value.size());
          store.set(key, std::move(value));
        }
        break;  // no reply
      }
      case PtOp::kCancelWait:
        cancelWait(*state);
        out.u8(1);  // WAIT_CANCELED
        break;
      case PtOp::kPing: {
        const auto nonce = co_await in.u32();
        for (int i = 0; i < 4; ++i) out.u8(static_cast<std::uint8_t>(nonce >> (8 * i)));
        break;
      }
      case PtOp::kListKeys: {
        const auto keys = store.keys();
        out.u64(keys.size());
        for (const auto& key : keys) out.str(key);
        break;
      }
      case PtOp::kWatchKey: {
        // 1.13's TCPStore::watchKey, on its second ("callback") connection: every later change
        // of the key is pushed on this connection until it closes, as c10d's server does (a
        // key watched twice is told twice).
        const auto key = co_await in.key();
        if (state->observers.size() >= limits.maxKeysPerRequest) {
          throw ProtocolError("TCPStore client watches more than " +
                              std::to_string(limits.maxKeysPerRequest) + " keys on one connection");
        }
        std::weak_ptr<ConnectionState> weak = state;
        state->observers.push_back(store.observe(key, [weak](const KeyEvent& event) {
          const auto s = weak.lock();
          if (s && s->alive) s->send(watchUpdate(event));
        }));
        out.u8(static_cast<std::uint8_t>(WatchReply::kKeyCallbackRegistered));
        break;
      }
      case PtOp::kQueuePush: {
        const auto key = co_await in.key();
        auto value = co_await in.value();
        checkRunBytes(store, limits, key.size() + value.size());
        store.queuePush(key, std::move(value));
        break;  // no reply
      }
      case PtOp::kQueuePop: {
        auto [length, value] = store.queuePop(co_await in.key());
        out.u64(static_cast<std::uint64_t>(length));
        if (value) out.str(*value);
        break;
      }
      case PtOp::kQueueLen:
        out.u64(static_cast<std::uint64_t>(store.queueLength(co_await in.key())));
        break;
    }
    auto reply = out.take();
    if (!reply.empty()) send(std::move(reply));
  }
}

}  // namespace fsdp::rendezvous
