// Joining an NCCL group: rank 0's unique id through the store, removed on every path, and the
// non-blocking init, under the deadline the exchange began with.
#include "nccl_bootstrap.hpp"

#include <vector>

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
        log::warn("NCCL unique id: could not remove '{}' from the store ({}): {}", key,
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

}  // namespace

void checkNcclOptions(const NcclOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw ConfigError("NCCL communicator: rank " + std::to_string(options.rank) +
                      " is not in a world of size " + std::to_string(options.size));
  }
  if (options.storePrefix.empty()) throw ConfigError("NCCL communicator: empty store prefix");
}

std::string exchangeUniqueId(rendezvous::StoreClient& store, const NcclOptions& options,
                             NcclApi& api, const Deadline& deadline) {
  checkNcclOptions(options);
  const std::string key = options.storePrefix + "/unique_id";
  const std::string readers = options.storePrefix + "/unique_id_readers";
  if (options.rank == 0) {
    auto id = api.uniqueId();
    if (!id.result.isDone()) throw Error("ncclGetUniqueId on rank 0: " + id.result.cause);
    const KeyRemover remover(store, {key, readers});
    store.set(key, id.handle);
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
    return std::move(id.handle);
  }
  const std::string value = store.get(key, deadline.remaining());
  if (value.size() != kNcclUniqueIdBytes) {
    throw ProtocolError("NCCL unique id under '" + key + "' has " + std::to_string(value.size()) +
                        " bytes, expected " + std::to_string(kNcclUniqueIdBytes));
  }
  store.add(readers, 1);
  return value;
}

NcclComm joinNcclGroup(rendezvous::StoreClient& store, const NcclOptions& options, NcclApi& api,
                       const Deadline& deadline) {
  const std::string id = exchangeUniqueId(store, options, api, deadline);
  auto made = api.commInitRank(options.size, id, options.rank);
  auto result = made.result;
  if (made.handle != nullptr) result = settle(api, made.handle, result, deadline);
  if (result.isDone()) return made.handle;
  if (made.handle != nullptr) api.commAbort(made.handle);
  if (result.isPending()) {
    throw TimeoutError("ncclCommInitRank on " + who(options) + " did not finish within the " +
                       std::to_string(options.timeout.count()) +
                       " ms that the unique-id exchange and initialisation share: a rank did not "
                       "join or cannot reach this one (check NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO)");
  }
  throw Error("ncclCommInitRank on " + who(options) + ": " + result.cause);
}

}  // namespace fsdp::worker::detail
