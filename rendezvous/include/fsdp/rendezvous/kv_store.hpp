#pragma once
// The in-memory key-value state behind the store server, with one-shot watches that wake
// server-side waiters, revisions for change watches, and observers that see every change.
// Pure data structure: no I/O, no locking. The server touches it only from its single
// event-loop thread.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "fsdp/rendezvous/protocol.hpp"

namespace fsdp::rendezvous {

// What one write did to a key, as observers see it (PyTorch's WATCH_KEY reports these).
enum class ChangeKind : std::uint8_t { kCreated, kUpdated, kDeleted, kAppended };
struct KeyEvent {
  ChangeKind kind;
  std::string_view key;
  std::string_view oldValue;  // empty when created
  std::string_view newValue;  // the whole value now; empty when deleted
};

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
  // Every key holds a value or a non-empty queue (c10d: a queued item makes a key present for
  // WAIT and CHECK).
  bool containsAll(const std::vector<std::string>& keys) const;
  bool remove(const std::string& key);
  // c10d's queues (PyTorch 2.8+): FIFO lists of values, one per key, beside the values (the
  // same key may hold both). A push wakes one queue watcher (watchQueue); pop never waits and
  // returns the length before it with the item, if any.
  void queuePush(const std::string& key, std::string value);
  std::pair<std::int64_t, std::optional<std::string>> queuePop(const std::string& key);
  std::int64_t queueLength(const std::string& key) const;
  // Removes every key (and queue) that starts with `prefix`; returns how many.
  std::size_t removePrefix(const std::string& prefix);
  std::size_t size() const { return data_.size(); }
  std::vector<std::string> keys() const;
  std::size_t bytesHeld() const { return bytes_; }

  // The revision: a counter that every write of a key increments (set, add, append, a
  // compare_set that swaps, each key of a multi_set, delete). Each key remembers the revision
  // of its last write, and a deleted key its deletion's (a bounded number of them: past
  // kMaxTombstones, or kMaxTombstoneBytes of keys, all are forgotten, see changeSince).
  std::uint64_t revision() const { return revision_; }
  // The earliest change among `keys` after revision `since`: the key whose state now is the
  // result of a write later than `since`, with the lowest such revision, and its value now
  // (nullopt: deleted). Several writes of one key report as one, its latest. A key absent now
  // whose deletion was forgotten is reported deleted at the revision where it was forgotten
  // when `since` is older than that: a repeat at worst, never a lost change.
  std::optional<KeyChange> changeSince(const std::vector<std::string>& keys,
                                       std::uint64_t since) const;
  static constexpr std::size_t kMaxTombstones = 65536;
  static constexpr std::size_t kMaxTombstoneBytes = 16u << 20;  // of their keys

  // Calls `fire` once, the next time any of `keys` is written or deleted. The callback must
  // not touch the store. Returns an id for unwatch().
  WatchId watch(const std::vector<std::string>& keys, std::function<void()> fire);
  void unwatch(WatchId id);
  // Calls `fire` on the next push onto `key`'s queue, oldest watcher first, until one returns
  // true (it consumed the push); one that returns true is removed. The callback must not touch
  // the store. Remove with unwatchQueue().
  WatchId watchQueue(const std::string& key, std::function<bool()> fire);
  void unwatchQueue(WatchId id);
  // Calls `fire` once, when the integer at `key` first reaches `target` (through add()).
  // Only waiters whose threshold is crossed wake: a barrier of N ranks costs O(N log N), not
  // N wake-ups per add.
  WatchId watchCounter(const std::string& key, std::int64_t target, std::function<void()> fire);
  std::size_t watchCount() const { return watches_.size(); }

  // Calls `seen` after every write or delete of `key`, until unobserve(), with what changed.
  // The callback must not touch the store; the views it gets live only for the call.
  WatchId observe(const std::string& key, std::function<void(const KeyEvent&)> seen);
  void unobserve(WatchId id);
  std::size_t observerCount() const { return observers_.size(); }

 private:
  struct Entry {
    std::string value;
    std::uint64_t revision = 0;
  };
  // Sets the value; observers see kCreated, or `ifPresent` (kUpdated, kAppended).
  void write(const std::string& key, std::string value, ChangeKind ifPresent);
  void erased(const std::string& key, const std::string& oldValue);
  void tell(ChangeKind kind, const std::string& key, std::string_view oldValue,
            std::string_view newValue);
  void notify(const std::string& key);
  struct Watch {
    std::vector<std::string> keys;
    std::function<void()> fire;
    std::optional<std::pair<std::string, std::int64_t>> counter;  // watchCounter's key, target
  };
  struct Observer {
    std::string key;
    std::function<void(const KeyEvent&)> seen;
  };
  std::unordered_map<std::string, Entry> data_;
  std::size_t bytes_ = 0;
  std::uint64_t revision_ = 0;
  // Deleted keys -> the revision of their deletion; when there are too many, they are all
  // forgotten and compactedRevision_ says up to where.
  std::unordered_map<std::string, std::uint64_t> tombstones_;
  std::size_t tombstoneBytes_ = 0;
  std::uint64_t compactedRevision_ = 0;
  std::unordered_map<std::string, std::vector<WatchId>> byKey_;
  std::map<WatchId, Watch> watches_;
  // Counter waiters per key, by threshold; a fired or removed id leaves watches_ too.
  std::unordered_map<std::string, std::multimap<std::int64_t, WatchId>> counterWatches_;
  std::unordered_map<std::string, std::vector<WatchId>> observersByKey_;
  std::unordered_map<std::string, std::deque<std::string>> queues_;  // never empty
  // Queue watchers per key, oldest first, and each id's key.
  std::unordered_map<std::string, std::vector<std::pair<WatchId, std::function<bool()>>>>
      queueWatchers_;
  std::unordered_map<WatchId, std::string> queueWatchKeys_;
  std::map<WatchId, Observer> observers_;
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
