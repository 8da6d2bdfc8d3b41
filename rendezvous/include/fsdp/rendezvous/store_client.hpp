#pragma once
// A synchronous client of the store server. Every call is bounded: waits by the timeout
// given (or ClientOptions::timeout), socket operations by the same deadline.
//
// Thread-safety: calls may come from several threads; they are serialised on the one
// connection.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/rendezvous/protocol.hpp"

namespace fsdp::rendezvous {
namespace detail {
class Connection;
}

struct ClientOptions {
  // How long connect() keeps retrying (exponential backoff with jitter) before giving up.
  std::chrono::milliseconds connectTimeout{30000};
  // Default bound for get() and wait().
  std::chrono::milliseconds timeout{300000};
  Limits limits;
  // The run (job) whose keys this client sees, and its token (empty: none).
  std::string runId = "default";
  std::string token;
};

class StoreClient {
 public:
  // Connects to host:port and joins options.runId (authenticating with options.token when the
  // server asks). Throws TimeoutError naming the endpoint, the last error and the time waited
  // when no connection could be made within options.connectTimeout. Without a token,
  // "the server requires a token" (ConfigError) comes with the first request.
  static std::unique_ptr<StoreClient> connect(const std::string& host, std::uint16_t port,
                                              ClientOptions options = {});
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(const std::string& key, const std::string& value);
  // Waits for the key; throws TimeoutError naming it after the timeout.
  std::string get(const std::string& key);
  std::string get(const std::string& key, std::chrono::milliseconds timeout);
  std::int64_t add(const std::string& key, std::int64_t delta);
  bool check(const std::vector<std::string>& keys);
  // A barrier in one request: adds `delta` to the counter at `key`, then waits (server side)
  // until it is >= `target`; returns the counter. Throws TimeoutError naming the key and the
  // count reached. `fsdp` ranks use it for "all N arrived" (PyTorch's init/ key).
  std::int64_t addAndWait(const std::string& key, std::int64_t delta, std::int64_t target,
                          std::chrono::milliseconds timeout);
  // Waits until every key exists; throws TimeoutError naming the missing ones.
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  bool remove(const std::string& key);
  std::int64_t numKeys();
  std::string compareSet(const std::string& key, const std::string& expected,
                         const std::string& desired);
  std::int64_t append(const std::string& key, const std::string& suffix);
  std::vector<std::string> multiGet(const std::vector<std::string>& keys);
  void multiSet(const std::vector<std::string>& keys, const std::vector<std::string>& values);
  void ping();

  // Change notification (c10d's watchKey, without a callback thread).
  //
  // The run's revision: a counter that every write of a key increments (set, add, append, a
  // compare_set that swaps, each pair of a multi_set, delete, and the server dropping a
  // restarted round's PyTorch keys). Read it before reading the keys you are about to watch.
  std::uint64_t revision();
  // Waits (server side, no polling) until one of `keys` changes after revision `since`, and
  // returns that change: the key, its value now (nullopt: deleted) and the change's revision.
  // Pass that revision back as `since` to wait for the next one. No change is lost between two
  // calls: a key written after `since` is reported even if it was written before this call;
  // when several were, they come in the order of their last writes; several writes of one key
  // in between come as one, with its latest value. A key deleted long ago (past the server's
  // bound on remembered deletions) may be reported deleted once more. since = 0 reports any
  // key that exists. Returns nullopt when nothing changed within `timeout`. Throws Error when
  // `since` is ahead of the run's revision (the server dropped the run, idle past its TTL, and
  // began it again: what changed in between is unknown).
  //
  //   std::uint64_t seen = store->revision();
  //   std::string value = store->get("config");
  //   while (auto change = store->waitForChange({"config"}, seen, 60s)) {
  //     seen = change->revision;
  //     if (change->value) value = *change->value;
  //   }
  std::optional<KeyChange> waitForChange(const std::vector<std::string>& keys, std::uint64_t since,
                                         std::chrono::milliseconds timeout);

  // "host:port", for messages.
  std::string endpoint() const;
  // Shuts the connection down: a call blocked in another thread fails at once, and every later
  // call fails (until reconnect()). Thread-safe (it takes no lock).
  void interrupt();
  std::chrono::milliseconds defaultTimeout() const { return options_.timeout; }

  // This client goes on at another server (the rendezvous moved): a new connection to host:port,
  // made as connect() makes one, replaces the current one once the calls under way are done.
  // The object stays, and every reference to it. Throws as connect() does, the old connection
  // kept.
  void reconnect(const std::string& host, std::uint16_t port, ClientOptions options);

  // Waits (get, wait, addAndWait, waitForChange) go to the server in slices of at most `slice`,
  // and `check` runs before each: what it throws ends the wait (the runtime's: the world is
  // re-forming, fsdp::CommAborted). Set once, before the client is shared between threads.
  // Without it, one request a wait.
  void setWaitCheck(std::function<void()> check, std::chrono::milliseconds slice);

 private:
  StoreClient(std::unique_ptr<detail::Connection> connection, ClientOptions options);
  Response call(Request request, std::chrono::milliseconds waitTimeout);
  // A request that waits on the server up to `timeout`: in slices when a wait check is set.
  Response waitCall(Request request, std::chrono::milliseconds timeout);
  std::unique_ptr<detail::Connection> connection_;
  std::atomic<int> fd_{-1};  // connection_'s socket, for interrupt()
  std::string endpoint_;
  mutable std::mutex endpointMutex_;
  ClientOptions options_;
  std::mutex mutex_;
  std::function<void()> waitCheck_;
  std::chrono::milliseconds waitSlice_{0};
};

}  // namespace fsdp::rendezvous
