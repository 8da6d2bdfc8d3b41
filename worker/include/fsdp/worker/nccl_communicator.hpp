#pragma once
// The NCCL backend (CUDA tensors). Built when CMake finds the CUDA runtime and NCCL
// (FSDP_HAVE_NCCL). The compute stream of an operation is the launching thread's current stream
// at launch (PyTorch's is per thread; the legacy default stream without a CUDA LibTorch): its
// Work::wait(), an abort and the release of its tensors are ordered against that stream, from
// whichever thread they run.
//
// The unique id: rank 0 draws it and publishes it under `storePrefix` (fsdp::init() puts that
// under the round, "round/<n>/nccl/world"), the others wait for it, and rank 0 deletes it once
// every rank has read it, or when the exchange fails: a new round never sees an old id.
//
// Initialisation is non-blocking (ncclCommInitRankConfig, blocking = 0); the exchange and the
// initialisation together are bounded by the timeout. Collectives run on a dedicated
// communication stream: each waits for an event recorded on the compute stream; Work::wait()
// makes the compute stream wait for the operation's completion event without blocking the host
// (barrier() blocks the host, bounded). Events come from a pool. The tensors of an operation
// stay referenced until its event completed (no recordStream).
//
// A watchdog thread per communicator sleeps while nothing is in flight and otherwise checks,
// every millisecond, completion events, ncclCommGetAsyncError and each operation's deadline.
// On a failure it aborts the communicator (ncclCommAbort, which also ends kernels stuck on a
// dead peer), and every pending and later operation throws fsdp::Error naming the rank, the
// operation and the cause. No lock is held while a non-blocking call settles.
//
// Communicator::abort() (an in-process re-formation) fails what is in flight and later
// operations with fsdp::CommAborted; on NCCL 2.28+ it revokes the communicator (ncclCommRevoke:
// the kernels end as with an abort) instead of aborting it, so that the next round of
// fsdp::init()'s runtime can shrink it to the survivors (FSDP_NCCL_SHRINK=0 turns that off).
//
// Destruction: during stack unwinding, or after a failure, the communicator is aborted at once;
// otherwise operations in flight finish and it is finalized, within one timeout (aborted past
// it).

#include <chrono>
#include <memory>
#include <string>

#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int device = 0;  // CUDA device index of this rank (fsdp::init(): LOCAL_RANK modulo the visible)
  std::string storePrefix = "nccl";
  // Bound on the unique-id exchange and initialisation together, on every operation, and on the
  // close (waiting for operations in flight and finalizing together).
  std::chrono::milliseconds timeout{300000};
};

// Throws ConfigError when NCCL support was not built or the options are inconsistent,
// NetworkError/TimeoutError when the unique id cannot be exchanged, TimeoutError when a rank
// does not join within the timeout, Error when CUDA or NCCL fail (naming the rank).
std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options);

// The unique-id exchange of createNcclCommunicator on its own (it needs no GPU): returns the
// ncclUniqueId's 128 bytes, the same on every rank of the group. Rank 0 returns once every
// rank has read the id and the key is deleted. Throws ConfigError without NCCL in the build.
std::string exchangeNcclUniqueId(rendezvous::StoreClient& store, const NcclOptions& options);

// Whether this build has NCCL support.
bool ncclAvailable();

// CUDA devices visible to this process (0 without NCCL support, without a driver or device).
int cudaDeviceCount();

}  // namespace fsdp::worker
