// HYBRID_SHARD's two groups: the ranks of a node (shard) and one local rank across nodes
// (replicate): Gloo for CPU worlds (the node's group over shared memory when fsdp::init() chose
// it) and NCCL (new unique ids under the round) for GPU ones,
// connected through the job's store.
#include "fsdp/worker/fsdp.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "fsdp/worker/shm_communicator.hpp"
#include "fsdp/worker/runtime.hpp"
#include "comm/recorded_communicator.hpp"

namespace fsdp::worker {

HybridGroups makeHybridGroups(rendezvous::StoreClient& store, const HybridGroupOptions& options) {
  const int local = options.localWorldSize;
  if (local < 1 || options.worldSize % local != 0) {
    throw ConfigError("HYBRID_SHARD: world size " + std::to_string(options.worldSize) +
                      " is not a multiple of the local world size " + std::to_string(local));
  }
  const int node = options.rank / local;
  const int localRank = options.rank % local;
  const auto group = [&](int rank, int size, const std::string& prefix) -> std::unique_ptr<Communicator> {
    if (options.deviceType == c10::DeviceType::CUDA) {
      return createNcclCommunicator(store, {.rank = rank,
                                            .size = size,
                                            .device = options.device,
                                            .storePrefix = prefix,
                                            .timeout = options.timeout});
    }
    if (options.deviceType != c10::DeviceType::CPU) {
      throw ConfigError("HYBRID_SHARD: no communicator for " +
                        c10::DeviceTypeName(options.deviceType, /*lower_case=*/true) + " tensors");
    }
    return createGlooCommunicator(store, {.rank = rank,
                                          .size = size,
                                          .localAddress = options.localAddress,
                                          .storePrefix = prefix,
                                          .timeout = options.timeout});
  };
  HybridGroups groups;
  const std::string shardPrefix = options.storePrefix + "/shard/" + std::to_string(node);
  if (options.sharedMemoryShard && options.deviceType == c10::DeviceType::CPU && local > 1) {
    groups.shard = createShmCommunicator(store, {.rank = localRank,
                                                 .size = local,
                                                 .storePrefix = shardPrefix + "/shm",
                                                 .runId = options.runId,
                                                 .timeout = options.timeout});
  } else {
    groups.shard = group(localRank, local, shardPrefix);
  }
  groups.replicate = group(node, options.worldSize / local,
                           options.storePrefix + "/replicate/" + std::to_string(localRank));
  groups.shard = detail::recordCollectives(std::move(groups.shard), "shard/" + std::to_string(node));
  groups.replicate = detail::recordCollectives(std::move(groups.replicate), "replicate/" + std::to_string(localRank));
  return groups;
}

HybridGroups makeHybridGroups(Runtime& runtime) {
  const auto& env = runtime.env();
  const auto device = runtime.device();
  const bool cuda = device.type() == c10::DeviceType::CUDA;
  return makeHybridGroups(runtime.store(),
                          {.rank = env.rank,
                           .worldSize = env.worldSize,
                           .localWorldSize = env.localWorldSize,
                           .localAddress = env.localAddress,
                           .storePrefix = runtime.roundPrefix() + (cuda ? "nccl/hybrid" : "gloo/hybrid"),
                           .deviceType = device.type(),
                           .device = cuda ? device.index() : 0,
                           .sharedMemoryShard = runtime.backend() == Backend::kShm,
                           .runId = env.runId});
}

}  // namespace fsdp::worker
