#include "fsdp/rendezvous/kv_store.hpp"

#include <algorithm>
#include <utility>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::rendezvous {

void KvStore::set(const std::string& key, std::string value) {
  write(key, std::move(value), ChangeKind::kUpdated);
}

void KvStore::write(const std::string& key, std::string value, ChangeKind ifPresent) {
  auto [it, inserted] = data_.try_emplace(key);
  if (inserted) {
    bytes_ += key.size();
    if (!tombstones_.empty() && tombstones_.erase(key) > 0) tombstoneBytes_ -= key.size();
  } else {
    bytes_ -= it->second.value.size();
  }
  bytes_ += value.size();
  it->second.revision = ++revision_;
  if (!observersByKey_.empty() && observersByKey_.contains(key)) {
    // Only observed keys pay for keeping the old value.
    const std::string oldValue = std::exchange(it->second.value, std::move(value));
    tell(inserted ? ChangeKind::kCreated : ifPresent, key, oldValue, it->second.value);
  } else {
    it->second.value = std::move(value);
  }
  notify(key);
}

// After a key left data_: its tombstone, its observers, its waiters.
void KvStore::erased(const std::string& key, const std::string& oldValue) {
  ++revision_;
  if (tombstones_.size() >= kMaxTombstones || tombstoneBytes_ >= kMaxTombstoneBytes) {
    // Forget every deletion at once (see changeSince): cheap, and rare.
    tombstones_.clear();
    tombstoneBytes_ = 0;
    compactedRevision_ = revision_ - 1;
  }
  tombstones_[key] = revision_;
  tombstoneBytes_ += key.size();
  if (!observersByKey_.empty()) tell(ChangeKind::kDeleted, key, oldValue, {});
  notify(key);
}

std::optional<std::string> KvStore::get(const std::string& key) const {
  const auto it = data_.find(key);
  if (it == data_.end()) return std::nullopt;
  return it->second.value;
}

std::int64_t KvStore::add(const std::string& key, std::int64_t delta) {
  std::int64_t current = 0;
  if (const auto it = data_.find(key); it != data_.end()) {
    const auto parsed = parseInt(it->second.value);
    if (!parsed) throw ProtocolError("ADD on key '" + key + "' whose value is not an integer");
    current = *parsed;
  }
  const std::int64_t next = current + delta;
  set(key, std::to_string(next));
  fireCounter(key, next);
  return next;
}

std::string KvStore::compareSet(const std::string& key, const std::string& expected,
                                std::string desired) {
  const auto it = data_.find(key);
  if (it == data_.end()) {
    if (!expected.empty()) return expected;
    set(key, desired);
    return desired;
  }
  if (it->second.value == expected) {
    set(key, desired);
    return desired;
  }
  return it->second.value;
}

std::int64_t KvStore::append(const std::string& key, const std::string& suffix) {
  std::string value = get(key).value_or("");
  value += suffix;
  const auto size = static_cast<std::int64_t>(value.size());
  write(key, std::move(value), ChangeKind::kAppended);
  return size;
}

bool KvStore::containsAll(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(),
                     [this](const auto& k) { return data_.contains(k) || queues_.contains(k); });
}

void KvStore::queuePush(const std::string& key, std::string value) {
  auto [it, created] = queues_.try_emplace(key);
  if (created) bytes_ += key.size();
  bytes_ += value.size();
  it->second.push_back(std::move(value));
  const auto watchers = queueWatchers_.find(key);
  if (watchers == queueWatchers_.end()) return;
  auto& list = watchers->second;
  for (std::size_t i = 0; i < list.size(); ++i) {
    if (!list[i].second()) continue;
    queueWatchKeys_.erase(list[i].first);
    list.erase(list.begin() + static_cast<std::ptrdiff_t>(i));
    break;
  }
  if (list.empty()) queueWatchers_.erase(watchers);
}

std::pair<std::int64_t, std::optional<std::string>> KvStore::queuePop(const std::string& key) {
  const auto it = queues_.find(key);
  if (it == queues_.end()) return {0, std::nullopt};
  const auto length = static_cast<std::int64_t>(it->second.size());
  std::string value = std::move(it->second.front());
  it->second.pop_front();
  bytes_ -= value.size();
  if (it->second.empty()) {
    bytes_ -= key.size();
    queues_.erase(it);
  }
  return {length, std::move(value)};
}

std::int64_t KvStore::queueLength(const std::string& key) const {
  const auto it = queues_.find(key);
  return it == queues_.end() ? 0 : static_cast<std::int64_t>(it->second.size());
}

KvStore::WatchId KvStore::watchQueue(const std::string& key, std::function<bool()> fire) {
  const WatchId id = nextId_++;
  queueWatchers_[key].emplace_back(id, std::move(fire));
  queueWatchKeys_.emplace(id, key);
  return id;
}

