// The in-process re-formation (reform.hpp): the runtime's side (its communicators rebuilt for
// the new round under the same objects) and the public calls.
#include "fsdp/worker/reform.hpp"

#include <ATen/Context.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "comm/recorded_communicator.hpp"
#include "fsdp/common/env.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/state.hpp"
#include "reform/control.hpp"
#include "reform/reformable_communicator.hpp"
#include "runtime_internal.hpp"
#include "stats/straggler.hpp"

namespace fsdp::worker {
namespace detail {

using Clock = std::chrono::steady_clock;

void ReformableCommunicator::Released::refuse() {
  throw CommAborted("the communicator of the last round was released; the new round's is not built yet");
}

std::unique_ptr<Communicator> reformable(std::unique_ptr<Communicator> inner) {
  if (!inner) return inner;
  return std::make_unique<ReformableCommunicator>(std::move(inner));
}

struct RuntimeReform {
  static void enable(Runtime& rt) {
    auto& control = ReformControl::process();
    if (!control.active() || rt.abortHook_ != 0) return;
    // A CPU-only process: its replacement need not wait until the kernel has freed its memory.
    control.tellDeviceMemory(at::hasCUDA());
    rt.abortHook_ = control.addAbortHook([&rt](const std::string& why) {
      // The control channel's thread: every blocked collective of this process wakes.
      if (rt.comm_) rt.comm_->abort(why);
      if (rt.cpuComm_) rt.cpuComm_->abort(why);
    });
  }

  static void disable(Runtime& rt) {
    if (rt.abortHook_ == 0) return;
    ReformControl::process().removeAbortHook(rt.abortHook_);
    rt.abortHook_ = 0;
  }

  static FsdpState& state(FullyShardedDataParallel& model) { return *model->state_; }
  static std::chrono::milliseconds timeout(const Runtime& rt) { return rt.initOptions_.timeout; }

  // The new round's communicators under the runtime's fixed ones.
  static void rebuild(Runtime& rt, const std::map<std::string, std::string>& changes) {
    for (const auto& [key, value] : changes) ::setenv(key.c_str(), value.c_str(), 1);
    WorkerEnv next = WorkerEnv::fromEnvironment(processEnv());
    if (next.localRank != rt.env_.localRank || next.localWorldSize != rt.env_.localWorldSize) {
      throw ReformError("the new round moves local rank " + std::to_string(rt.env_.localRank) + " of " +
                        std::to_string(rt.env_.localWorldSize) + " to " + std::to_string(next.localRank) + " of " +
                        std::to_string(next.localWorldSize) + ": a new process takes it");
    }
    // The old round's communicators go first: their threads end, their shared memory goes.
    auto* comm = static_cast<ReformableCommunicator*>(rt.comm_.get());
    auto* cpu = static_cast<ReformableCommunicator*>(rt.cpuComm_.get());
    // An NCCL communicator revoked by the abort outlives its object: the new round may shrink it.
    auto ncclParent = comm->takeNcclParent();
    comm->release();
    if (cpu != nullptr) cpu->release();
    if (next.storeHost != rt.env_.storeHost || next.storePort != rt.env_.storePort) {
      // The rendezvous moved (its host was lost): the store with it, in the same object (the
      // program may hold a reference to rt->store()).
      rt.store_->reconnect(next.storeHost, static_cast<std::uint16_t>(next.storePort),
                           {.connectTimeout = rt.initOptions_.timeout, .timeout = rt.initOptions_.timeout,
                            .runId = next.runId, .token = rt.token_});
    }
    rt.env_ = std::move(next);
    // The flight ring says from when its records are this round's (the hang report reads it).
    FlightRecorder::process().attach(rt.env_.rank);
    auto built = buildCommunicators(rt.env_, *rt.store_, rt.initOptions_, std::move(ncclParent));
    if ((built.cpuComm != nullptr) != (cpu != nullptr) || built.backend != rt.backend_) {
      throw ReformError(std::string("the new round's communicators are of another kind (") + backendName(built.backend) +
                        ", was " + backendName(rt.backend_) + ")");
    }
    comm->replace(recordCollectives(std::move(built.comm), "world"));
    if (cpu != nullptr) cpu->replace(recordCollectives(std::move(built.cpuComm), "world.cpu"));
    // The straggler windows of the new round, under its store prefix.
    if (rt.stragglers_ && StragglerMonitor::active() == rt.stragglers_) {
      FlightRecorder::process().setStepObserver({});
      StragglerMonitor::setActive(nullptr);
    }
    rt.stragglers_.reset();
    startStragglerMonitor(rt, rt.token_);
  }
};

void enableReformation(Runtime& runtime) { RuntimeReform::enable(runtime); }
void disableReformation(Runtime& runtime) { RuntimeReform::disable(runtime); }

}  // namespace detail

namespace {

// Why `model` cannot go through a re-formation ("" when it can).
std::string whyNot(Runtime& runtime, FullyShardedDataParallel& model) {
  if (!detail::ReformControl::process().active()) {
    return "no agent control channel (not under fsdprun --restart_mode auto)";
  }
  auto& state = detail::RuntimeReform::state(model);
  if (state.options_.shardGroup != nullptr || state.options_.replicateGroup != nullptr) {
    return "the model's HYBRID_SHARD groups are the program's, not the runtime's: they cannot be "
           "rebuilt here";
  }
  if (&state.comm_ != &runtime.comm()) {
    return "the model's communicator is not the runtime's comm(): it cannot be rebuilt here";
  }
  if (const int models = detail::liveModels(); models > 1) {
    return std::to_string(models) +
           " FSDP models in this process: a re-formation rebuilds one model's state, the "
           "others' would pair no collective with a new process's constructors";
  }
  return "";
}

}  // namespace

ReformScope::ReformScope(Runtime& runtime) {
  (void)runtime;
  auto& control = detail::ReformControl::process();
  if (!control.active()) return;
  active_ = true;
  control.setReady(true);
}

ReformScope::ReformScope(Runtime& runtime, FullyShardedDataParallel& model) {
  auto& control = detail::ReformControl::process();
  if (!control.active()) return;
  if (const auto why = whyNot(runtime, model); !why.empty()) {
    // Once a process (a Trainer enters a scope each round): the agent's own line only says this
    // worker was not in a loop that re-forms.
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      const auto text = fmt::format("rank {}: a failure elsewhere restarts this process too: {}",
                                    runtime.rank(), why);
      runtime.rank() == 0 ? log::warn("{}", text) : log::info("{}", text);
    }
    return;
  }
  active_ = true;
  control.setReady(true);
}

