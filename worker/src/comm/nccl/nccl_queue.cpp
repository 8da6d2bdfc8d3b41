// NcclQueue: the operations of one NCCL communicator from launch to done: events from a pool,
// the watchdog, the failure path (abort, streams ordered, tensors released) and the close.
#include "nccl_queue.hpp"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <utility>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::worker::detail {

std::mutex& ncclDeviceMutex(int device) {
  static std::mutex guard;
  static std::map<int, std::unique_ptr<std::mutex>> perDevice;
  std::scoped_lock lock(guard);
  auto& m = perDevice[device];
  if (!m) m = std::make_unique<std::mutex>();
  return *m;
}

namespace {

constexpr auto kPoll = std::chrono::milliseconds(1);

// Makes `device` the calling thread's current device for the guard's lifetime: events, streams
// and the legacy default stream belong to the current device of the thread that uses them.
class DeviceGuard {
 public:
  DeviceGuard(NcclApi& api, int device) : api_(api), previous_(api.currentDevice()) {
    if (previous_ != device) entered_ = api_.setDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && entered_.isDone() && api_.currentDevice() != previous_) {
      api_.setDevice(previous_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  // Throws when the device could not be made current.
  void check(const std::string& where) const {
    if (!entered_.isDone()) throw Error(where + ": cudaSetDevice: " + entered_.cause);
  }

 private:
  NcclApi& api_;
  int previous_;
  ApiResult entered_;
};

class EventPool;

// An event of the pool, back to it when destroyed.
class PooledEvent {
 public:
  PooledEvent(std::shared_ptr<EventPool> pool, CudaEvent event)
      : pool_(std::move(pool)), event_(event) {}
  ~PooledEvent();
  PooledEvent(PooledEvent&& other) noexcept = default;
  PooledEvent(const PooledEvent&) = delete;
  PooledEvent& operator=(const PooledEvent&) = delete;
  PooledEvent& operator=(PooledEvent&&) = delete;
  CudaEvent get() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  CudaEvent event_;
};

// Events are made once and reused: an operation takes two (one recorded on the compute stream,
// back at once, since a stream wait takes the record made before it; one for its completion,
// back when the operation and its Work handles are gone). Destroys its events when the last
// PooledEvent and the queue are gone.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(std::shared_ptr<NcclApi> api) : api_(std::move(api)) {}
  ~EventPool() {
    for (const auto event : free_) api_->destroyEvent(event);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // Throws Error prefixed by `where` when no event can be made.
  PooledEvent acquire(const std::string& where) {
    {
      std::scoped_lock lock(mutex_);
      if (!free_.empty()) {
        const auto event = free_.back();
        free_.pop_back();
        return {shared_from_this(), event};
      }
    }
    const auto made = api_->createEvent();
    if (!made.result.isDone()) throw Error(where + ": cudaEventCreate: " + made.result.cause);
    return {shared_from_this(), made.handle};
  }
  void giveBack(CudaEvent event) {
    std::scoped_lock lock(mutex_);
    free_.push_back(event);
  }

 private:
  std::shared_ptr<NcclApi> api_;
  std::mutex mutex_;
  std::vector<CudaEvent> free_;
};

PooledEvent::~PooledEvent() {
  if (pool_) pool_->giveBack(event_);
}

// One issued operation. It keeps its tensors until its completion event is reached (or, after
// an abort, until its compute stream waits for that event), so that the caching allocator does
// not hand their memory to the compute stream while NCCL still reads or writes it.
struct Operation {
  Operation(std::string name, PooledEvent done, CudaStream compute, std::vector<at::Tensor> tensors,
            Deadline deadline)
      : name(std::move(name)),
        done(std::move(done)),
        compute(compute),
        tensors(std::move(tensors)),
        deadline(deadline) {}
  const std::string name;
  const PooledEvent done;
  const CudaStream compute;         // the launching thread's current stream at launch
  std::vector<at::Tensor> tensors;  // guarded by QueueState::mutex once queued
  const Deadline deadline;
  // Guarded by QueueState::mutex.
  bool finished = false;
  std::string error;
};

// Tensors given back, dropped once no lock is held.
using Released = std::vector<std::vector<at::Tensor>>;

std::string describe(const NcclQueueOptions& o) {
  return "rank " + std::to_string(o.rank) + " of " + std::to_string(o.size) +
         " (cuda:" + std::to_string(o.device) + ")";
}

}  // namespace

// What the queue, its watchdog and its Work handles share.
struct QueueState {
  QueueState(std::shared_ptr<NcclApi> a, NcclComm c, NcclQueueOptions o)
      : api(std::move(a)), pool(std::make_shared<EventPool>(api)), options(o), comm(c) {}