void KvStore::unwatchQueue(WatchId id) {
  const auto key = queueWatchKeys_.find(id);
  if (key == queueWatchKeys_.end()) return;
  const auto list = queueWatchers_.find(key->second);
  std::erase_if(list->second, [id](const auto& w) { return w.first == id; });
  if (list->second.empty()) queueWatchers_.erase(list);
  queueWatchKeys_.erase(key);
}

std::vector<std::string> KvStore::keys() const {
  std::vector<std::string> out;
  out.reserve(data_.size());
  for (const auto& [key, entry] : data_) out.push_back(key);
  return out;
}

bool KvStore::remove(const std::string& key) {
  auto node = data_.extract(key);
  if (node.empty()) return false;
  bytes_ -= key.size() + node.mapped().value.size();
  erased(key, node.mapped().value);
  return true;
}

std::size_t KvStore::removePrefix(const std::string& prefix) {
  // erased() touches tombstones, observers and waiters, never data_: extracting in place is safe.
  std::size_t removed = 0;
  for (auto it = data_.begin(); it != data_.end();) {
    if (!it->first.starts_with(prefix)) {
      ++it;
      continue;
    }
    auto node = data_.extract(it++);
    bytes_ -= node.key().size() + node.mapped().value.size();
    erased(node.key(), node.mapped().value);
    ++removed;
  }
  for (auto it = queues_.begin(); it != queues_.end();) {
    if (!it->first.starts_with(prefix)) {
      ++it;
      continue;
    }
    bytes_ -= it->first.size();
    for (const auto& item : it->second) bytes_ -= item.size();
    it = queues_.erase(it);
    ++removed;
  }
  return removed;
}

std::optional<KeyChange> KvStore::changeSince(const std::vector<std::string>& keys,
                                              std::uint64_t since) const {
  std::optional<KeyChange> first;
  for (const auto& key : keys) {
    std::uint64_t revision = 0;
    const std::string* value = nullptr;
    if (const auto it = data_.find(key); it != data_.end()) {
      revision = it->second.revision;
      value = &it->second.value;
    } else if (const auto t = tombstones_.find(key); t != tombstones_.end()) {
      revision = t->second;
    } else if (since < compactedRevision_) {
      revision = compactedRevision_;  // it may have been deleted in between: say it is gone
    }
    if (revision <= since || (first && first->revision <= revision)) continue;
    first = KeyChange{key, value ? std::optional<std::string>(*value) : std::nullopt, revision};
  }
  return first;
}

KvStore::WatchId KvStore::observe(const std::string& key,
                                  std::function<void(const KeyEvent&)> seen) {
  const WatchId id = nextId_++;
  observersByKey_[key].push_back(id);
  observers_.emplace(id, Observer{key, std::move(seen)});
  return id;
}

void KvStore::unobserve(WatchId id) {
  const auto it = observers_.find(id);
  if (it == observers_.end()) return;
  if (const auto list = observersByKey_.find(it->second.key); list != observersByKey_.end()) {
    std::erase(list->second, id);
    if (list->second.empty()) observersByKey_.erase(list);
  }
  observers_.erase(it);
}

void KvStore::tell(ChangeKind kind, const std::string& key, std::string_view oldValue,
                   std::string_view newValue) {
  const auto list = observersByKey_.find(key);
  if (list == observersByKey_.end()) return;
  const KeyEvent event{kind, key, oldValue, newValue};
  // A copy: an observer may be removed while the event is being told.
  const std::vector<WatchId> ids = list->second;
  for (const WatchId id : ids) {
    if (const auto it = observers_.find(id); it != observers_.end()) it->second.seen(event);
  }
}

KvStore::WatchId KvStore::watch(const std::vector<std::string>& keys, std::function<void()> fire) {
  const WatchId id = nextId_++;
  for (const auto& key : keys) byKey_[key].push_back(id);
  watches_.emplace(id, Watch{keys, std::move(fire)});
  return id;
}

void KvStore::unwatch(WatchId id) {
  const auto it = watches_.find(id);
  if (it == watches_.end()) return;
  if (const auto& counter = it->second.counter) {
    if (const auto c = counterWatches_.find(counter->first); c != counterWatches_.end()) {
      auto [first, last] = c->second.equal_range(counter->second);
      for (auto w = first; w != last; ++w) {
        if (w->second == id) {
          c->second.erase(w);
          break;
        }
      }
      if (c->second.empty()) counterWatches_.erase(c);
    }
  }
  for (const auto& key : it->second.keys) {
    const auto list = byKey_.find(key);
    if (list == byKey_.end()) continue;
    std::erase(list->second, id);
    if (list->second.empty()) byKey_.erase(list);
  }
  watches_.erase(it);
}

