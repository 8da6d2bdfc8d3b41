#include "fsdp/worker/nccl_communicator.hpp"

#include "fsdp/common/error.hpp"

#if FSDP_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <ATen/core/Tensor.h>

#include <cstring>
#include <mutex>
#include <thread>

// Debian's CPU LibTorch ships c10/cuda headers without the generated macros header; only a
// CUDA LibTorch has it, so that header tells the two apart.
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define FSDP_TORCH_CUDA 1
#else
#define FSDP_TORCH_CUDA 0
#endif

namespace fsdp::worker {
namespace {

void checkCuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw Error(what + ": " + cudaGetErrorString(err));
}

// The stream LibTorch computes on (the legacy default stream without a CUDA LibTorch).
cudaStream_t computeStream() {
#if FSDP_TORCH_CUDA
  return c10::cuda::getCurrentCUDAStream().stream();
#else
  return nullptr;
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

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, NcclOptions options)
      : comm_(comm), stream_(stream), options_(std::move(options)) {}
  ~NcclCommunicator() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CUDA; }
  const char* backendName() const override { return "NCCL"; }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    check(tensor, "allReduce");
    return launch("allReduce", {tensor}, [&] {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                           ncclType(tensor.scalar_type(), "allReduce"), ncclOp(op), comm_, stream_);
    });
  }

  Work allGather(at::Tensor input, at::Tensor output) override {
    check(input, "allGather");
    check(output, "allGather");
    if (output.numel() != input.numel() * size()) {
      throw Error("allGather: the NCCL communicator needs equal chunks (output " +
                  std::to_string(output.numel()) + " = " + std::to_string(size()) + " x input " +
                  std::to_string(input.numel()) + "); FSDP pads its flat parameters so");
    }
    return launch("allGather", {input, output}, [&] {
      return ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                           ncclType(input.scalar_type(), "allGather"), comm_, stream_);
    });
  }

  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    check(input, "reduceScatter");
    check(output, "reduceScatter");
    if (input.numel() != output.numel() * size()) {
      throw Error("reduceScatter: the NCCL communicator needs equal chunks (input " +
                  std::to_string(input.numel()) + " = " + std::to_string(size()) + " x output " +
                  std::to_string(output.numel()) + ")");
    }
    return launch("reduceScatter", {input, output}, [&] {
      return ncclReduceScatter(input.data_ptr(), output.data_ptr(),
                               static_cast<size_t>(output.numel()),
                               ncclType(input.scalar_type(), "reduceScatter"), ncclOp(op), comm_,
                               stream_);
    });
  }

  Work broadcast(at::Tensor tensor, int root) override {
    check(tensor, "broadcast");
    return launch("broadcast", {tensor}, [&] {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                           ncclType(tensor.scalar_type(), "broadcast"), root, comm_, stream_);
    });
  }

  Work barrier() override {
    void* scratch = nullptr;
    checkCuda(cudaMalloc(&scratch, sizeof(float)), "barrier: cudaMalloc");
    const auto result = ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, comm_, stream_);
    const auto sync = cudaStreamSynchronize(stream_);
    cudaFree(scratch);
    fail("barrier", result);
    checkCuda(sync, "barrier on rank " + std::to_string(rank()));
    std::promise<void> done;
    done.set_value();
    return Work(done.get_future().share());
  }

 private:
  void check(const at::Tensor& t, const char* op) const {
    if (!t.defined()) throw Error(std::string(op) + ": undefined tensor");
    if (!t.is_cuda()) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() +
                  ", but the NCCL communicator takes CUDA tensors (use Gloo for CPU)");
    }
    if (!t.is_contiguous()) throw Error(std::string(op) + ": tensor must be contiguous");
  }

  // Orders the operation after the compute stream's work so far, issues it on the
  // communication stream and returns a handle whose wait() orders the compute stream after it.
  template <typename Issue>
  Work launch(const char* op, std::vector<at::Tensor> keepAlive, Issue&& issue) {
    std::scoped_lock lock(mutex_);
    Event before;
    checkCuda(cudaEventRecord(before.get(), computeStream()), std::string(op) + ": cudaEventRecord");
    checkCuda(cudaStreamWaitEvent(stream_, before.get(), 0), std::string(op) + ": cudaStreamWaitEvent");
    fail(op, issue());
    auto done = std::make_shared<Event>();
    checkCuda(cudaEventRecord(done->get(), stream_), std::string(op) + ": cudaEventRecord");
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    const std::string name = op;
    return Work(
        [this, done, name, deadline, keepAlive = std::move(keepAlive)] {
          // The host waits (bounded) so that an asynchronous NCCL error or a dead peer is
          // reported here instead of hanging a kernel forever.
          while (cudaEventQuery(done->get()) == cudaErrorNotReady) {
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(comm_, &async);
            fail(name.c_str(), async);
            if (std::chrono::steady_clock::now() > deadline) {
              ncclCommAbort(comm_);
              comm_ = nullptr;
              throw TimeoutError("nccl " + name + " on rank " + std::to_string(rank()) + " of " +
                                 std::to_string(size()) + " did not finish within " +
                                 std::to_string(options_.timeout.count()) +
                                 " ms; the communicator was aborted");
            }
            std::this_thread::yield();
          }
          checkCuda(cudaStreamWaitEvent(computeStream(), done->get(), 0),
                    name + ": cudaStreamWaitEvent");
        },
        [done] { return cudaEventQuery(done->get()) != cudaErrorNotReady; });
  }

  void fail(const char* op, ncclResult_t result) {
    if (result == ncclSuccess || result == ncclInProgress) return;
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    throw Error("nccl " + std::string(op) + " failed on rank " + std::to_string(rank()) + " of " +
                std::to_string(size()) + ": " + ncclGetErrorString(result) +
                "; the communicator was aborted");
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  NcclOptions options_;
  std::mutex mutex_;
};

}  // namespace

