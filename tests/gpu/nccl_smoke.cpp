// nccl_smoke: the NCCL environment of a GPU machine proven on its own, before the project is
// built (scripts/gpu-check compiles it with only cuda_runtime.h and nccl.h). One rank on device
// 0: non-blocking init under a deadline, an all-reduce on a communication stream ordered after
// the compute stream by events (and the compute stream after it), the result checked, then an
// abort. Prints one line per step; exit 0 when all held, 1 on a failure, 3 without a device.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

[[noreturn]] void die(const char* what, const char* why) {
  std::printf("nccl_smoke: FAILED %s: %s\n", what, why);
  std::exit(1);
}

void cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) die(what, cudaGetErrorString(err));
}

// Waits for a non-blocking communicator's pending call, up to `deadline`.
void settle(ncclComm_t comm, ncclResult_t first, const char* what, Clock::time_point deadline) {
  ncclResult_t state = first;
  while (state == ncclInProgress) {
    if (Clock::now() > deadline) die(what, "still in progress at the deadline");
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) die(what, "ncclCommGetAsyncError failed");
  }
  if (state != ncclSuccess) die(what, ncclGetErrorString(state));
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    std::printf("nccl_smoke: no CUDA device visible; nothing run\n");
    return 3;
  }
  cudaDeviceProp prop{};
  cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int version = 0;
  ncclGetVersion(&version);
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf("nccl_smoke: %d device(s); device 0 '%s' (sm_%d%d); NCCL %d; CUDA runtime %d, driver %d\n", devices,
              prop.name, prop.major, prop.minor, version, runtime, driver);
  cuda(cudaSetDevice(0), "cudaSetDevice");

  const auto deadline = Clock::now() + std::chrono::seconds(60);
  auto t = Clock::now();
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) die("ncclGetUniqueId", "failed");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  settle(comm, ncclCommInitRankConfig(&comm, 1, id, 0, &config), "ncclCommInitRankConfig (non-blocking)", deadline);
  std::printf("nccl_smoke: non-blocking init of 1 rank done in %.1f ms\n", msSince(t));

  cudaStream_t compute = nullptr, comms = nullptr;
  cuda(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "cudaStreamCreate compute");
  cuda(cudaStreamCreateWithFlags(&comms, cudaStreamNonBlocking), "cudaStreamCreate comms");
  cudaEvent_t inputsReady = nullptr, reduced = nullptr;
  cuda(cudaEventCreateWithFlags(&inputsReady, cudaEventDisableTiming), "cudaEventCreate");
  cuda(cudaEventCreateWithFlags(&reduced, cudaEventDisableTiming), "cudaEventCreate");

  const size_t n = (1u << 20) + 3;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000) * 0.5f;
  float* buf = nullptr;
  cuda(cudaMalloc(&buf, n * sizeof(float)), "cudaMalloc");
  t = Clock::now();
  cuda(cudaMemcpyAsync(buf, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, compute), "copy in");
  cuda(cudaEventRecord(inputsReady, compute), "record inputsReady");
  cuda(cudaStreamWaitEvent(comms, inputsReady, 0), "comms waits for compute");
  settle(comm, ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, comm, comms), "ncclAllReduce", deadline);
  cuda(cudaEventRecord(reduced, comms), "record reduced");
  cuda(cudaStreamWaitEvent(compute, reduced, 0), "compute waits for comms");
  std::vector<float> back(n);
  cuda(cudaMemcpyAsync(back.data(), buf, n * sizeof(float), cudaMemcpyDeviceToHost, compute), "copy out");
  cuda(cudaStreamSynchronize(compute), "synchronize compute");
  for (size_t i = 0; i < n; ++i) {
    if (back[i] != host[i]) die("all-reduce result", "element differs from the input (world size 1: a sum of one)");
  }
  std::printf("nccl_smoke: all-reduce of %zu floats ordered by events, checked, in %.1f ms\n", n, msSince(t));

  t = Clock::now();
  if (ncclCommAbort(comm) != ncclSuccess) die("ncclCommAbort", "failed");
  std::printf("nccl_smoke: abort done in %.1f ms\n", msSince(t));
  cudaFree(buf);
  cudaEventDestroy(inputsReady);
  cudaEventDestroy(reduced);
  cudaStreamDestroy(compute);
  cudaStreamDestroy(comms);
  std::printf("nccl_smoke: OK\n");
  return 0;
}
