#pragma once
// The in-memory key-value state behind the store server, with one-shot watches that wake
// server-side waiters. Pure data structure: no I/O, no locking. The server touches it only
// from its single event-loop thread.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/rendezvous/protocol.hpp"

namespace fsdp::rendezvous {

class KvStore {
 public:
  using WatchId = std::uint64_t;

  void set(const std::string& key, std::string value);
  std::optional<std::string> get(const std::string& key) const;
  // Adds `delta` to the integer stored at key (absent = 0) and returns the new value.
  // Throws ProtocolError when the current value is not an integer.
  std::int64_t add(const std::string& key, std::int64_t delta);
  // c10d semantics: sets `desired` when the current value equals `expected` (or the key is
  // absent and `expected` is empty); returns the value held afterwards.
  std::string compareSet(const std::string& key, const std::string& expected, std::string desired);
  // Appends to the value (absent = empty); returns the new length.
  std::int64_t append(const std::string& key, const std::string& suffix);
  bool contains(const std::string& key) const { return data_.contains(key); }
  bool containsAll(const std::vector<std::string>& keys) const;
  bool remove(const std::string& key);
  // Removes every key that starts with `prefix`; returns how many.
  std::size_t removePrefix(const std::string& prefix);
  std::size_t size() const { return data_.size(); }
  std::vector<std::string> keys() const;
  std::size_t bytesHeld() const { return bytes_; }

  // Calls `fire` once, the next time any of `keys` is written. The callback must not touch
  // the store. Returns an id for unwatch().
  WatchId watch(const std::vector<std::string>& keys, std::function<void()> fire);
  void unwatch(WatchId id);
  // Calls `fire` once, when the integer at `key` first reaches `target` (through add()).
  // Only waiters whose threshold is crossed wake: a barrier of N ranks costs O(N log N), not
  // N wake-ups per add.
  WatchId watchCounter(const std::string& key, std::int64_t target, std::function<void()> fire);
  std::size_t watchCount() const { return watches_.size(); }

 private:
  void notify(const std::string& key);
  struct Watch {
    std::vector<std::string> keys;
    std::function<void()> fire;
    std::optional<std::pair<std::string, std::int64_t>> counter;  // watchCounter's key, target
  };
  std::unordered_map<std::string, std::string> data_;
  std::size_t bytes_ = 0;
  std::unordered_map<std::string, std::vector<WatchId>> byKey_;
  std::map<WatchId, Watch> watches_;
  // Counter waiters per key, by threshold; a fired or removed id leaves watches_ too.
  std::unordered_map<std::string, std::multimap<std::int64_t, WatchId>> counterWatches_;
  void fireCounter(const std::string& key, std::int64_t value);
  WatchId nextId_ = 1;
};

// Answers requests against a KvStore. `tryHandle` is pure apart from the store: it returns
// nullopt when the request must wait (GET of a missing key, WAIT on missing keys); the caller
// then watches the keys and asks again.
class StoreService {
 public:
  explicit StoreService(KvStore& store) : store_(store) {}
  std::optional<Response> tryHandle(const Request& request);

 private:
  KvStore& store_;
};

}  // namespace fsdp::rendezvous
