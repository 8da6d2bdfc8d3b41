#include "fsdp/worker/runtime.hpp"

#include <fstream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/gloo_communicator.hpp"

namespace fsdp::worker {

WorkerEnv WorkerEnv::fromEnvironment(const EnvLookup& env) {
  WorkerEnv w;
  const auto intVar = [&env](const char* name) { return static_cast<int>(requireEnvInt(env, name)); };
  w.rank = intVar("RANK");
  w.localRank = intVar("LOCAL_RANK");
  w.worldSize = intVar("WORLD_SIZE");
  w.localWorldSize = intVar("LOCAL_WORLD_SIZE");
  w.groupRank = static_cast<int>(envInt(env, "GROUP_RANK", 0));
  w.groupWorldSize = static_cast<int>(envInt(env, "GROUP_WORLD_SIZE", 1));
  w.restartCount = static_cast<int>(envInt(env, "TORCHELASTIC_RESTART_COUNT", 0));
  w.maxRestarts = static_cast<int>(envInt(env, "TORCHELASTIC_MAX_RESTARTS", 0));
  w.round = static_cast<int>(envInt(env, "FSDPRUN_ROUND", w.restartCount));
  w.runId = env("TORCHELASTIC_RUN_ID").value_or("none");
  w.roleName = env("ROLE_NAME").value_or("default");
  w.masterAddr = env("MASTER_ADDR").value_or("127.0.0.1");
  w.masterPort = static_cast<int>(envInt(env, "MASTER_PORT", 0));
  w.storeHost = requireEnv(env, "FSDPRUN_STORE_ADDR");
  w.storePort = intVar("FSDPRUN_STORE_PORT");
  w.localAddress = env("FSDPRUN_LOCAL_ADDR").value_or(w.storeHost);
  w.tokenFile = env("FSDPRUN_TOKEN_FILE").value_or("");
  if (w.worldSize < 1) throw ConfigError("WORLD_SIZE=" + std::to_string(w.worldSize) + ": expected >= 1");
  if (w.rank < 0 || w.rank >= w.worldSize) {
    throw ConfigError("RANK=" + std::to_string(w.rank) + " is outside WORLD_SIZE=" +
                      std::to_string(w.worldSize));
  }
  if (w.localRank < 0 || w.localRank >= w.localWorldSize) {
    throw ConfigError("LOCAL_RANK=" + std::to_string(w.localRank) + " is outside LOCAL_WORLD_SIZE=" +
                      std::to_string(w.localWorldSize));
  }
  if (w.storePort < 1 || w.storePort > 65535) {
    throw ConfigError("FSDPRUN_STORE_PORT=" + std::to_string(w.storePort) + ": expected 1-65535");
  }
  return w;
}

Runtime::Runtime(WorkerEnv env, std::unique_ptr<rendezvous::StoreClient> store,
                 std::unique_ptr<Communicator> comm)
    : env_(std::move(env)), store_(std::move(store)), comm_(std::move(comm)) {}

// The communicator (and its thread) goes before the store client it was built over.
Runtime::~Runtime() { comm_.reset(); }

std::unique_ptr<Runtime> init(const InitOptions& options) {
  WorkerEnv env = WorkerEnv::fromEnvironment(processEnv());
  log::setup({.role = "worker", .rank = env.rank, .defaultLevel = spdlog::level::warn});
  std::string token;
  if (!env.tokenFile.empty()) {
    std::ifstream in(env.tokenFile);
    if (!in || !std::getline(in, token) || token.empty()) {
      throw ConfigError("FSDPRUN_TOKEN_FILE '" + env.tokenFile + "': cannot read the job token");
    }
  }
  auto store = rendezvous::StoreClient::connect(
      env.storeHost, static_cast<std::uint16_t>(env.storePort),
      {.connectTimeout = options.timeout, .timeout = options.timeout, .runId = env.runId,
       .token = token});
  auto comm = createGlooCommunicator(
      *store, {.rank = env.rank,
               .size = env.worldSize,
               .localAddress = env.localAddress,
               .storePrefix = Runtime::roundPrefixFor(env.round) + "gloo/world",
               .timeout = options.timeout});
  log::debug("connected: store {}, world {}", store->endpoint(), env.worldSize);
  return std::make_unique<Runtime>(std::move(env), std::move(store), std::move(comm));
}

}  // namespace fsdp::worker