  const std::shared_ptr<NcclApi> api;
  const std::shared_ptr<EventPool> pool;
  const NcclQueueOptions options;
  std::mutex mutex;
  std::condition_variable changed;  // an operation was queued, finished or failed; abort; stop
  // Guarded by mutex.
  NcclComm comm;  // nullptr once aborted, revoked or closed
  NcclComm revoked = nullptr;  // revoked by abort(), until takeRevoked() or the close
  std::deque<std::shared_ptr<Operation>> inFlight;
  std::string error;  // the first failure; every later operation throws it
  bool aborted = false;  // the failure is an abort (Communicator::abort): CommAborted
  bool stop = false;

  // The error of `error`'s kind. Caller holds `mutex`.
  [[noreturn]] void throwLocked(const std::string& message) const {
    if (aborted) throw CommAborted(message);
    throw Error(message);
  }

  std::string where(const std::string& op) const {
    return "nccl " + op + " on " + describe(options);
  }

  // Records the first failure, aborts the communicator, fails every pending operation. Caller
  // holds `mutex`.
  void failLocked(const std::string& op, const std::string& cause, Released& released) {
    if (error.empty()) {
      error = "nccl " + op + " failed on " + describe(options) + ": " + cause +
              "; the communicator was aborted";
      log::error("{}", error);
    }
    abortLocked(released);
  }

  // Caller holds `mutex`, `error` is set, and the calling thread's device is options.device.
  void abortLocked(Released& released) {
    if (comm != nullptr) {
      std::scoped_lock issue(ncclDeviceMutex(options.device));
      api->commAbort(comm);
      comm = nullptr;
    }
    // Kernels queued before the abort may still start or exit after it: each compute stream of
    // a pending operation waits for the last of its operations (they complete in issue order)
    // before their tensors go back to the allocator, which hands memory out on that stream.
    std::vector<CudaStream> ordered;
    for (auto it = inFlight.rbegin(); it != inFlight.rend(); ++it) {
      auto& pending = **it;
      if (std::find(ordered.begin(), ordered.end(), pending.compute) == ordered.end()) {
        ordered.push_back(pending.compute);
        if (const auto r = api->streamWaitEvent(pending.compute, pending.done.get()); !r.isDone()) {
          log::error("{}: ordering the compute stream after the aborted operation: {}",
                     where(pending.name), r.cause);
        }
      }
    }
    for (auto& pending : inFlight) {
      pending->error = error;
      released.push_back(std::move(pending->tensors));
    }
    inFlight.clear();
    changed.notify_all();
  }

