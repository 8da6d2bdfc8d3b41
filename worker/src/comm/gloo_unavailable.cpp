// The Gloo entry points of a libfsdp built without Gloo (cmake/FsdpGloo.cmake): every request
// for a Gloo communicator is refused with the reason the build was configured with.
#include "fsdp/common/error.hpp"
#include "fsdp/worker/gloo_communicator.hpp"

#ifndef FSDP_GLOO_REASON
#define FSDP_GLOO_REASON "configured without Gloo"
#endif

namespace fsdp::worker {

bool glooAvailable() { return false; }
const char* glooUnavailableReason() { return FSDP_GLOO_REASON; }

std::unique_ptr<Communicator> createGlooCommunicator(rendezvous::StoreClient& /*store*/,
                                                     const GlooOptions& options) {
  throw ConfigError("Gloo communicator (rank " + std::to_string(options.rank) + " of " +
                    std::to_string(options.size) + ", " + options.storePrefix +
                    "): this libfsdp was built without Gloo: " + FSDP_GLOO_REASON +
                    "; use FSDPRUN_BACKEND=shm or nccl inside one node");
}

}  // namespace fsdp::worker