KvStore::WatchId KvStore::watchCounter(const std::string& key, std::int64_t target,
                                       std::function<void()> fire) {
  const WatchId id = nextId_++;
  watches_.emplace(id, Watch{{}, std::move(fire), std::make_pair(key, target)});
  counterWatches_[key].emplace(target, id);
  return id;
}

void KvStore::fireCounter(const std::string& key, std::int64_t value) {
  const auto it = counterWatches_.find(key);
  if (it == counterWatches_.end()) return;
  auto& byTarget = it->second;
  std::vector<WatchId> due;
  for (auto w = byTarget.begin(); w != byTarget.end() && w->first <= value;) {
    due.push_back(w->second);
    w = byTarget.erase(w);
  }
  if (byTarget.empty()) counterWatches_.erase(it);
  for (const WatchId id : due) {
    const auto watch = watches_.find(id);
    if (watch == watches_.end()) continue;  // unwatched already
    auto fire = std::move(watch->second.fire);
    watches_.erase(watch);
    fire();
  }
}

void KvStore::notify(const std::string& key) {
  const auto list = byKey_.find(key);
  if (list == byKey_.end()) return;
  // Take the whole list at once: thousands of ranks may wait on one key (a barrier), and
  // removing them one by one from the vector would be quadratic.
  const std::vector<WatchId> ids = std::move(list->second);
  byKey_.erase(list);
  for (const WatchId id : ids) {
    const auto it = watches_.find(id);
    if (it == watches_.end()) continue;
    for (const auto& other : it->second.keys) {
      if (other == key) continue;
      if (const auto l = byKey_.find(other); l != byKey_.end()) {
        std::erase(l->second, id);
        if (l->second.empty()) byKey_.erase(l);
      }
    }
    auto fire = std::move(it->second.fire);
    watches_.erase(it);
    fire();
  }
}

std::optional<Response> StoreService::tryHandle(const Request& req) {
  Response resp;
  switch (req.op) {
    case Op::kPing:
      break;
    case Op::kSet:
      store_.set(req.keys[0], req.value);
      break;
    case Op::kGet: {
      auto value = store_.get(req.keys[0]);
      if (!value) return std::nullopt;
      resp.value = std::move(*value);
      break;
    }
    case Op::kAdd:
      resp.number = store_.add(req.keys[0], req.number);
      break;
    case Op::kCheck:
      resp.number = store_.containsAll(req.keys) ? 1 : 0;
      break;
    case Op::kWait:
      if (!store_.containsAll(req.keys)) return std::nullopt;
      break;
    case Op::kDelete:
      resp.number = store_.remove(req.keys[0]) ? 1 : 0;
      break;
    case Op::kNumKeys:
      resp.number = static_cast<std::int64_t>(store_.size());
      break;
    case Op::kCompareSet:
      resp.value = store_.compareSet(req.keys[0], req.value, req.value2);
      break;
    case Op::kAppend:
      resp.number = store_.append(req.keys[0], req.value);
      break;
    case Op::kMultiGet:
      for (const auto& key : req.keys) {
        auto value = store_.get(key);
        if (!value) {
          resp.status = Status::kError;
          resp.value = "MULTI_GET: key '" + key + "' does not exist";
          resp.values.clear();
          return resp;
        }
        resp.values.push_back(std::move(*value));
      }
      break;
    case Op::kMultiSet:
      for (std::size_t i = 0; i < req.keys.size(); ++i) store_.set(req.keys[i], req.values[i]);
      break;
    case Op::kRevision:
      resp.number = static_cast<std::int64_t>(store_.revision());
      break;
    case Op::kWatch: {
      const auto since = static_cast<std::uint64_t>(req.number);
      if (since > store_.revision()) {
        // Revisions only grow: this client saw a store that is gone (an idle run dropped and
        // begun again), and changes in between cannot be told. Say so rather than wait.
        resp.status = Status::kError;
        resp.value = "WATCH: revision " + std::to_string(since) + " is ahead of this run's (" +
                     std::to_string(store_.revision()) + "): the run was dropped and begun again";
        return resp;
      }
      auto change = store_.changeSince(req.keys, since);
      if (!change) return std::nullopt;
      resp.number = static_cast<std::int64_t>(change->revision);
      resp.value = std::move(change->key);
      if (change->value) resp.values.push_back(std::move(*change->value));
      break;
    }
    case Op::kHello:
    case Op::kAuth:
    case Op::kJoin:
    case Op::kHeartbeat:
    case Op::kEndRound:
    case Op::kCloseRun:
    case Op::kSucceeded:
    case Op::kEvent:
    case Op::kAddWait:
    case Op::kMux:
    case Op::kEndStream:
      resp.status = Status::kError;
      resp.value = opName(req.op) + " is not a store operation";
      break;
  }
  return resp;
}

}  // namespace fsdp::rendezvous
