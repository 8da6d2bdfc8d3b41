#pragma once
// The NCCL backend (CUDA tensors). Built when CMake finds the CUDA toolkit and NCCL
// (FSDP_HAVE_NCCL); with a CUDA LibTorch, operations are ordered against PyTorch's current
// stream, otherwise against the legacy default stream.
//
// Rank 0 creates the unique id and publishes it through the store under `storePrefix`; the
// others wait for it. Collectives run on a dedicated communication stream: each waits for an
// event recorded on the compute stream, and Work::wait() makes the compute stream wait for
// the operation's completion event (the host blocks only in barrier()). A failed or timed-out
// operation aborts the communicator and throws, naming the rank and the operation.

#include <chrono>
#include <memory>
#include <string>

#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int device = 0;  // CUDA device index of this rank (usually LOCAL_RANK)
  std::string storePrefix = "nccl";
  std::chrono::milliseconds timeout{300000};
};

// Throws ConfigError when NCCL support was not built, NetworkError/TimeoutError when the
// unique id cannot be exchanged, Error when NCCL fails to initialise.
std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options);

// Whether this build has NCCL support.
bool ncclAvailable();

}  // namespace fsdp::worker
