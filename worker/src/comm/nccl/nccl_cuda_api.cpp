// NcclApi over the CUDA runtime and NCCL: the one file of the communicator that includes them
// (and, with a CUDA LibTorch, PyTorch's per-thread current stream). Without NCCL in the build,
// cudaNcclApi() refuses with the reason.
#include "fsdp/common/error.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "nccl_api.hpp"

#if FSDP_HAVE_NCCL

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>

#include "fsdp/common/env.hpp"
#include "nccl_queue.hpp"

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
namespace detail {
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes);

ApiResult cuda(cudaError_t err) {
  if (err == cudaSuccess) return ApiResult::done();
  if (err == cudaErrorNotReady) return ApiResult::pending();
  return ApiResult::failed(std::string("CUDA: ") + cudaGetErrorString(err));
}

std::string ncclCause(ncclResult_t result, ncclComm_t comm) {
  std::string cause = ncclGetErrorString(result);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') {
    cause += " (" + std::string(last) + ")";
  }
  return cause;
}

ApiResult nccl(ncclResult_t result, ncclComm_t comm) {
  if (result == ncclSuccess) return ApiResult::done();
  if (result == ncclInProgress) return ApiResult::pending();
  return ApiResult::failed(ncclCause(result, comm));
}

ncclComm_t asComm(NcclComm comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t asStream(CudaStream stream) { return static_cast<cudaStream_t>(stream); }
cudaEvent_t asEvent(CudaEvent event) { return static_cast<cudaEvent_t>(event); }

ncclDataType_t ncclType(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    default:
      return ncclNumTypes;  // refused before: ncclSupports()
  }
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAverage:
      return ncclAvg;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

#ifndef NCCL_SHRINK_ABORT
#define NCCL_SHRINK_ABORT 0x01  // nccl.h before 2.27 lacks it; the call is looked up at run time
#endif

// ncclCommRevoke and ncclCommShrink (NCCL 2.28+), looked up in the NCCL library this process
// loaded rather than linked: a library older than the headers this was built with must still
// load, and then answers canShrink() false. FSDP_NCCL_SHRINK=0 turns them off.
struct ShrinkCalls {
  ncclResult_t (*revoke)(ncclComm_t, int) = nullptr;
  ncclResult_t (*shrink)(ncclComm_t, int*, int, ncclComm_t*, ncclConfig_t*, int) = nullptr;
};

const ShrinkCalls& shrinkCalls() {
  static const ShrinkCalls calls = [] {
    ShrinkCalls found;
    if (!envFlag(processEnv(), "FSDP_NCCL_SHRINK", true)) return found;
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) == 0 || info.dli_fname == nullptr) return found;
    void* library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (library == nullptr) return found;
    found.revoke = reinterpret_cast<decltype(found.revoke)>(dlsym(library, "ncclCommRevoke"));
    found.shrink = reinterpret_cast<decltype(found.shrink)>(dlsym(library, "ncclCommShrink"));
    if (found.revoke == nullptr || found.shrink == nullptr) found = {};
    return found;
  }();
  return calls;
}

