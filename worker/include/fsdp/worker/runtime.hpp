#pragma once
// The entry point of a training program: fsdp::init() reads the environment fsdprun set,
// connects to the job's store and builds the communicator for this round.
//
//   auto rt = fsdp::init();
//   rt->comm().allReduce(grads, fsdp::ReduceOp::kAverage).wait();

#include <chrono>
#include <memory>
#include <string>

#include "fsdp/common/env.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "fsdp/worker/communicator.hpp"

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

struct InitOptions {
  // Bound on connecting to the store and on the communicator's rendezvous and collectives.
  std::chrono::milliseconds timeout{300000};
};

// The worker's connection to its job. Owns the store client and the communicator.
class Runtime {
 public:
  Runtime(WorkerEnv env, std::unique_ptr<rendezvous::StoreClient> store,
          std::unique_ptr<Communicator> comm);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const WorkerEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int worldSize() const { return env_.worldSize; }
  int localRank() const { return env_.localRank; }
  Communicator& comm() { return *comm_; }
  rendezvous::StoreClient& store() { return *store_; }
  // Store keys of this round live under this prefix ("round/<n>/"): a restarted round
  // never reads a stale value.
  std::string roundPrefix() const { return roundPrefixFor(env_.round); }
  static std::string roundPrefixFor(int round) { return "round/" + std::to_string(round) + "/"; }

 private:
  WorkerEnv env_;
  std::unique_ptr<rendezvous::StoreClient> store_;
  std::unique_ptr<Communicator> comm_;
};

// Reads the environment, connects, builds the Gloo communicator. Throws ConfigError when not
// started by fsdprun, TimeoutError/NetworkError when the store or peers are unreachable.
std::unique_ptr<Runtime> init(const InitOptions& options = {});

}  // namespace fsdp::worker

namespace fsdp {
using worker::Communicator;
using worker::init;
using worker::InitOptions;
using worker::ReduceOp;
using worker::Runtime;
using worker::Work;
using worker::WorkerEnv;
}  // namespace fsdp