bool ncclAvailable() { return true; }

std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient& store,
                                                     const NcclOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw ConfigError("NCCL communicator: rank " + std::to_string(options.rank) +
                      " is not in a world of size " + std::to_string(options.size));
  }
  checkCuda(cudaSetDevice(options.device), "cudaSetDevice(" + std::to_string(options.device) + ")");
  ncclUniqueId id;
  const std::string key = options.storePrefix + "/unique_id";
  if (options.rank == 0) {
    const auto result = ncclGetUniqueId(&id);
    if (result != ncclSuccess) throw Error(std::string("ncclGetUniqueId: ") + ncclGetErrorString(result));
    store.set(key, std::string(reinterpret_cast<const char*>(&id), sizeof id));
  } else {
    const std::string value = store.get(key, options.timeout);
    if (value.size() != sizeof id) {
      throw ProtocolError("NCCL unique id under '" + key + "' has " + std::to_string(value.size()) +
                          " bytes, expected " + std::to_string(sizeof id));
    }
    std::memcpy(&id, value.data(), sizeof id);
  }
  ncclComm_t comm = nullptr;
  const auto result = ncclCommInitRank(&comm, options.size, id, options.rank);
  if (result != ncclSuccess) {
    throw Error("ncclCommInitRank: rank " + std::to_string(options.rank) + " of " +
                std::to_string(options.size) + ": " + ncclGetErrorString(result));
  }
  cudaStream_t stream = nullptr;
  const auto err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    ncclCommDestroy(comm);
    throw Error(std::string("cudaStreamCreate: ") + cudaGetErrorString(err));
  }
  return std::make_unique<NcclCommunicator>(comm, stream, options);
}

}  // namespace fsdp::worker

#else  // no NCCL in this build

namespace fsdp::worker {

bool ncclAvailable() { return false; }

std::unique_ptr<Communicator> createNcclCommunicator(rendezvous::StoreClient&, const NcclOptions&) {
  throw ConfigError(
      "this libfsdp was built without NCCL (CMake found no CUDA toolkit and NCCL); CUDA tensors "
      "need it");
}

}  // namespace fsdp::worker

#endif