class CudaNcclApi final : public NcclApi {
 public:
  int deviceCount() override { return worker::cudaDeviceCount(); }
  int currentDevice() override {
    int device = -1;
    return cudaGetDevice(&device) == cudaSuccess ? device : -1;
  }
  ApiResult setDevice(int device) override { return cuda(cudaSetDevice(device)); }
  CudaStream currentStream([[maybe_unused]] int device) override {
#if FSDP_TORCH_CUDA
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
    return cudaStreamLegacy;
#endif
  }
  Made<CudaStream> createStream() override {
    cudaStream_t stream = nullptr;
    return {cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)), stream};
  }
  void destroyStream(CudaStream stream) override { cudaStreamDestroy(asStream(stream)); }
  Made<void*> allocate(std::size_t bytes) override {
    void* memory = nullptr;
    return {cuda(cudaMalloc(&memory, bytes)), memory};
  }
  void release(void* memory) override { cudaFree(memory); }
  Made<CudaEvent> createEvent() override {
    cudaEvent_t event = nullptr;
    return {cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)), event};
  }
  void destroyEvent(CudaEvent event) override { cudaEventDestroy(asEvent(event)); }
  ApiResult recordEvent(CudaEvent event, CudaStream stream) override {
    return cuda(cudaEventRecord(asEvent(event), asStream(stream)));
  }
  ApiResult queryEvent(CudaEvent event) override { return cuda(cudaEventQuery(asEvent(event))); }
  ApiResult streamWaitEvent(CudaStream stream, CudaEvent event) override {
    return cuda(cudaStreamWaitEvent(asStream(stream), asEvent(event), 0));
  }
  ApiResult synchronizeStream(CudaStream stream) override {
    return cuda(cudaStreamSynchronize(asStream(stream)));
  }

  Made<std::string> uniqueId() override {
    ncclUniqueId id;
    const auto result = ncclGetUniqueId(&id);
    if (result != ncclSuccess) return {nccl(result, nullptr), {}};
    return {ApiResult::done(), std::string(reinterpret_cast<const char*>(&id), sizeof id)};
  }
  Made<NcclComm> commInitRank(int size, const std::string& uniqueId, int rank) override {
    ncclUniqueId id;
    std::memcpy(&id, uniqueId.data(), sizeof id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const auto result = ncclCommInitRankConfig(&comm, size, id, rank, &config);
    return {nccl(result, comm), comm};
  }
  ApiResult commAsyncError(NcclComm comm) override {
    ncclResult_t async = ncclSuccess;
    if (const auto r = ncclCommGetAsyncError(asComm(comm), &async); r != ncclSuccess) {
      return ApiResult::failed("ncclCommGetAsyncError: " + ncclCause(r, asComm(comm)));
    }
    return nccl(async, asComm(comm));
  }
  ApiResult commFinalize(NcclComm comm) override {
    return nccl(ncclCommFinalize(asComm(comm)), asComm(comm));
  }
  void commDestroy(NcclComm comm) override { ncclCommDestroy(asComm(comm)); }
  void commAbort(NcclComm comm) override { ncclCommAbort(asComm(comm)); }
  bool canShrink() override { return shrinkCalls().shrink != nullptr; }
  ApiResult commRevoke(NcclComm comm) override {
    if (!canShrink()) return ApiResult::failed("ncclCommRevoke: not in this NCCL library");
    return nccl(shrinkCalls().revoke(asComm(comm), 0), asComm(comm));
  }
  Made<NcclComm> commShrink(NcclComm parent, const std::vector<int>& exclude, const Deadline& deadline) override {
    if (!canShrink()) return {ApiResult::failed("ncclCommShrink: not in this NCCL library"), nullptr};
    // NCCL reads a null list as a split; the bootstrap shrinks only where a rank was lost.
    if (exclude.empty()) return {ApiResult::failed("ncclCommShrink: no rank to exclude"), nullptr};
    std::vector<int> list = exclude;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // NCCL's job writes the new communicator through this pointer when it ends, after the call
    // returned (a split's or shrink's child is null until then, unlike an init's): it must outlive
    // the job. Where the job outlives the wait it is left to it (one pointer, never freed).
    auto* slot = new ncclComm_t(nullptr);
    const auto called = nccl(shrinkCalls().shrink(asComm(parent), list.data(), static_cast<int>(list.size()),
                                                  slot, &config, NCCL_SHRINK_ABORT),
                             asComm(parent));
    const auto child = [slot] { return static_cast<NcclComm>(__atomic_load_n(slot, __ATOMIC_ACQUIRE)); };
    auto made = awaitChild(*this, "ncclCommShrink", parent, called, child, deadline);
    if (!made.result.isPending()) delete slot;
    return made;
  }

  ApiResult allReduce(const void* send, void* recv, std::size_t count, at::ScalarType type,
                      ReduceOp op, NcclComm comm, CudaStream stream) override {
    return nccl(ncclAllReduce(send, recv, count, ncclType(type), ncclOp(op), asComm(comm),
                              asStream(stream)),
                asComm(comm));
  }
  ApiResult allGather(const void* send, void* recv, std::size_t countPerRank, at::ScalarType type,
                      NcclComm comm, CudaStream stream) override {
    return nccl(
        ncclAllGather(send, recv, countPerRank, ncclType(type), asComm(comm), asStream(stream)),
        asComm(comm));
  }
  ApiResult reduceScatter(const void* send, void* recv, std::size_t countPerRank,
                          at::ScalarType type, ReduceOp op, NcclComm comm,
                          CudaStream stream) override {
    return nccl(ncclReduceScatter(send, recv, countPerRank, ncclType(type), ncclOp(op),
                                  asComm(comm), asStream(stream)),
                asComm(comm));
  }
  ApiResult broadcast(const void* send, void* recv, std::size_t count, at::ScalarType type,
                      int root, NcclComm comm, CudaStream stream) override {
    return nccl(
        ncclBroadcast(send, recv, count, ncclType(type), root, asComm(comm), asStream(stream)),
        asComm(comm));
  }
};

}  // namespace

std::shared_ptr<NcclApi> cudaNcclApi() { return std::make_shared<CudaNcclApi>(); }

int ncclLibraryVersion() {
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess ? version : 0;
}

}  // namespace detail

bool ncclAvailable() { return true; }

int cudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // a missing driver or device is an answer (0), not a sticky error
    return 0;
  }
  return count;
}

}  // namespace fsdp::worker

#else  // no NCCL in this build

namespace fsdp::worker {

std::shared_ptr<detail::NcclApi> detail::cudaNcclApi() {
  throw ConfigError(
      "this libfsdp was built without NCCL (CMake found no CUDA runtime and NCCL; set CUDA_HOME / "
      "NCCL_HOME, sanitizer builds leave it out); CUDA tensors need it");
}

int detail::ncclLibraryVersion() { return 0; }

bool ncclAvailable() { return false; }
int cudaDeviceCount() { return 0; }

}  // namespace fsdp::worker

#endif
