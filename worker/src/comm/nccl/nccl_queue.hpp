#pragma once
// One NCCL communicator's operations in flight: issued on its communication stream in call
// order, ordered after the compute stream by events from a pool, watched until done, aborted on
// a failure or a deadline, and the communicator closed (finalized, or aborted) at the end.
// Knows no tensors' shapes and no CUDA: it talks to both through NcclApi (nccl_api.hpp).
//
// Streams. The compute stream is the launching thread's current stream at launch() (PyTorch's
// is per thread); the operation keeps it, and its Work's wait(), the abort and the release of
// its tensors are ordered against that stream, whichever thread runs them.
//
// Locks. No lock is held while a non-blocking enqueue or finalize settles: the watchdog,
// wait(), ready() and the device's other communicators go on while one polls. Launches of one
// communicator go out one at a time (NCCL takes them in order, each settled before the next);
// NCCL calls of all communicators of a device are serialised by one mutex per device, held
// for each call only ("not safe to issue operations in parallel to communicators of one
// device").
//
// Failures. The first failure (an event or NCCL error, an operation past its deadline, an
// enqueue that fails or does not settle in time) aborts the communicator; every pending and
// later operation throws fsdp::Error naming the rank, the device, the operation and the cause.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/common/deadline.hpp"
#include "fsdp/worker/communicator.hpp"
#include "nccl_api.hpp"

namespace fsdp::worker::detail {

struct NcclQueueOptions {
  int rank = 0;
  int size = 1;
  int device = 0;
  // Bound on each operation (its enqueue and its completion) and on the close.
  std::chrono::milliseconds timeout{300000};
};

// What Work::wait() does besides rethrowing a failure: order the compute stream after the
// operation (no host wait), or also block the host until it is done (barrier).
enum class WaitMode { kStream, kHost };

struct QueueState;

class NcclQueue {
 public:
  // Issues the collective on the communicator and the stream it is given; called with the
  // device's NCCL mutex held.
  using Issue = std::function<ApiResult(NcclComm comm, CudaStream stream)>;

  // Takes ownership of `comm` and `stream` (a stream of options.device) and starts the
  // watchdog.
  NcclQueue(std::shared_ptr<NcclApi> api, NcclComm comm, CudaStream stream,
            NcclQueueOptions options);
  // Closing. Destroyed during stack unwinding (an error elsewhere: peers may be gone) or after
  // a failure, it aborts at once. Otherwise the operations in flight finish and the
  // communicator is finalized under one deadline (options.timeout), aborted when it passes.
  ~NcclQueue();
  NcclQueue(const NcclQueue&) = delete;
  NcclQueue& operator=(const NcclQueue&) = delete;

  // Orders the operation after the calling thread's current stream, issues it and hands it to
  // the watchdog; `tensors` stay referenced until it is done (or, after an abort, until the
  // compute stream is ordered after it). Throws fsdp::Error naming `op` when it cannot be
  // issued; an operation whose completion event could not be recorded is never queued.
  // Thread-safe.
  Work launch(const std::string& op, std::vector<at::Tensor> tensors, const Issue& issue,
              WaitMode mode = WaitMode::kStream);

  // Communicator::abort: ncclCommAbort, every pending operation failed (waiters woken) and every
  // later one refused with fsdp::CommAborted naming `why`; then the communication stream is
  // synchronised, and false returned (with the error logged) when that fails: a sticky CUDA
  // error, which only a new process clears. Thread-safe.
  // On a library that shrinks (NcclApi::canShrink), a communicator that had not failed is revoked
  // instead (ncclCommRevoke: its kernels end as with an abort) and kept for takeRevoked(); a
  // revoke that fails or does not settle within kRevokeBound is followed by the abort.
  bool abort(const std::string& why);

  // After such a revoke: the communicator, now the caller's (to shrink, then abort); nullptr
  // when there is none (no abort yet, an older library, a failure first). Untaken, the queue's
  // destructor aborts it. Thread-safe.
  NcclComm takeRevoked();

 private:
  std::shared_ptr<NcclApi> api_;
  std::shared_ptr<QueueState> state_;
  CudaStream stream_;
  NcclQueueOptions options_;
  std::mutex issueMutex_;  // one launch at a time, in call order
  std::thread watchdog_;
};

// How long abort() waits for a revoke to settle (ncclCommRevoke ends the kernels, then waits for
// the communicator's streams and proxy): past it the communicator is aborted instead.
inline constexpr std::chrono::milliseconds kRevokeBound{30000};

// NCCL: "it is not safe to issue NCCL operations in parallel to independent communicators
// located on the same device". Every communicator of a device (HYBRID_SHARD has three) issues,
// aborts, finalizes, revokes, shrinks and destroys under that device's mutex, always taken after
// a queue's own state's, and held for one call, never across a poll.
std::mutex& ncclDeviceMutex(int device);

// Polls a non-blocking NCCL call (init, finalize) until it settled or `deadline` passed; returns
// its result (pending: the deadline passed first). Holds no lock.
ApiResult settle(NcclApi& api, NcclComm comm, ApiResult result, const Deadline& deadline);

// The end of a non-blocking ncclCommShrink (or split): the call starts a job of the parent that
// writes the new communicator through the pointer it was given when it ends, and what the call
// returns does not say when that is: NCCL 2.28.9's returns ncclSuccess with the job still running
// (an init's returns ncclInProgress). The parent's asynchronous error does: in progress until the
// job ended. So the parent is polled whatever the call returned (`called`), and `child` (the
// pointer's value) read only once that is settled; pending at `deadline`, with no communicator (the
// job still owns the pointer). Done without a communicator is a failure.
Made<NcclComm> awaitChild(NcclApi& api, const std::string& call, NcclComm parent, ApiResult called,
                          const std::function<NcclComm()>& child, const Deadline& deadline);

}  // namespace fsdp::worker::detail
