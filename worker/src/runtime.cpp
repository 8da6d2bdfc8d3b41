#include "fsdp/worker/runtime.hpp"

#include "comm/nccl/staged_communicator.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/full_buffer.hpp"
#include "reform/control.hpp"
#include "reform/reformable_communicator.hpp"
#include "runtime_internal.hpp"
#include "stats/straggler.hpp"

#include <ATen/Context.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fsdp/common/error.hpp"
#include "fsdp/common/lifeline.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/hierarchical_communicator.hpp"
#include "fsdp/worker/nccl_communicator.hpp"
#include "fsdp/worker/shm_communicator.hpp"

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

Backend parseBackend(const std::string& text, const std::string& source) {
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "auto") return Backend::kAuto;
  if (lower == "gloo") return Backend::kGloo;
  if (lower == "nccl") return Backend::kNccl;
  if (lower == "shm") return Backend::kShm;
  throw ConfigError(source + "='" + text + "': expected gloo, shm, nccl or auto");
}

const char* backendName(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kGloo: return "gloo";
    case Backend::kShm: return "shm";
    case Backend::kNccl: return "nccl";
  }
  return "?";
}

BackendProbe probeBackends() {
  BackendProbe probe;
  probe.ncclBuilt = ncclAvailable();
  probe.torchCuda = at::hasCUDA();
  if (!glooAvailable()) probe.noGloo = glooUnavailableReason();
  // Counting devices starts the CUDA runtime: only where NCCL could be chosen at all.
  if (probe.ncclBuilt && probe.torchCuda) probe.devices = cudaDeviceCount();
  if (const auto visible = processEnv()("CUDA_VISIBLE_DEVICES")) probe.visibleDevices = "'" + *visible + "'";
  return probe;
}

BackendChoice chooseBackend(const std::optional<std::string>& envValue, Backend requested,
                            const BackendProbe& probe, int localRank, int localWorldSize) {
  const bool fromEnv = envValue.has_value() && !envValue->empty();
  const Backend wanted = fromEnv ? parseBackend(*envValue, "FSDPRUN_BACKEND") : requested;
  const std::string source = fromEnv ? "FSDPRUN_BACKEND=" + *envValue
                                     : std::string("InitOptions::backend = ") + backendName(requested);
  const bool ncclPossible = probe.ncclBuilt && probe.torchCuda && probe.devices > 0;
  if (wanted == Backend::kGloo) {
    if (!probe.noGloo.empty()) {
      throw ConfigError(source + ": this libfsdp has no Gloo: " + probe.noGloo + "; expected shm, nccl or auto");
    }
    return {Backend::kGloo, -1, source};
  }
  if (wanted == Backend::kShm) return {Backend::kShm, -1, source};
  if (wanted == Backend::kAuto && !ncclPossible) {
    const std::string why = !probe.ncclBuilt   ? "this libfsdp has no NCCL"
                            : !probe.torchCuda ? "LibTorch has no CUDA"
                                               : "no CUDA device visible";
    // Shared memory pays where a node has ranks to share it.
    if (localWorldSize > 1) return {Backend::kShm, -1, "auto: " + why + "; CPU ranks share this node's memory"};
    if (!probe.noGloo.empty()) return {Backend::kShm, -1, "auto: " + why + "; one rank on this node, and no Gloo"};
    return {Backend::kGloo, -1, "auto: " + why + "; one rank on this node"};
  }
  if (wanted == Backend::kNccl) {
    if (!probe.ncclBuilt) {
      throw ConfigError(source + ": this libfsdp was built without NCCL (CMake found no CUDA runtime and "
                                 "NCCL, or this is a sanitizer build); set FSDPRUN_BACKEND=gloo or rebuild");
    }
    if (!probe.torchCuda) {
      throw ConfigError(source + ": this LibTorch has no CUDA; build against a CUDA LibTorch "
                                 "(CMAKE_PREFIX_PATH) or set FSDPRUN_BACKEND=gloo");
    }
    if (probe.devices < 1) {
      throw ConfigError(source + ": no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES=" +
                        probe.visibleDevices + "); set FSDPRUN_BACKEND=gloo to train on CPU");
    }
  }
  if (localWorldSize > probe.devices) {
    throw ConfigError((wanted == Backend::kAuto ? std::string("auto") : source) + ": " +
                      std::to_string(localWorldSize) + " ranks on this node (LOCAL_WORLD_SIZE) but " +
                      std::to_string(probe.devices) +
                      " CUDA device(s) visible; NCCL needs one device per rank: start one worker per GPU "
                      "(fsdprun --nproc_per_node gpu) or set FSDPRUN_BACKEND=gloo");
  }
  const int device = localRank % probe.devices;
  return {Backend::kNccl, device,
          (wanted == Backend::kAuto ? std::string("auto") : source) + ": LOCAL_RANK " +
              std::to_string(localRank) + " on cuda:" + std::to_string(device) + " of " +
              std::to_string(probe.devices)};
}

