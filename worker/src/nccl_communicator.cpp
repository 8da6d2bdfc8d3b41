// The NCCL communicator: unique id through the store, non-blocking bounded init, operations on
// a communication stream ordered by events, a watchdog that aborts on a failure or a deadline.
#include "fsdp/worker/nccl_communicator.hpp"

#include "fsdp/common/error.hpp"

#if FSDP_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "fsdp/common/log.hpp"

// Debian's CPU LibTorch ships c10/cuda headers without the generated macros header; only a
// CUDA LibTorch has it, so that header tells the two apart.
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define FSDP_TORCH_CUDA 1
#else
#define FSDP_TORCH_CUDA 0
#endif
#if defined(FSDP_EXPECT_TORCH_CUDA) && !FSDP_TORCH_CUDA
#error "fsdp_nccl_torch_cuda_check must compile the CUDA LibTorch branch"
#endif

namespace fsdp::worker {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(1);

std::string rankText(int rank, int size) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(size);
}

void checkCuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw Error(what + ": " + cudaGetErrorString(err));
}

// The stream LibTorch computes on for `device` (the legacy default stream without a CUDA
// LibTorch).
cudaStream_t computeStream([[maybe_unused]] int device) {
#if FSDP_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  return cudaStreamLegacy;
#endif
}

ncclDataType_t ncclType(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default:
      throw Error(std::string(op) + ": dtype " + c10::toString(type) +
                  " is not supported by the NCCL communicator");
  }
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAverage: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

std::string ncclCause(ncclResult_t result) {
  std::string cause = ncclGetErrorString(result);
  if (const char* last = ncclGetLastError(nullptr); last != nullptr && *last != '\0') {
    cause += " (" + std::string(last) + ")";
  }
  return cause;
}

// Polls a non-blocking communicator until its pending call (init, an enqueue, finalize) is
// done; returns its result, or ncclInProgress when `deadline` passed first.
ncclResult_t settle(ncclComm_t comm, ncclResult_t result, Clock::time_point deadline) {
  while (result == ncclInProgress) {
    if (Clock::now() > deadline) return ncclInProgress;
    std::this_thread::sleep_for(kPoll);
    if (ncclCommGetAsyncError(comm, &result) != ncclSuccess) return ncclSystemError;
  }
  return result;
}

// Makes `device` the calling thread's current device for the guard's lifetime: events, streams
// and the legacy default stream all belong to the current device of the thread that uses them.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) checkCuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// NCCL: "it is not safe to issue NCCL operations in parallel to independent communicators
// located on the same device". Every communicator of a device (HYBRID_SHARD has three) issues,
// aborts and destroys under that device's mutex, always taken after its own.
std::mutex& deviceMutex(int device) {
  static std::mutex guard;
  static std::map<int, std::unique_ptr<std::mutex>> perDevice;
  std::scoped_lock lock(guard);
  auto& m = perDevice[device];
  if (!m) m = std::make_unique<std::mutex>();
  return *m;
}

