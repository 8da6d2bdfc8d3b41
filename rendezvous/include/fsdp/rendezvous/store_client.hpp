#pragma once
// A synchronous client of the store server. Every call is bounded: waits by the timeout
// given (or ClientOptions::timeout), socket operations by the same deadline.
//
// Thread-safety: calls may come from several threads; they are serialised on the one
// connection.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
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

  // "host:port", for messages.
  const std::string& endpoint() const { return endpoint_; }
  std::chrono::milliseconds defaultTimeout() const { return options_.timeout; }

 private:
  StoreClient(std::unique_ptr<detail::Connection> connection, ClientOptions options);
  Response call(Request request, std::chrono::milliseconds waitTimeout);
  std::unique_ptr<detail::Connection> connection_;
  std::string endpoint_;
  ClientOptions options_;
  std::mutex mutex_;
};

}  // namespace fsdp::rendezvous
