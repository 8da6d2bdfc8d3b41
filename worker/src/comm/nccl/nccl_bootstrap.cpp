// Joining an NCCL group: rank 0's plan (a unique id, or a shrink of the last round's
// communicator) through the store, removed on every path, and the non-blocking init or shrink,
// under the deadline the exchange began with.
#include "nccl_bootstrap.hpp"

#include <optional>
#include <sstream>
#include <string_view>
#include <vector>

#include "fsdp/common/env.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "nccl_queue.hpp"

namespace fsdp::worker::detail {
namespace {

std::string who(const NcclOptions& o) {
  return "rank " + std::to_string(o.rank) + " of " + std::to_string(o.size) +
         " (cuda:" + std::to_string(o.device) + ")";
}

// Removes rank 0's keys when the exchange ends, however it ends: a later round, or a retry
// under the same prefix, must never read this id, nor count its readers.
class KeyRemover {
 public:
  KeyRemover(rendezvous::StoreClient& store, std::vector<std::string> keys)
      : store_(store), keys_(std::move(keys)) {}
  ~KeyRemover() {
    for (const auto& key : keys_) {
      try {
        store_.remove(key);
      } catch (const Error& e) {
        log::warn("NCCL bootstrap: could not remove '{}' from the store ({}): {}", key,
                  store_.endpoint(), e.what());
      }
    }
  }
  KeyRemover(const KeyRemover&) = delete;
  KeyRemover& operator=(const KeyRemover&) = delete;

 private:
  rendezvous::StoreClient& store_;
  std::vector<std::string> keys_;
};

// A shrink plan as published: never the length of a unique id, which is how readers tell them apart.
constexpr std::string_view kShrinkTag = "shrink:";

std::string encodeShrink(const std::vector<int>& exclude) {
  std::string value(kShrinkTag);
  for (std::size_t i = 0; i < exclude.size(); ++i) value += (i > 0 ? "," : "") + std::to_string(exclude[i]);
  if (value.size() == kNcclUniqueIdBytes) value += ',';
  return value;
}

// Where the ranks of a later round say what they hold: one line each, appended ("<new rank>
// <rank in the parent> <parent's size> <parent's prefix>", or "<new rank> -"), and a count.
std::string heldKey(const NcclOptions& options) { return options.storePrefix + "/held"; }
std::string heldCountKey(const NcclOptions& options) { return options.storePrefix + "/held_count"; }

std::string describeHeld(int rank, const NcclParent* parent) {
  std::string line = std::to_string(rank) + " ";
  if (parent == nullptr) return line + "-\n";
  return line + std::to_string(parent->rank) + " " + std::to_string(parent->size) + " " + parent->storePrefix + "\n";
}

// Rank 0, holding `parent`: the ranks of the parent to leave out when every rank of the group
// holds that same parent and they keep their order; nullopt otherwise (or when none is left out).
// Two requests, whatever the group's size.
std::optional<std::vector<int>> shrinkable(rendezvous::StoreClient& store, const NcclOptions& options,
                                           const NcclParent& parent, const Deadline& deadline) {
  std::vector<std::string> lines(static_cast<std::size_t>(options.size));
  if (options.size > 1) {
    const auto left = deadline.remaining();
    try {
      store.addAndWait(heldCountKey(options), 0, options.size - 1, left);
    } catch (const TimeoutError& e) {
      throw TimeoutError("NCCL bootstrap under '" + options.storePrefix + "': not every rank of " +
                         std::to_string(options.size) + " said which communicator it holds within the " +
                         std::to_string(left.count()) + " ms left (" + e.what() + ")");
    }
    std::istringstream all(store.get(heldKey(options), deadline.remaining()));
    std::string line;
    while (std::getline(all, line)) {
      std::istringstream fields(line);
      int r = -1;
      if (fields >> r && r > 0 && r < options.size) std::getline(fields >> std::ws, lines[static_cast<std::size_t>(r)]);
    }
  }
  std::vector<bool> kept(static_cast<std::size_t>(parent.size), false);
  kept[static_cast<std::size_t>(parent.rank)] = true;
  int previous = parent.rank;
  for (int r = 1; r < options.size; ++r) {
    std::istringstream held(lines[static_cast<std::size_t>(r)]);
    int rank = -1, size = -1;
    std::string prefix;
    if (!(held >> rank >> size >> prefix) || size != parent.size || prefix != parent.storePrefix ||
        rank <= previous || rank >= parent.size) {
      return std::nullopt;  // a new process, another communicator, or another order
    }
    kept[static_cast<std::size_t>(rank)] = true;
    previous = rank;
  }
  std::vector<int> exclude;
  for (int r = 0; r < parent.size; ++r) {
    if (!kept[static_cast<std::size_t>(r)]) exclude.push_back(r);
  }
  if (exclude.empty()) return std::nullopt;
  return exclude;
}

NcclPlan decodePlan(const std::string& key, const std::string& value) {
  if (value.size() == kNcclUniqueIdBytes) return {value, {}};
  NcclPlan plan;
  if (value.rfind(kShrinkTag, 0) == 0) {
    std::istringstream list(value.substr(kShrinkTag.size()));
    std::string item;
    while (std::getline(list, item, ',')) {
      if (item.empty()) continue;
      const auto rank = parseInt(item);
      if (!rank || *rank < 0) throw ProtocolError("NCCL plan under '" + key + "': '" + value + "' is not a list of ranks");
      plan.exclude.push_back(static_cast<int>(*rank));
    }
    if (!plan.exclude.empty()) return plan;
  }
  throw ProtocolError("NCCL unique id under '" + key + "' has " + std::to_string(value.size()) +
                      " bytes, expected " + std::to_string(kNcclUniqueIdBytes));
}

}  // namespace

NcclParent::NcclParent(std::shared_ptr<NcclApi> a, NcclComm c, int r, int s, int d, std::string prefix)
    : api(std::move(a)), comm(c), rank(r), size(s), device(d), storePrefix(std::move(prefix)) {}

NcclParent::~NcclParent() {
  std::scoped_lock issue(ncclDeviceMutex(device));
  api->commAbort(comm);
}

void checkNcclOptions(const NcclOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw ConfigError("NCCL communicator: rank " + std::to_string(options.rank) +
                      " is not in a world of size " + std::to_string(options.size));
  }
  if (options.storePrefix.empty()) throw ConfigError("NCCL communicator: empty store prefix");
}