// One CUDA event, owned.
class Event {
 public:
  Event() { checkCuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// One issued operation. It keeps its tensors until its event completed, so that their memory
// is not reused by the compute stream while NCCL still reads or writes it.
struct Operation {
  std::string name;
  Event done;
  std::vector<at::Tensor> tensors;
  Clock::time_point deadline;
  // Guarded by Shared::mutex.
  bool finished = false;
  std::string error;
};

// What the communicator, its watchdog and its Work handles share.
struct Shared {
  std::mutex mutex;
  std::condition_variable changed;  // an operation was issued, finished or failed; stop
  ncclComm_t comm = nullptr;         // nullptr once aborted or destroyed
  std::deque<std::shared_ptr<Operation>> inFlight;
  std::string error;  // the first failure; every later operation throws it
  bool stop = false;
  int rank = 0;
  int size = 1;
  int device = 0;

  // Aborts the communicator and fails every pending operation. Caller holds `mutex`.
  void failLocked(std::string op, const std::string& cause) {
    if (error.empty()) {
      error = "nccl " + op + " failed on " + rankText(rank, size) + " (cuda:" +
              std::to_string(device) + "): " + cause + "; the communicator was aborted";
      log::error("{}", error);
    }
    if (comm != nullptr) {
      std::scoped_lock issue(deviceMutex(device));
      ncclCommAbort(comm);
    }
    comm = nullptr;
    // Kernels already queued may still start or exit after the abort: the compute stream is
    // ordered after the last one before their tensors go back to the allocator.
    if (!inFlight.empty()) {
      const DeviceGuard onDevice(device);
      cudaStreamWaitEvent(computeStream(device), inFlight.back()->done.get(), 0);
    }
    for (auto& pending : inFlight) pending->error = error;
    inFlight.clear();
    changed.notify_all();
  }

  // The error an operation named `op` meets now, or "" when it may go on. Caller holds `mutex`.
  std::string refusalLocked(const std::string& op) const {
    if (!error.empty()) return error + "; " + op + " was not run";
    if (comm == nullptr) return "nccl " + op + " on " + rankText(rank, size) + ": the communicator is closed";
    return "";
  }
};

// Retires finished operations in issue order and watches the oldest one's deadline and the
// communicator's asynchronous error. Sleeps while nothing is in flight.
void watchdog(std::shared_ptr<Shared> shared) {
  cudaSetDevice(shared->device);
  std::unique_lock lock(shared->mutex);
  while (!shared->stop) {
    if (shared->inFlight.empty()) {
      shared->changed.wait(lock, [&] { return shared->stop || !shared->inFlight.empty(); });
      continue;
    }
    std::vector<std::shared_ptr<Operation>> retired;
    while (!shared->inFlight.empty()) {
      auto& front = shared->inFlight.front();
      const auto state = cudaEventQuery(front->done.get());
      if (state == cudaErrorNotReady) break;
      if (state != cudaSuccess) {
        shared->failLocked(front->name, std::string("CUDA: ") + cudaGetErrorString(state));
        break;
      }
      front->finished = true;
      retired.push_back(std::move(front));
      shared->inFlight.pop_front();
    }
    if (!retired.empty()) shared->changed.notify_all();
    if (!shared->inFlight.empty() && shared->comm != nullptr) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(shared->comm, &async);
      const auto& oldest = *shared->inFlight.front();
      if (async != ncclSuccess && async != ncclInProgress) {
        shared->failLocked(oldest.name, ncclCause(async));
      } else if (Clock::now() > oldest.deadline) {
        shared->failLocked(oldest.name, "did not finish within its timeout (a peer died, stopped or "
                                        "issued different operations)");
      }
    }
    // The tensors go back to the allocator outside the lock.
    lock.unlock();
    retired.clear();
    lock.lock();
    if (!shared->inFlight.empty()) shared->changed.wait_for(lock, kPoll);
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, void* scratch, NcclOptions options)
      : shared_(std::make_shared<Shared>()), stream_(stream), scratch_(scratch),
        options_(std::move(options)) {
    shared_->comm = comm;
    shared_->rank = options_.rank;
    shared_->size = options_.size;
    shared_->device = options_.device;
    watchdog_ = std::thread(watchdog, shared_);
  }

  ~NcclCommunicator() override {
    {
      // Operations still in flight finish (bounded by their deadlines, which the watchdog
      // enforces) before the communicator goes.
      std::unique_lock lock(shared_->mutex);
      shared_->changed.wait(lock, [&] { return shared_->inFlight.empty(); });
      shared_->stop = true;
      shared_->changed.notify_all();
    }
    watchdog_.join();
    const DeviceGuard onDevice(options_.device);
    if (shared_->comm != nullptr) {
      std::scoped_lock issue(deviceMutex(options_.device));
      const auto deadline = Clock::now() + options_.timeout;
      if (settle(shared_->comm, ncclCommFinalize(shared_->comm), deadline) == ncclSuccess) {
        ncclCommDestroy(shared_->comm);
      } else {
        ncclCommAbort(shared_->comm);
      }
      shared_->comm = nullptr;
    }
    cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CUDA; }
  c10::Device device() const override {
    return {c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(options_.device)};
  }
  const char* backendName() const override { return "NCCL"; }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    check(tensor, "allReduce");
    const auto type = ncclType(tensor.scalar_type(), "allReduce");
    return launch("allReduce", {tensor}, [&](ncclComm_t comm) {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                           type, ncclOp(op), comm, stream_);
    });
  }

  Work allGather(at::Tensor input, at::Tensor output) override {
    check(input, "allGather");
    check(output, "allGather");
    checkSameType(input, output, "allGather");
    if (output.numel() != input.numel() * size()) {
      throw Error("allGather: the NCCL communicator needs equal chunks (output " +
                  std::to_string(output.numel()) + " = " + std::to_string(size()) + " x input " +
                  std::to_string(input.numel()) + "); FSDP pads its flat parameters so");
    }
    const auto type = ncclType(input.scalar_type(), "allGather");
    return launch("allGather", {input, output}, [&](ncclComm_t comm) {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                           type, comm, stream_);
    });
  }

  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    check(input, "reduceScatter");
    check(output, "reduceScatter");
    checkSameType(input, output, "reduceScatter");
    if (input.numel() != output.numel() * size()) {
      throw Error("reduceScatter: the NCCL communicator needs equal chunks (input " +
                  std::to_string(input.numel()) + " = " + std::to_string(size()) + " x output " +
                  std::to_string(output.numel()) + ")");
    }
    const auto type = ncclType(input.scalar_type(), "reduceScatter");
    return launch("reduceScatter", {input, output}, [&](ncclComm_t comm) {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(),
                               static_cast<size_t>(output.numel()), type, ncclOp(op), comm, stream_);
    });
  }

  Work broadcast(at::Tensor tensor, int root) override {
    check(tensor, "broadcast");
    if (root < 0 || root >= size()) {
      throw Error("broadcast: root " + std::to_string(root) + " is not a rank of " +
                  std::to_string(size()));
    }
    const auto type = ncclType(tensor.scalar_type(), "broadcast");
    return launch("broadcast", {tensor}, [&](ncclComm_t comm) {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                           type, root, comm, stream_);
    });
  }

  // A one-element all-reduce on a buffer allocated once; the host waits for it (bounded by the
  // watchdog's deadline), as a barrier must.
  Work barrier() override {
    const Work issued = launch("barrier", {}, /*hostWait=*/true, [&](ncclComm_t comm) {
      return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm, stream_);
    });
    issued.wait();  // throws when it failed
    return issued;
  }

 private:
  void check(const at::Tensor& t, const char* op) const {
    if (!t.defined()) throw Error(std::string(op) + ": undefined tensor");
    if (!t.is_cuda()) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() +
                  ", but the NCCL communicator takes CUDA tensors (use Gloo for CPU)");
    }
    if (t.device().index() != options_.device) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() + ", but " +
                  rankText(rank(), size()) + "'s NCCL communicator is on cuda:" +
                  std::to_string(options_.device));
    }
    if (!t.is_contiguous()) throw Error(std::string(op) + ": tensor must be contiguous");
  }


  // Orders the operation after the compute stream's work so far, issues it on the
  // communication stream and hands it to the watchdog. The Work's wait() orders the compute
  // stream after it (no host wait) and throws when the operation failed.
  // `hostWait`: wait() also blocks the host until the operation finished (barrier).
  template <typename Issue>
  Work launch(const char* op, std::vector<at::Tensor> tensors, Issue&& issue) {
    return launch(op, std::move(tensors), /*hostWait=*/false, std::forward<Issue>(issue));
  }
  template <typename Issue>
  Work launch(const char* op, std::vector<at::Tensor> tensors, bool hostWait, Issue&& issue) {
    const DeviceGuard onDevice(options_.device);
    auto operation = std::make_shared<Operation>();
    operation->name = op;
    operation->tensors = std::move(tensors);
    {
      std::scoped_lock lock(shared_->mutex);
      if (auto refusal = shared_->refusalLocked(op); !refusal.empty()) throw Error(refusal);
      const auto compute = computeStream(options_.device);
      Event before;
      checkCuda(cudaEventRecord(before.get(), compute), std::string(op) + ": cudaEventRecord");
      checkCuda(cudaStreamWaitEvent(stream_, before.get(), 0), std::string(op) + ": cudaStreamWaitEvent");
      operation->deadline = Clock::now() + options_.timeout;
      ncclResult_t result;
      {
        std::scoped_lock issuing(deviceMutex(options_.device));
        result = settle(shared_->comm, issue(shared_->comm), operation->deadline);
      }
      if (result != ncclSuccess) {
        shared_->failLocked(op, result == ncclInProgress ? std::string("enqueueing did not finish within its timeout")
                                                         : ncclCause(result));
        throw Error(shared_->error);
      }
      // The collective is queued: from here a failure must abort it, never drop its tensors.
      if (const auto err = cudaEventRecord(operation->done.get(), stream_); err != cudaSuccess) {
        shared_->inFlight.push_back(operation);
        shared_->failLocked(op, std::string("cudaEventRecord: ") + cudaGetErrorString(err));
        throw Error(shared_->error);
      }
      shared_->inFlight.push_back(operation);
      shared_->changed.notify_all();
    }
    return Work(
        [shared = shared_, operation, hostWait] {
          const DeviceGuard onDevice(shared->device);
          std::unique_lock lock(shared->mutex);
          if (hostWait) {
            shared->changed.wait(lock, [&] { return operation->finished || !operation->error.empty(); });
          }
          if (!operation->error.empty()) throw Error(operation->error);
          checkCuda(cudaStreamWaitEvent(computeStream(shared->device), operation->done.get(), 0),
                    operation->name + ": cudaStreamWaitEvent");
        },
        [shared = shared_, operation] {
          std::scoped_lock lock(shared->mutex);
          return operation->finished || !operation->error.empty();
        });
  }

  std::shared_ptr<Shared> shared_;
  cudaStream_t stream_;
  void* scratch_;
  NcclOptions options_;
  std::thread watchdog_;
};