ReformScope::~ReformScope() {
  if (active_) detail::ReformControl::process().setReady(false);
}

bool reformPending(Runtime& runtime, std::chrono::milliseconds bound) {
  (void)runtime;
  auto& control = detail::ReformControl::process();
  if (!control.active()) return false;
  if (control.awaitAbort(std::chrono::milliseconds(0))) return true;
  // Only a failed collective (a peer gone: seen here before the agent's notice) is worth the wait.
  if (control.collectiveFailures() == 0) return false;
  return control.awaitAbort(bound);
}

bool canReform(Runtime& runtime, FullyShardedDataParallel& model) { return whyNot(runtime, model).empty(); }

ReformInfo reform(Runtime& runtime, FullyShardedDataParallel& model) {
  auto& control = detail::ReformControl::process();
  if (const auto why = whyNot(runtime, model); !why.empty()) throw ReformError(why);
  // Without the agent's notice no round comes: a loop that calls this on an error of its own
  // (not after reformPending()) gets that at once, nothing changed, not a wait of many minutes.
  if (!control.awaitAbort(std::chrono::milliseconds(0))) {
    throw ReformError("reform() with no re-formation under way (the agent's notice has not come): call it "
                      "only where reformPending() returned true; any other error is this process's own");
  }
  const auto start = detail::Clock::now();
  control.setReforming(true);
  ReformInfo info;
  info.why = control.abortReason();
  if (const auto noticed = control.abortTime()) {
    info.noticeMs = std::max(0.0, std::chrono::duration<double, std::milli>(start - *noticed).count());
  }
  auto& state = detail::RuntimeReform::state(model);
  // Whatever the interrupted step left goes before its communicators do.
  state.abandonAfterAbort();
  std::string why;
  // The agent sends the round once every node has joined it (the rendezvous' own bound).
  const auto changes = control.awaitReform(std::chrono::duration_cast<std::chrono::milliseconds>(
                                               detail::RuntimeReform::timeout(runtime) + std::chrono::seconds(600)),
                                           why);
  if (!changes) throw ReformError("waiting for the new round: " + why);
  const int wasRank = runtime.rank();
  const int wasWorld = runtime.worldSize();
  detail::RuntimeReform::rebuild(runtime, *changes);
  state.replayConstruction();
  info.previousRank = wasRank;
  info.previousWorldSize = wasWorld;
  info.resharded = state.relayout();
  if (info.resharded) {
    log::info("rank {} of {} (was {} of {}): FSDP's shards laid out again for the new world", runtime.rank(),
              runtime.worldSize(), wasRank, wasWorld);
  }
  info.round = runtime.env().round;
  info.restartCount = runtime.env().restartCount;
  info.ms = std::chrono::duration<double, std::milli>(detail::Clock::now() - start).count();
  log::info("re-formed in process for round {} in {:.0f} ms ({})", info.round, info.ms, info.why);
  return info;
}

void reformDone(Runtime& runtime) {
  detail::ReformControl::process().reformed(runtime.env().round);
}

}  // namespace fsdp::worker