std::string exchangeUniqueId(rendezvous::StoreClient& store, const NcclOptions& options,
                             NcclApi& api, const Deadline& deadline) {
  return exchangePlan(store, options, api, deadline, nullptr, false).uniqueId;
}

NcclPlan exchangePlan(rendezvous::StoreClient& store, const NcclOptions& options, NcclApi& api,
                      const Deadline& deadline, const NcclParent* parent, bool announce) {
  checkNcclOptions(options);
  const std::string key = options.storePrefix + "/unique_id";
  const std::string readers = options.storePrefix + "/unique_id_readers";
  if (options.rank == 0) {
    const bool gather = announce && parent != nullptr;
    // Every rank posted what it holds before it reads the plan: removed once all have read it.
    std::vector<std::string> keys{key, readers};
    if (announce && options.size > 1) keys.insert(keys.end(), {heldKey(options), heldCountKey(options)});
    const KeyRemover remover(store, std::move(keys));
    NcclPlan plan;
    std::string value;
    if (auto exclude = gather ? shrinkable(store, options, *parent, deadline) : std::nullopt) {
      plan.exclude = std::move(*exclude);
      value = encodeShrink(plan.exclude);
      log::info("NCCL: every rank of this round ({}) holds the last round's communicator (of {}) in its order: "
                "shrinking it, leaving out rank(s) {}",
                options.size, parent->size, value.substr(kShrinkTag.size()));
    } else {
      auto id = api.uniqueId();
      if (!id.result.isDone()) throw Error("ncclGetUniqueId on rank 0: " + id.result.cause);
      plan.uniqueId = value = std::move(id.handle);
    }
    store.set(key, value);
    if (options.size > 1) {
      const auto left = deadline.remaining();
      try {
        store.addAndWait(readers, 1, options.size, left);
      } catch (const TimeoutError& e) {
        throw TimeoutError("NCCL unique id under '" + key + "': not every rank of " +
                           std::to_string(options.size) + " read it within the " +
                           std::to_string(left.count()) + " ms left of the " +
                           std::to_string(options.timeout.count()) + " ms timeout (" + e.what() +
                           ")");
      }
    }
    return plan;
  }
  if (announce) {
    store.append(heldKey(options), describeHeld(options.rank, parent));
    store.add(heldCountKey(options), 1);
  }
  NcclPlan plan = decodePlan(key, store.get(key, deadline.remaining()));
  store.add(readers, 1);
  if (plan.shrinks() && parent == nullptr) {
    throw ProtocolError("NCCL plan under '" + key + "': rank 0 asks " + who(options) +
                        " to shrink a communicator it does not hold");
  }
  return plan;
}

NcclComm joinNcclGroup(rendezvous::StoreClient& store, const NcclOptions& options, NcclApi& api,
                       const Deadline& deadline, std::unique_ptr<NcclParent> parent, bool announce) {
  const NcclPlan plan = exchangePlan(store, options, api, deadline, parent.get(), announce);
  Made<NcclComm> made;
  const char* call = plan.shrinks() ? "ncclCommShrink" : "ncclCommInitRank";
  if (plan.shrinks()) {
    std::scoped_lock issue(ncclDeviceMutex(parent->device));
    made = api.commShrink(parent->comm, plan.exclude, deadline);
  } else {
    parent.reset();  // the last round's resources go before the new communicator's
    made = api.commInitRank(options.size, plan.uniqueId, options.rank);
  }
  auto result = made.result;
  if (made.handle != nullptr) result = settle(api, made.handle, result, deadline);
  // The parent goes once its child no longer uses it (a shrink's init runs on the parent's
  // bootstrap): after the child settled, or after the child's abort.
  if (result.isDone()) {
    parent.reset();
    return made.handle;
  }
  if (made.handle != nullptr) api.commAbort(made.handle);
  parent.reset();
  if (result.isPending()) {
    throw TimeoutError(std::string(call) + " on " + who(options) + " did not finish within the " +
                       std::to_string(options.timeout.count()) +
                       " ms that the unique-id exchange and initialisation share: a rank did not "
                       "join or cannot reach this one (check NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO)");
  }
  throw Error(std::string(call) + " on " + who(options) + ": " + result.cause);
}

}  // namespace fsdp::worker::detail