void checkOptions(const NcclOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw ConfigError("NCCL communicator: rank " + std::to_string(options.rank) +
                      " is not in a world of size " + std::to_string(options.size));
  }
  if (options.storePrefix.empty()) throw ConfigError("NCCL communicator: empty store prefix");
}

}  // namespace

bool ncclAvailable() { return true; }

int cudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // a missing driver or device is an answer (0), not a sticky error
    return 0;
  }
  return count;
}

std::string exchangeNcclUniqueId(rendezvous::StoreClient& store, const NcclOptions& options) {
  checkOptions(options);
  ncclUniqueId id;
  const std::string key = options.storePrefix + "/unique_id";
  const std::string readers = options.storePrefix + "/unique_id_readers";
  if (options.rank == 0) {
    const auto result = ncclGetUniqueId(&id);
    if (result != ncclSuccess) throw Error("ncclGetUniqueId on rank 0: " + ncclCause(result));
    std::string value(reinterpret_cast<const char*>(&id), sizeof id);
    store.set(key, value);
    if (options.size > 1) {
      try {
        store.addAndWait(readers, 1, options.size, options.timeout);
      } catch (const TimeoutError& e) {
        throw TimeoutError("NCCL unique id under '" + key + "': not every rank of " +
                           std::to_string(options.size) + " read it within " +
                           std::to_string(options.timeout.count()) + " ms (" + e.what() + ")");
      }
    }
    store.remove(key);
    store.remove(readers);
    return value;
  }
  const std::string value = store.get(key, options.timeout);
  if (value.size() != sizeof id) {
    throw ProtocolError("NCCL unique id under '" + key + "' has " + std::to_string(value.size()) +
                        " bytes, expected " + std::to_string(sizeof id));
  }
  store.add(readers, 1);
  return value;
}

