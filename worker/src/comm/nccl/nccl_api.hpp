#pragma once
// The seam between the NCCL communicator and CUDA/NCCL: the handful of runtime and NCCL calls it
// makes, behind one interface, so that its logic (streams, locks, failures, shutdown) runs in
// CPU tests over a fake (tests/unit/worker/nccl/fake_nccl_api.hpp). Nothing here includes CUDA: the
// handles are opaque, and only nccl_cuda_api.cpp knows cudart and nccl.h.
//
// Thread-safety: every call may come from any thread (as cudart and NCCL allow: one
// communicator's calls are serialised by its NcclQueue).

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/common/deadline.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker::detail {

using CudaStream = void*;  // cudaStream_t
using CudaEvent = void*;   // cudaEvent_t
using NcclComm = void*;    // ncclComm_t

inline constexpr std::size_t kNcclUniqueIdBytes = 128;  // sizeof(ncclUniqueId)

// What one call answered: done, still in progress (a non-blocking NCCL call not settled yet,
// an event not reached yet), or failed, with CUDA's or NCCL's words for why.
struct ApiResult {
  enum class Code { kDone, kPending, kFailed };
  Code code = Code::kDone;
  std::string cause;  // kFailed only

  static ApiResult done() { return {}; }
  static ApiResult pending() { return {Code::kPending, {}}; }
  static ApiResult failed(std::string why) { return {Code::kFailed, std::move(why)}; }
  bool isDone() const { return code == Code::kDone; }
  bool isPending() const { return code == Code::kPending; }
  bool isFailed() const { return code == Code::kFailed; }
};

// A handle made by a call, valid when `result` is done (pending too, for a non-blocking init).
template <typename Handle>
struct Made {
  ApiResult result;
  Handle handle{};
};

// The dtypes NCCL reduces and moves (the communicator refuses the others before issuing).
inline bool ncclSupports(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kInt:
    case at::kLong:
    case at::kByte:
    case at::kChar:
      return true;
    default:
      return false;
  }
}

class NcclApi {
 public:
  virtual ~NcclApi() = default;

  // CUDA runtime. deviceCount(): 0 without a driver or device; currentDevice(): -1 unknown.
  virtual int deviceCount() = 0;
  virtual int currentDevice() = 0;
  virtual ApiResult setDevice(int device) = 0;
  // The stream LibTorch computes on for `device` in the *calling thread* (PyTorch's current
  // stream is per thread; the legacy default stream without a CUDA LibTorch).
  virtual CudaStream currentStream(int device) = 0;
  virtual Made<CudaStream> createStream() = 0;  // non-blocking, on the current device
  virtual void destroyStream(CudaStream stream) = 0;
  virtual Made<void*> allocate(std::size_t bytes) = 0;
  virtual void release(void* memory) = 0;
  virtual Made<CudaEvent> createEvent() = 0;  // timing disabled
  virtual void destroyEvent(CudaEvent event) = 0;
  virtual ApiResult recordEvent(CudaEvent event, CudaStream stream) = 0;
  // Done: the event's last record was reached; pending: not yet.
  virtual ApiResult queryEvent(CudaEvent event) = 0;
  // `stream` waits (on the device, not the host) for `event`'s record made before this call.
  virtual ApiResult streamWaitEvent(CudaStream stream, CudaEvent event) = 0;
  virtual ApiResult synchronizeStream(CudaStream stream) = 0;  // blocks the host

  // NCCL.
  virtual Made<std::string> uniqueId() = 0;  // kNcclUniqueIdBytes bytes
  // Non-blocking (config.blocking = 0): the handle comes back at once, the result may be
  // pending; commAsyncError() tells when it settled.
  virtual Made<NcclComm> commInitRank(int size, const std::string& uniqueId, int rank) = 0;
  // Done: healthy and nothing pending; pending: a non-blocking call still settles; failed.
  virtual ApiResult commAsyncError(NcclComm comm) = 0;
  virtual ApiResult commFinalize(NcclComm comm) = 0;  // non-blocking too
  virtual void commDestroy(NcclComm comm) = 0;
  // Ends the communicator and the kernels it has queued, even those stuck on a dead peer.
  virtual void commAbort(NcclComm comm) = 0;
  // Whether the library can revoke a communicator and shrink it to its survivors
  // (ncclCommRevoke and ncclCommShrink, NCCL 2.28 and later, looked up when the library is
  // loaded: an older one answers false and the two calls below are never made).
  virtual bool canShrink() = 0;
  // ncclCommRevoke: ends the operations in flight, kernels included, and keeps the communicator
  // for a shrink; pending until it is quiescent (commAsyncError() says when).
  virtual ApiResult commRevoke(NcclComm comm) = 0;
  // ncclCommShrink (non-blocking, the parent's configuration): every rank not in `exclude` calls
  // it with the same list; the new communicator numbers them in their old order. NCCL runs it as
  // a job of the parent and hands the new communicator out only when that job ends: the call
  // waits for it, until `deadline` (pending then, with no communicator: the caller aborts the
  // parent, which ends the job). Failed with a communicator: abort it. The wait is awaitChild's
  // (nccl_queue.hpp): NCCL 2.28.9's call returns ncclSuccess with its job still running, and on an
  // H200 (scripts/gpu-reform, 2026-11-30) reading the child then, and freeing the pointer its job
  // later wrote through, corrupted the survivors' heap in both runs that planned a shrink.
  virtual Made<NcclComm> commShrink(NcclComm parent, const std::vector<int>& exclude, const Deadline& deadline) = 0;
  virtual ApiResult allReduce(const void* send, void* recv, std::size_t count, at::ScalarType type,
                              ReduceOp op, NcclComm comm, CudaStream stream) = 0;
  virtual ApiResult allGather(const void* send, void* recv, std::size_t countPerRank,
                              at::ScalarType type, NcclComm comm, CudaStream stream) = 0;
  virtual ApiResult reduceScatter(const void* send, void* recv, std::size_t countPerRank,
                                  at::ScalarType type, ReduceOp op, NcclComm comm,
                                  CudaStream stream) = 0;
  virtual ApiResult broadcast(const void* send, void* recv, std::size_t count, at::ScalarType type,
                              int root, NcclComm comm, CudaStream stream) = 0;
};

// The reduction NCCL is asked for: `op`, except an average at one rank, which is a sum (the same
// bits: the input itself). NCCL up to 2.28 computes an average at one rank with a kernel
// (ncclAvg's pre-multiplied sum, src/device/onerank.cu) whose 32 blocks take count/32 elements
// each, rounded down before it is aligned: where that is already aligned, the last count % 32
// elements are never written. Seen on an H200 with NCCL 2.28.9: a reduce-scatter of 262,147 floats
// (FSDP's gradient average at world size 1) left its last 3 uninitialised; NCCL 2.29 rounds up.
// A sum at one rank is a plain copy in NCCL.
ReduceOp ncclReduction(ReduceOp op, int worldSize);

// The real one, over cudart and NCCL (nccl_cuda_api.cpp). Throws ConfigError in a build
// without NCCL.
std::shared_ptr<NcclApi> cudaNcclApi();

// The loaded NCCL library's version (ncclGetVersion: 22800 for 2.28.0), 0 in a build without
// NCCL. Needs no device.
int ncclLibraryVersion();

}  // namespace fsdp::worker::detail
