// HYBRID_SHARD's two groups: the ranks of a node (shard) and one local rank across nodes
// (replicate), both Gloo, connected through the job's store.
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {

HybridGroups makeHybridGroups(rendezvous::StoreClient& store, const HybridGroupOptions& options) {
  const int local = options.localWorldSize;
  if (local < 1 || options.worldSize % local != 0) {
    throw ConfigError("HYBRID_SHARD: world size " + std::to_string(options.worldSize) +
                      " is not a multiple of the local world size " + std::to_string(local));
  }
  const int node = options.rank / local;
  const int localRank = options.rank % local;
  HybridGroups groups;
  groups.shard = createGlooCommunicator(
      store, {.rank = localRank,
              .size = local,
              .localAddress = options.localAddress,
              .storePrefix = options.storePrefix + "/shard/" + std::to_string(node),
              .timeout = options.timeout});
  groups.replicate = createGlooCommunicator(
      store, {.rank = node,
              .size = options.worldSize / local,
              .localAddress = options.localAddress,
              .storePrefix = options.storePrefix + "/replicate/" + std::to_string(localRank),
              .timeout = options.timeout});
  return groups;
}

HybridGroups makeHybridGroups(Runtime& runtime) {
  const auto& env = runtime.env();
  return makeHybridGroups(runtime.store(), {.rank = env.rank,
                                            .worldSize = env.worldSize,
                                            .localWorldSize = env.localWorldSize,
                                            .localAddress = env.localAddress,
                                            .storePrefix = runtime.roundPrefix() + "gloo/hybrid"});
}

}  // namespace fsdp::worker