Runtime::Runtime(WorkerEnv env, std::unique_ptr<rendezvous::StoreClient> store,
                 std::unique_ptr<Communicator> comm, std::unique_ptr<Communicator> cpuComm, Backend backend)
    : env_(std::move(env)),
      store_(std::move(store)),
      comm_(detail::reformable(detail::recordCollectives(std::move(comm), "world"))),
      cpuComm_(detail::reformable(detail::recordCollectives(std::move(cpuComm), "world.cpu"))),
      backend_(backend) {
  detail::FlightRecorder::process().attach(env_.rank);
}

// The communicators (and their threads) go before the store client they were built over.
Runtime::~Runtime() {
  // The step observer is the process's: a newer runtime's stays.
  if (stragglers_ && detail::StragglerMonitor::active() == stragglers_) {
    detail::FlightRecorder::process().setStepObserver({});
    detail::StragglerMonitor::setActive(nullptr);
  }
  stragglers_.reset();
  detail::disableReformation(*this);
  comm_.reset();
  cpuComm_.reset();
}

namespace {

// How often a wait on the runtime's store looks for the agent's abort notice.
constexpr std::chrono::milliseconds kStoreAbortPoll{200};

// fsdprun --standby: this process is a spare, started before it was needed. It waits here (the
// program loaded, its pre-init work done) for the round it joins: one JSON line on the pipe
// FSDPRUN_STANDBY_FD names, {"env": {KEY: VALUE}} with what differs from the environment it was
// started with. End of file: it was not needed, and leaves quietly. While it waits, it faults in
// the memory of its first step's full-parameter blocks on an idle-class thread. Returns the bytes
// it did by the activation (0 for a worker that is no spare).
std::size_t awaitActivation() {
  const char* text = std::getenv("FSDPRUN_STANDBY_FD");
  if (text == nullptr) return 0;
  const int fd = std::atoi(text);
  ::unsetenv("FSDPRUN_STANDBY_FD");
  detail::startWarmingSpareBlocks();
  std::string line;
  char c = 0;
  for (;;) {
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || c == '\n') break;
    line += c;
  }
  ::close(fd);
  const std::size_t warmed = detail::stopWarmingSpareBlocks();
  const auto message = nlohmann::json::parse(line, nullptr, false);
  if (line.empty() || message.is_discarded() || !message.contains("env") || !message["env"].is_object()) {
    std::_Exit(0);
  }
  for (const auto& [key, value] : message["env"].items()) {
    if (value.is_string()) ::setenv(key.c_str(), value.get<std::string>().c_str(), 1);
  }
  return warmed;
}

}  // namespace

