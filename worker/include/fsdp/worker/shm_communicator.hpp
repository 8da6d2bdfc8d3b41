#pragma once
// The shared-memory backend for ranks on one node (CPU tensors). Rank 0 of the group creates
// a POSIX shared-memory segment, publishes its name through the store, the others map it, and
// rank 0 unlinks the name as soon as every rank has mapped it: from then on nothing of it can
// be left in /dev/shm, whatever happens to the job (the agent removes the segment of a job that
// died before that point: fsdp::removeShmSegments() in fsdp/common/shm.hpp).
//
// Each rank owns two staging slots in the segment. A collective moves through them in blocks:
// every rank copies its block in, one barrier, every rank reads (and reduces) what it needs
// from the others' slots; the two slots alternate, so that one barrier per block suffices.
// Each byte crosses memory once into shared memory and once out of it, on the ranks' own
// threads: no extra thread per rank competes with compute, and nothing goes through the
// kernel. Barriers spin briefly, then sleep on a futex.
//
// Operations run when issued, in issue order (every rank issues the same ones); the returned
// Work is complete, and carries the operation's error. A peer that dies is noticed within
// ~100 ms (its pid is gone) and one that stops arriving within the timeout; either way every
// rank's operation throws, naming the peer, and the group is unusable from then on.
//
// bf16 and fp16 are summed in fp32 and rounded once.

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker {

struct ShmOptions {
  int rank = 0;
  int size = 1;
  // Store keys of this communicator live under this prefix (per round, per group).
  std::string storePrefix = "shm";
  // The job's run id: segment names start with shmSegmentPrefix(runId, parent pid), what the
  // agent (the workers' parent) looks for when it cleans up after them.
  std::string runId = "none";
  // Bytes of one staging slot (two per rank).
  std::size_t slotBytes = std::size_t{512} << 10;  // fits a core's L2: the reader finds it in cache
  // Bound on attaching and on every operation.
  std::chrono::milliseconds timeout{300000};
};

// Collective over the group: blocks until every rank has mapped the segment. Throws
// TimeoutError naming the ranks that did not arrive, Error when the segment cannot be made.
std::unique_ptr<Communicator> createShmCommunicator(rendezvous::StoreClient& store,
                                                    const ShmOptions& options);

}  // namespace fsdp::worker