  // The error an operation named `op` meets now, or "" when it may go on. Caller holds `mutex`.
  std::string refusalLocked(const std::string& op) const {
    if (!error.empty()) return error + "; " + op + " was not run";
    if (comm == nullptr) return where(op) + ": the communicator is closed";
    return "";
  }
};

namespace {

// Retires finished operations in issue order and watches the oldest one's deadline and the
// communicator's asynchronous error. Sleeps while nothing is in flight.
void watch(const std::shared_ptr<QueueState> state) {
  if (const auto r = state->api->setDevice(state->options.device); !r.isDone()) {
    log::error("nccl watchdog on {}: cudaSetDevice: {}", describe(state->options), r.cause);
  }
  std::unique_lock lock(state->mutex);
  while (!state->stop) {
    if (state->inFlight.empty()) {
      state->changed.wait(lock, [&] { return state->stop || !state->inFlight.empty(); });
      continue;
    }
    Released released;
    while (!state->inFlight.empty()) {
      auto& front = *state->inFlight.front();
      const auto reached = state->api->queryEvent(front.done.get());
      if (reached.isPending()) break;
      if (reached.isFailed()) {
        state->failLocked(front.name, reached.cause, released);
        break;
      }
      front.finished = true;
      released.push_back(std::move(front.tensors));
      state->inFlight.pop_front();
      state->changed.notify_all();
    }
    if (!state->inFlight.empty() && state->comm != nullptr) {
      const auto async = state->api->commAsyncError(state->comm);
      const auto& oldest = *state->inFlight.front();
      if (async.isFailed()) {
        state->failLocked(oldest.name, async.cause, released);
      } else if (oldest.deadline.expired()) {
        state->failLocked(oldest.name,
                          "did not finish within its timeout of " +
                              std::to_string(state->options.timeout.count()) +
                              " ms (a peer died, stopped or issued different operations)",
                          released);
      }
    }
    lock.unlock();
    released.clear();
    lock.lock();
    if (!state->inFlight.empty()) state->changed.wait_for(lock, kPoll);
  }
}

}  // namespace

ApiResult settle(NcclApi& api, NcclComm comm, ApiResult result, const Deadline& deadline) {
  // NCCL's non-blocking calls have no completion notification: ncclCommGetAsyncError is polled.
  while (result.isPending() && !deadline.expired()) {
    std::this_thread::sleep_for(kPoll);
    result = api.commAsyncError(comm);
  }
  return result;
}

Made<NcclComm> awaitChild(NcclApi& api, const std::string& call, NcclComm parent, ApiResult called,
                          const std::function<NcclComm()>& child, const Deadline& deadline) {
  if (called.isFailed()) return {called, nullptr};
  const auto result = settle(api, parent, api.commAsyncError(parent), deadline);
  if (result.isPending()) return {result, nullptr};
  const NcclComm made = child();
  if (result.isDone() && made == nullptr) {
    return {ApiResult::failed(call + ": its job ended without a communicator"), nullptr};
  }
  return {result, made};
}

NcclQueue::NcclQueue(std::shared_ptr<NcclApi> api, NcclComm comm, CudaStream stream,
                     NcclQueueOptions options)
    : api_(api),
      state_(std::make_shared<QueueState>(api, comm, options)),
      stream_(stream),
      options_(options) {
  watchdog_ = std::thread(watch, state_);
}

NcclQueue::~NcclQueue() {
  // Peers may be gone while an exception unwinds: waiting for them, then finalizing with them,
  // could take twice the timeout; aborting is what every rank can do alone.
  const bool unwinding = std::uncaught_exceptions() > 0;
  const Deadline deadline = Deadline::after(options_.timeout);
  const DeviceGuard onDevice(*api_, options_.device);
  Released released;
  {
    std::unique_lock lock(state_->mutex);
    if (unwinding && state_->comm != nullptr) {
      if (state_->error.empty()) {
        state_->error = state_->where("close") +
                        ": the communicator was destroyed during stack unwinding (an error "
                        "elsewhere) and aborted without waiting for its operations";
        log::warn("{}", state_->error);
      }
      state_->abortLocked(released);
    } else if (!state_->changed.wait_until(lock, deadline.when(),
                                           [&] { return state_->inFlight.empty(); })) {
      state_->failLocked(state_->inFlight.front()->name,
                         "still in flight when the communicator was closed, " +
                             std::to_string(options_.timeout.count()) + " ms later",
                         released);
    }
    state_->stop = true;
    state_->changed.notify_all();
  }
  released.clear();
  watchdog_.join();
  // Only this thread sees the communicator now. What is left of the one deadline bounds the
  // finalize; the device's other communicators are not held up while it settles.
  if (state_->comm != nullptr) {
    const auto comm = state_->comm;
    state_->comm = nullptr;
    ApiResult result;
    {
      std::scoped_lock issue(ncclDeviceMutex(options_.device));
      result = api_->commFinalize(comm);
    }
    result = settle(*api_, comm, result, deadline);
    std::scoped_lock issue(ncclDeviceMutex(options_.device));
    if (result.isDone()) {
      api_->commDestroy(comm);
    } else {
      log::warn("{}: ncclCommFinalize {}; aborting", state_->where("close"),
                result.isPending() ? "did not finish within the close's timeout" : result.cause);
      api_->commAbort(comm);
    }
  }
  if (state_->revoked != nullptr) {  // not taken for a shrink
    std::scoped_lock issue(ncclDeviceMutex(options_.device));
    api_->commAbort(std::exchange(state_->revoked, nullptr));
  }
  api_->destroyStream(stream_);
}

NcclComm NcclQueue::takeRevoked() {
  std::scoped_lock lock(state_->mutex);
  return std::exchange(state_->revoked, nullptr);
}

Work NcclQueue::launch(const std::string& op, std::vector<at::Tensor> tensors, const Issue& issue,
                       WaitMode mode) {
  std::scoped_lock issuing(issueMutex_);
  const DeviceGuard onDevice(*api_, options_.device);
  onDevice.check(state_->where(op));
  {
    std::scoped_lock lock(state_->mutex);
    if (auto refusal = state_->refusalLocked(op); !refusal.empty()) state_->throwLocked(refusal);
  }
  // The compute stream is this thread's now; the operation keeps it for whoever waits, aborts or
  // releases later, from whatever thread.
  const CudaStream compute = api_->currentStream(options_.device);
  auto operation =
      std::make_shared<Operation>(op, state_->pool->acquire(state_->where(op)), compute,
                                  std::move(tensors), Deadline::after(options_.timeout));
  {
    const PooledEvent before = state_->pool->acquire(state_->where(op));
    if (const auto r = api_->recordEvent(before.get(), compute); !r.isDone()) {
      throw Error(state_->where(op) + ": cudaEventRecord on the compute stream: " + r.cause);
    }
    if (const auto r = api_->streamWaitEvent(stream_, before.get()); !r.isDone()) {
      throw Error(state_->where(op) +
                  ": cudaStreamWaitEvent on the communication stream: " + r.cause);
    }
  }  // `before` goes back to the pool: the wait took the record made before it

  // After the collective may have reached the stream: fail (abort), then wait on the host for
  // the communication stream, which the abort ends, before the tensors are let go.
  const auto giveUp = [&](const std::string& cause) {
    Released released;
    std::string message;
    bool aborted = false;
    {
      std::scoped_lock lock(state_->mutex);
      if (!cause.empty()) state_->failLocked(op, cause, released);
      message = state_->error + (cause.empty() ? "; " + op + " was abandoned" : "");
      aborted = state_->aborted;
    }
    if (const auto r = api_->synchronizeStream(stream_); !r.isDone()) {
      log::error("{}: waiting for the communication stream after the abort: {}", state_->where(op),
                 r.cause);
    }
    if (aborted) throw CommAborted(message);
    throw Error(message);
  };

  ApiResult result;
  {
    std::scoped_lock lock(state_->mutex);
    if (auto refusal = state_->refusalLocked(op); !refusal.empty()) state_->throwLocked(refusal);
    std::scoped_lock device(ncclDeviceMutex(options_.device));
    result = issue(state_->comm, stream_);
  }
  // A non-blocking enqueue may still be settling. Poll it with no lock held across the wait; an
  // abort meanwhile (the watchdog, another thread) wakes this at once.
  while (result.isPending()) {
    std::unique_lock lock(state_->mutex);
    state_->changed.wait_for(lock, kPoll);
    if (state_->comm == nullptr) {
      lock.unlock();
      giveUp("");
    }
    if (operation->deadline.expired()) {
      lock.unlock();
      giveUp("enqueueing did not finish within its timeout of " +
                   std::to_string(options_.timeout.count()) + " ms");
    }
    result = api_->commAsyncError(state_->comm);
  }
  if (result.isFailed()) giveUp(result.cause);
  // Without its completion event an operation cannot be watched (an event never recorded reads
  // as reached): it is not queued, and the communicator is aborted.
  if (const auto r = api_->recordEvent(operation->done.get(), stream_); !r.isDone()) {
    giveUp("cudaEventRecord after the collective: " + r.cause);
  }
  {
    std::scoped_lock lock(state_->mutex);
    if (!state_->error.empty()) {
      // Aborted since it settled: ordered as abortLocked() orders the pending ones.
      api_->streamWaitEvent(compute, operation->done.get());
      state_->throwLocked(state_->error + "; " + op + " was abandoned");
    }
    state_->inFlight.push_back(operation);
    state_->changed.notify_all();
  }
  return Work(
      [state = state_, operation, mode] {
        std::unique_lock lock(state->mutex);
        if (mode == WaitMode::kHost) {
          state->changed.wait(lock,
                              [&] { return operation->finished || !operation->error.empty(); });
        }
        if (!operation->error.empty()) state->throwLocked(operation->error);
        if (operation->finished) return;  // reached: nothing left to order
        const DeviceGuard onDevice(*state->api, state->options.device);
        onDevice.check(state->where(operation->name));
        if (const auto r = state->api->streamWaitEvent(operation->compute, operation->done.get());
            !r.isDone()) {
          throw Error(state->where(operation->name) +
                      ": cudaStreamWaitEvent on the compute stream: " + r.cause);
        }
      },
      [state = state_, operation] {
        std::scoped_lock lock(state->mutex);
        return operation->finished || !operation->error.empty();
      });
}

bool NcclQueue::abort(const std::string& why) {
  const DeviceGuard onDevice(*api_, options_.device);
  Released released;
  NcclComm revoking = nullptr;
  ApiResult revoke;
  {
    std::scoped_lock lock(state_->mutex);
    if (state_->error.empty()) {
      state_->aborted = true;
      state_->error = state_->where("abort") + ": the communicator was aborted: " + why;
      if (state_->comm != nullptr && api_->canShrink()) {
        std::scoped_lock issue(ncclDeviceMutex(options_.device));
        revoke = api_->commRevoke(state_->comm);
        if (revoke.isFailed()) {
          log::warn("{}: ncclCommRevoke: {}; aborting instead", state_->where("abort"), revoke.cause);
        } else {
          revoking = std::exchange(state_->comm, nullptr);
        }
      }
    }
    state_->abortLocked(released);  // the pending operations fail; a revoked communicator is kept
  }
  released.clear();
  if (revoking != nullptr) {
    const auto bound = std::min(options_.timeout, kRevokeBound);
    revoke = settle(*api_, revoking, revoke, Deadline::after(bound));
    std::scoped_lock lock(state_->mutex);
    if (revoke.isDone()) {
      state_->revoked = revoking;
    } else {
      log::warn("{}: ncclCommRevoke {}; aborting instead", state_->where("abort"),
                revoke.isPending() ? "did not settle within " + std::to_string(bound.count()) + " ms"
                                   : revoke.cause);
      std::scoped_lock issue(ncclDeviceMutex(options_.device));
      api_->commAbort(revoking);
    }
  }
  // What the kernels left on the communication stream: an error here is sticky (the device is
  // unusable in this process).
  if (const auto r = api_->synchronizeStream(stream_); !r.isDone()) {
    log::error("{}: the communication stream after the abort: {}; the device needs a new process",
               state_->where("abort"), r.cause);
    return false;
  }
  return true;
}

}  // namespace fsdp::worker::detail