std::unique_ptr<Runtime> init(const InitOptions& options) {
  // First: from here on the agent learns of this process's exit at its start, not after the
  // kernel has freed its memory (a spare's too, while it waits).
  holdLifeline();
  // The agent's flight recorder, before anything else opens descriptors (a program that closed
  // it gets none, never someone else's descriptor).
  detail::FlightRecorder::process();
  // Before a spare waits: a bad value stops every worker now, the spares' too, on every backend
  // (FSDP_NCCL_SHRINK is read where NCCL is built).
  detail::checkBlockEnvironment();
  envFlag(processEnv(), "FSDP_NCCL_SHRINK", true);
  // A write to a peer that died (a lost node's Gloo pair, its snapshot keeper) fails with EPIPE
  // and is reported as an error, instead of killing this worker by SIGPIPE, as under Python
  // (which ignores it too). A handler the program installed stays.
  struct sigaction pipe {};
  if (::sigaction(SIGPIPE, nullptr, &pipe) == 0 && pipe.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  const std::size_t warmed = awaitActivation();
  WorkerEnv env = WorkerEnv::fromEnvironment(processEnv());
  log::setup({.role = "worker", .rank = env.rank, .defaultLevel = spdlog::level::warn});
  if (warmed > 0) log::info("spare: {} MB of full-parameter block memory faulted in while it waited", warmed >> 20);
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
  // Under --restart_mode auto a wait on this store ends within kStoreAbortPoll of the agent's
  // abort notice (CommAborted), until the re-formation begins: a loop's own wait, or rank 0's for a
  // checkpoint's files, would otherwise hold every survivor for the wait's whole timeout.
  if (auto& control = detail::ReformControl::process(); control.active()) {
    store->setWaitCheck([&control] { control.throwIfAborted("a wait on the store"); }, kStoreAbortPoll);
  }
  auto built = detail::buildCommunicators(env, *store, options);
  log::info("connected: store {}, world {}, backend {} ({})", store->endpoint(), env.worldSize,
            built.comm->backendName(), built.reason);
  auto runtime = std::make_unique<Runtime>(std::move(env), std::move(store), std::move(built.comm),
                                           std::move(built.cpuComm), built.backend);
  runtime->initOptions_ = options;
  runtime->token_ = token;
  detail::startStragglerMonitor(*runtime, token);
  detail::enableReformation(*runtime);
  return runtime;
}

namespace detail {

Communicators buildCommunicators(const WorkerEnv& env, rendezvous::StoreClient& storeClient, const InitOptions& options,
                                 std::unique_ptr<NcclParent> ncclParent) {
  auto* store = &storeClient;
  const auto requested = processEnv()("FSDPRUN_BACKEND");
  auto choice = chooseBackend(requested, options.backend, probeBackends(), env.localRank, env.localWorldSize);
  const std::string round = Runtime::roundPrefixFor(env.round);
  const bool oneNode = env.localWorldSize == env.worldSize;
  // The staging slot of the shared-memory communicators (a bad value is an error, never a
  // silent fallback to Gloo).
  std::size_t slotBytes = ShmOptions{}.slotBytes;
  if (processEnv()("FSDPRUN_SHM_SLOT_KB")) {
    const long long kb = envInt(processEnv(), "FSDPRUN_SHM_SLOT_KB", 0);
    if (kb < 4 || kb > (1LL << 20)) {
      throw ConfigError("FSDPRUN_SHM_SLOT_KB=" + std::to_string(kb) + ": expected 4 to 1048576 (KiB per staging slot)");
    }
    slotBytes = static_cast<std::size_t>(kb) * 1024;
  }
  // Shared memory over every rank of this (one) node, under `prefix` in the round.
  const auto worldShm = [&](const std::string& prefix) {
    return createShmCommunicator(*store, {.rank = env.rank,
                                          .size = env.worldSize,
                                          .storePrefix = round + prefix,
                                          .runId = env.runId,
                                          .slotBytes = slotBytes,
                                          .timeout = options.timeout});
  };
  std::unique_ptr<Communicator> shm;
  if (choice.backend == Backend::kShm && oneNode && env.worldSize > 1) {
    try {
      shm = worldShm("shm/world");
    } catch (const ConfigError& e) {
      // Every rank learns the same refusal from rank 0 (no room in /dev/shm): auto falls back
      // together; a request for shm does not.
      const bool asked = (requested && !requested->empty()) || options.backend == Backend::kShm;
      if (asked) throw;
      log::warn("shared memory unavailable, using Gloo: {}", e.what());
      choice = {Backend::kGloo, -1, "auto: shared memory unavailable"};
    }
  }
  // Several nodes of several ranks each: shared memory inside every node, Gloo across, when
  // ranks are node-major (fsdprun's layout: the same number of workers on every node).
  const bool nodeMajor = env.worldSize % env.localWorldSize == 0 &&
                         env.rank == env.groupRank * env.localWorldSize + env.localRank;
  if (choice.backend == Backend::kShm && !oneNode && env.localWorldSize > 1 && nodeMajor) {
    const int node = env.rank / env.localWorldSize;
    auto inside = createShmCommunicator(*store, {.rank = env.localRank,
                                                 .size = env.localWorldSize,
                                                 .storePrefix = round + "shm/node/" + std::to_string(node),
                                                 .runId = env.runId,
                                                 .slotBytes = slotBytes,
                                                 .timeout = options.timeout});
    auto across = createGlooCommunicator(*store, {.rank = node,
                                                  .size = env.worldSize / env.localWorldSize,
                                                  .localAddress = env.localAddress,
                                                  .storePrefix = round + "gloo/cross/" + std::to_string(env.localRank),
                                                  .timeout = options.timeout});
    shm = makeHierarchicalCommunicator(std::move(inside), std::move(across));
  }
  if (shm) return {std::move(shm), nullptr, Backend::kShm, choice.reason};
  // The CPU world: Gloo; in a build without Gloo (LibTorch has its own copy), shared memory,
  // which reaches the ranks of one node only, and across nodes under NCCL a second NCCL
  // communicator that CPU tensors are staged through.
  const bool stagedCpu = !glooAvailable() && !oneNode && choice.backend == Backend::kNccl;
  std::unique_ptr<Communicator> cpu;
  if (glooAvailable()) {
    cpu = createGlooCommunicator(*store, {.rank = env.rank,
                                          .size = env.worldSize,
                                          .localAddress = env.localAddress,
                                          .storePrefix = round + "gloo/world",
                                          .timeout = options.timeout});
  } else if (oneNode) {
    cpu = worldShm("shm/cpu");
  } else if (!stagedCpu) {
    throw ConfigError(std::string("fsdp::init: ") + std::to_string(env.worldSize / env.localWorldSize) +
                      " nodes need CPU collectives across nodes, and this libfsdp has no Gloo: " +
                      glooUnavailableReason() + " (under NCCL they go through the GPUs)");
  }
  if (choice.backend == Backend::kNccl) {
    const auto ncclOptions = [&](const std::string& prefix) {
      return NcclOptions{.rank = env.rank,
                         .size = env.worldSize,
                         .device = choice.device,
                         .storePrefix = round + prefix,
                         .timeout = options.timeout};
    };
    // A round after the first may shrink the last one's communicator (its ranks say what they hold).
    auto nccl = createNcclCommunicator(*store, ncclOptions("nccl/world"), cudaNcclApi(),
                                       Deadline::after(options.timeout), std::move(ncclParent), env.round > 0);
    if (stagedCpu) {
      cpu = makeStagedCommunicator(createNcclCommunicator(*store, ncclOptions("nccl/cpu"), cudaNcclApi(),
                                                           Deadline::after(options.timeout)));
    }
    return {std::move(nccl), std::move(cpu), Backend::kNccl, choice.reason};
  }
  // kShm where ranks are not node-major (or one per node): Gloo for the world; HYBRID_SHARD's
  // node groups still use shared memory.
  return {std::move(cpu), nullptr, choice.backend, choice.reason};
}

}  // namespace detail

namespace detail {

void startStragglerMonitor(Runtime& runtime, const std::string& token) {
  auto& recorder = FlightRecorder::process();
  const auto options = stragglerOptionsFromEnv();
  if (!recorder.timing() || options.every == 0 || runtime.worldSize() < 2) return;
  const WorkerEnv& env = runtime.env();
  std::string node = processEnv()("FSDPRUN_NODE").value_or("");
  if (node.empty()) node = env.localAddress.empty() ? "rank" + std::to_string(env.rank) : env.localAddress;
  std::replace(node.begin(), node.end(), ' ', '_');
  auto connect = [host = env.storeHost, port = env.storePort, runId = env.runId, token] {
    return rendezvous::StoreClient::connect(host, static_cast<std::uint16_t>(port),
                                            {.connectTimeout = std::chrono::seconds(10), .runId = runId, .token = token});
  };
  auto monitor = std::make_shared<StragglerMonitor>(options, env.rank, env.worldSize, node, runtime.roundPrefix(),
                                                    std::move(connect));
  recorder.setStepObserver([m = monitor.get()](const FlightRecorder::StepSplit& s) {
    m->onStep(s.step, s.stepNs, s.waitNs, s.dataNs);
  });
  StragglerMonitor::setActive(monitor);
  runtime.stragglers_ = std::move(monitor);
}

}  // namespace detail

}  // namespace fsdp::worker
