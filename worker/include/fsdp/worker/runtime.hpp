#pragma once
// The entry point of a training program: fsdp::init() reads the environment fsdprun set,
// connects to the job's store and builds the communicators for this round.
//
//   auto rt = fsdp::init();
//   model->to(rt->device());
//   rt->comm().allReduce(grads, fsdp::ReduceOp::kAverage).wait();
//
// The backend: NCCL when this build has NCCL, LibTorch has CUDA and a device is visible;
// otherwise, on CPU, shared memory between the ranks of a node (shm_communicator.hpp) where a
// node has more than one rank, Gloo where not. FSDPRUN_BACKEND=gloo|shm|nccl|auto (the
// operator's word) overrides InitOptions::backend (the program's); gloo forces plain Gloo. With
// NCCL the current CUDA device is LOCAL_RANK modulo the visible devices, and cpuComm() is a Gloo
// group over the same ranks for CPU tensors (flags, metrics, checkpoint metadata), as PyTorch
// programs keep a "gloo" group beside "nccl".

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "fsdp/common/env.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/communicator.hpp"
#include "fsdp/worker/flight_recorder.hpp"

namespace fsdp::worker {

// What fsdprun tells a worker, read from its environment.
struct WorkerEnv {
  int rank = 0;
  int localRank = 0;
  int worldSize = 1;
  int localWorldSize = 1;
  int groupRank = 0;
  int groupWorldSize = 1;
  int restartCount = 0;
  int maxRestarts = 0;
  int round = 0;
  std::string runId;
  std::string roleName;
  std::string masterAddr;
  int masterPort = 0;
  std::string storeHost;
  int storePort = 0;
  std::string localAddress;
  std::string tokenFile;  // FSDPRUN_TOKEN_FILE: the job token, when the store requires one

  // Throws ConfigError naming the variable that is missing or malformed, or inconsistent
  // (RANK outside WORLD_SIZE, ...).
  static WorkerEnv fromEnvironment(const EnvLookup& env);
};

enum class Backend { kAuto, kGloo, kShm, kNccl };

// "auto", "gloo", "shm" or "nccl" (any case). Throws ConfigError naming `source` (e.g.
// "FSDPRUN_BACKEND") and the value otherwise.
Backend parseBackend(const std::string& text, const std::string& source);
const char* backendName(Backend backend);  // "auto", "gloo", "shm", "nccl"

// What this process can run.
struct BackendProbe {
  bool ncclBuilt = false;   // libfsdp was built with NCCL
  bool torchCuda = false;   // LibTorch was built with CUDA
  int devices = 0;          // CUDA devices visible (only counted when both above hold)
  std::string visibleDevices = "(unset)";  // CUDA_VISIBLE_DEVICES, for messages
  std::string noGloo;       // why libfsdp was built without Gloo ("" when it has Gloo)
};
BackendProbe probeBackends();

struct BackendChoice {
  Backend backend = Backend::kGloo;
  int device = -1;  // NCCL: the CUDA device of this rank
  std::string reason;  // one line: why this backend
};
// The decision of fsdp::init(): `envValue` (FSDPRUN_BACKEND, when set and not empty) overrides
// `requested`. kShm means shared memory inside each node (the world's communicator when the
// world is one node; HYBRID_SHARD's shard groups always). Throws ConfigError, naming where the request came from, when NCCL is asked for
// and this build, this LibTorch or this machine cannot give it, and when NCCL is chosen but
// the node has more ranks than devices (NCCL takes one device per rank).
BackendChoice chooseBackend(const std::optional<std::string>& envValue, Backend requested,
                            const BackendProbe& probe, int localRank, int localWorldSize);

struct InitOptions {
  // Bound on connecting to the store and on the communicators' rendezvous and collectives.
  std::chrono::milliseconds timeout{300000};
  // Which communicator comm() is; FSDPRUN_BACKEND overrides it.
  Backend backend = Backend::kAuto;
};

class Runtime;
namespace detail {
class StragglerMonitor;
struct RuntimeReform;  // reform/reform.cpp: the in-process re-formation (reform.hpp)
// fsdp::init(): starts the straggler reports of this runtime (stats/straggler.hpp).
void startStragglerMonitor(Runtime& runtime, const std::string& token);
}  // namespace detail

// The worker's connection to its job. Owns the store client and the communicator.
class Runtime {
 public:
  // `cpuComm`: a Gloo group for CPU tensors when `comm` does not take them (nullptr: comm serves
  // both). `backend`: what fsdp::init() chose (makeHybridGroups follows it).
  Runtime(WorkerEnv env, std::unique_ptr<rendezvous::StoreClient> store,
          std::unique_ptr<Communicator> comm, std::unique_ptr<Communicator> cpuComm = nullptr,
          Backend backend = Backend::kGloo);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const WorkerEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int worldSize() const { return env_.worldSize; }
  int localRank() const { return env_.localRank; }
  // The job's communicator (NCCL or Gloo) and where its tensors live.
  Communicator& comm() { return *comm_; }
  c10::Device device() const { return comm_->device(); }
  // A communicator for CPU tensors over the same ranks (comm() itself when it takes them).
  Communicator& cpuComm() { return cpuComm_ ? *cpuComm_ : *comm_; }
  Backend backend() const { return backend_; }
  rendezvous::StoreClient& store() { return *store_; }
  // Store keys of this round live under this prefix ("round/<n>/"): a restarted round
  // never reads a stale value.
  std::string roundPrefix() const { return roundPrefixFor(env_.round); }
  static std::string roundPrefixFor(int round) { return "round/" + std::to_string(round) + "/"; }

 private:
  WorkerEnv env_;
  std::unique_ptr<rendezvous::StoreClient> store_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Communicator> cpuComm_;
  Backend backend_ = Backend::kGloo;
  std::shared_ptr<detail::StragglerMonitor> stragglers_;
  InitOptions initOptions_;  // what fsdp::init() was given: a re-formation builds alike
  std::string token_;
  int abortHook_ = 0;  // the control channel's hook that aborts comm_ and cpuComm_ (0: none)
  friend void detail::startStragglerMonitor(Runtime& runtime, const std::string& token);
  friend struct detail::RuntimeReform;
  friend std::unique_ptr<Runtime> init(const InitOptions& options);
};

// Reads the environment, connects, picks the backend (chooseBackend) and builds the
// communicators. Throws ConfigError when not started by fsdprun or when the backend asked for
// cannot be had, TimeoutError/NetworkError when the store or peers are unreachable.
std::unique_ptr<Runtime> init(const InitOptions& options = {});

}  // namespace fsdp::worker

namespace fsdp {
using worker::Backend;
using worker::Communicator;
using worker::init;
using worker::InitOptions;
using worker::ReduceOp;
using worker::Runtime;
using worker::Work;
using worker::WorkerEnv;
}  // namespace fsdp