std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options) {
  checkOptions(options);
  const std::string who = rankText(options.rank, options.size) + " (cuda:" + std::to_string(options.device) + ")";
  const int devices = cudaDeviceCount();
  if (options.device < 0 || options.device >= devices) {
    throw ConfigError("NCCL communicator on " + who + ": " + std::to_string(devices) +
                      " CUDA device(s) visible to this process");
  }
  checkCuda(cudaSetDevice(options.device), "cudaSetDevice(" + std::to_string(options.device) + ")");
  const std::string idBytes = exchangeNcclUniqueId(store, options);
  ncclUniqueId id;
  std::memcpy(&id, idBytes.data(), sizeof id);

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const auto deadline = Clock::now() + options.timeout;
  auto result = ncclCommInitRankConfig(&comm, options.size, id, options.rank, &config);
  if (comm != nullptr) result = settle(comm, result, deadline);
  if (result != ncclSuccess) {
    if (comm != nullptr) ncclCommAbort(comm);
    if (result == ncclInProgress) {
      throw TimeoutError("ncclCommInitRank on " + who + " did not finish within " +
                         std::to_string(options.timeout.count()) +
                         " ms: a rank did not join or cannot reach this one (check NCCL_SOCKET_IFNAME, "
                         "NCCL_DEBUG=INFO)");
    }
    throw Error("ncclCommInitRank on " + who + ": " + ncclCause(result));
  }
  cudaStream_t stream = nullptr;
  void* scratch = nullptr;
  const auto streamErr = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const auto mallocErr = streamErr == cudaSuccess ? cudaMalloc(&scratch, sizeof(float)) : streamErr;
  if (mallocErr != cudaSuccess) {
    ncclCommAbort(comm);
    if (stream != nullptr) cudaStreamDestroy(stream);
    throw Error("NCCL communicator on " + who + ": " + cudaGetErrorString(mallocErr));
  }
  return std::make_unique<NcclCommunicator>(comm, stream, scratch, options);
}

}  // namespace fsdp::worker

#else  // no NCCL in this build

namespace fsdp::worker {

namespace {
[[noreturn]] void notBuilt() {
  throw ConfigError(
      "this libfsdp was built without NCCL (CMake found no CUDA runtime and NCCL; set CUDA_HOME / "
      "NCCL_HOME, sanitizer builds leave it out); CUDA tensors need it");
}
}  // namespace

bool ncclAvailable() { return false; }
int cudaDeviceCount() { return 0; }
std::string exchangeNcclUniqueId(rendezvous::StoreClient&, const NcclOptions&) { notBuilt(); }
std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient&, const NcclOptions&) {
  notBuilt();
}

}  // namespace fsdp::worker

#endif
