#pragma once
// A CUDA runtime and NCCL that run on the CPU, behind the NCCL communicator's seam
// (worker/src/comm/nccl/nccl_api.hpp): handles are numbers, an event is reached when the test says
// so, and the test can make a record fail, an enqueue or an init hang, a communicator report an
// asynchronous error, the library revoke and shrink (NCCL 2.28) or not. It counts what was made
// and destroyed, logs stream waits and shrinks, and notes any call on an aborted communicator,
// any collective on a revoked one, and any wait on an event never recorded.
//
// The current stream and device are per thread, as PyTorch's and CUDA's are. Thread-safe.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "comm/nccl/nccl_api.hpp"
#include "fsdp/common/error.hpp"

namespace fsdp::testing {

// How a wait on an operation ended: "no error", "CommAborted" (an abort), or "another error: …".
inline std::string waitOutcome(const fsdp::worker::Work& work) {
  try {
    work.wait();
    return "no error";
  } catch (const fsdp::CommAborted&) {
    return "CommAborted";
  } catch (const std::exception& e) {
    return std::string("another error: ") + e.what();
  }
}

namespace fd = fsdp::worker::detail;

class FakeNcclApi final : public fd::NcclApi {
 public:
  using Stream = fd::CudaStream;
  using Event = fd::CudaEvent;
  using Comm = fd::NcclComm;
  using Result = fd::ApiResult;

  static void* handle(std::uintptr_t n) { return reinterpret_cast<void*>(n); }
  static constexpr std::uintptr_t kDefaultStream = 1;  // every thread's until it sets its own

  struct Counts {
    int eventsCreated = 0, eventsDestroyed = 0, streamsCreated = 0, streamsDestroyed = 0;
    int aborts = 0, finalizes = 0, destroys = 0, collectives = 0, synchronizes = 0;
    int inits = 0, revokes = 0, shrinks = 0;
    int allocated = 0, released = 0;
    int callsAfterAbort = 0;    // must stay 0: an aborted communicator is freed, a revoked one
                                // takes no collective
    int waitsOnUnrecorded = 0;  // must stay 0: such a wait orders nothing
  };

  // ---- What the test sets.
  // The calling thread's current stream (PyTorch's is per thread).
  static void setCurrentStream(Stream stream) { threadStream() = stream; }
  // Events recorded on a communication stream from now on are reached at once.
  void setAutoReach(bool on) {
    std::scoped_lock lock(mutex_);
    autoReach_ = on;
  }
  // Every event recorded so far is reached.
  void reachAll() {
    std::scoped_lock lock(mutex_);
    for (auto& [id, e] : events_) e.reached = e.recorded;
  }
  // The next record on a communication stream fails with `cause`.
  void failNextCommRecord(std::string cause) {
    std::scoped_lock lock(mutex_);
    failRecord_ = std::move(cause);
  }
  // commAsyncError(comm) fails from now on.
  void setAsyncError(Comm comm, std::string cause) {
    std::scoped_lock lock(mutex_);
    comms_[id(comm)].asyncError = std::move(cause);
  }
  // Collectives on `comm` answer "in progress" and stay so until releaseEnqueues().
  void hangEnqueues(Comm comm) {
    std::scoped_lock lock(mutex_);
    comms_[id(comm)].hangEnqueues = true;
  }
  void releaseEnqueues() {
    std::scoped_lock lock(mutex_);
    for (auto& [id, c] : comms_) {
      c.hangEnqueues = false;
      c.enqueuePending = false;
    }
  }
  // commInitRank's communicators stay "in progress" for ever; commAsyncError fails after
  // `pollCap` polls of one of them (a test's bound: the caller should have given up before).
  void setInitNeverSettles(int pollCap) {
    std::scoped_lock lock(mutex_);
    initPollCap_ = pollCap;
  }
  void setInitFails(std::string cause) {
    std::scoped_lock lock(mutex_);
    initFails_ = std::move(cause);
  }
  void setFinalizeNeverSettles() {
    std::scoped_lock lock(mutex_);
    finalizeHangs_ = true;
  }
  // The library has ncclCommRevoke and ncclCommShrink (off: an NCCL before 2.28).
  void setShrinkSupported(bool on) {
    std::scoped_lock lock(mutex_);
    canShrink_ = on;
  }
  // commRevoke fails with `cause`; or stays "in progress" for ever (a test's bound: the caller
  // gives up first).
  void setRevokeFails(std::string cause) {
    std::scoped_lock lock(mutex_);
    revokeFails_ = std::move(cause);
  }
  void setRevokeNeverSettles() {
    std::scoped_lock lock(mutex_);
    revokeHangs_ = true;
  }
  // The shrink's job outlives the call's wait (NCCL's job still running at the deadline): the
  // call answers pending, with no communicator, as the real one does then.
  void setShrinkOutlivesTheWait(bool on) {
    std::scoped_lock lock(mutex_);
    shrinkOutlives_ = on;
  }
  // commAsyncError answers pending for the next `polls` polls of `comm` (-1: for ever), as
  // NCCL's parent does while a split's or shrink's job runs; asyncPollsLeft says how many are left.
  void setAsyncPendingPolls(Comm comm, int polls) {
    std::scoped_lock lock(mutex_);
    use(comm, true).pendingPolls = polls;
  }
  int asyncPollsLeft(Comm comm) {
    std::scoped_lock lock(mutex_);
    return use(comm, true).pendingPolls;
  }
  void setShrinkFails(std::string cause) {
    std::scoped_lock lock(mutex_);
    shrinkFails_ = std::move(cause);
  }

  // Called (without the fake's lock) on each stream wait and each stream synchronize.
  void onStreamWait(std::function<void(Stream, Event)> hook) {
    std::scoped_lock lock(mutex_);
    onWait_ = std::move(hook);
  }
  void onSynchronize(std::function<void(Stream)> hook) {
    std::scoped_lock lock(mutex_);
    onSync_ = std::move(hook);
  }

  // A communicator already initialised, for tests of the queue.
  Comm newComm() {
    std::scoped_lock lock(mutex_);
    const auto c = next_++;
    comms_[c];
    return handle(c);
  }

  // ---- What the test reads; each waiting call is bounded and answers whether it happened.
  Counts counts() const {
    std::scoped_lock lock(mutex_);
    return counts_;
  }
  std::vector<std::pair<Stream, Event>> streamWaits() const {
    std::scoped_lock lock(mutex_);
    return waits_;
  }
  // The event last recorded on a communication stream (nullptr: none).
  Event lastCommEvent() const {
    std::scoped_lock lock(mutex_);
    return lastCommEvent_;
  }
  // Each shrink: the parent and the ranks it left out, in call order.
  std::vector<std::pair<Comm, std::vector<int>>> shrinks() const {
    std::scoped_lock lock(mutex_);
    return shrinkLog_;
  }
  bool isAborted(Comm comm) const {
    std::scoped_lock lock(mutex_);
    const auto it = comms_.find(id(comm));
    return it != comms_.end() && it->second.aborted;
  }
  int queriesOf(Event event) const {
    std::scoped_lock lock(mutex_);
    const auto it = events_.find(id(event));
    return it == events_.end() ? 0 : it->second.queries;
  }
  bool waitForAborts(int n, std::chrono::milliseconds bound) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, bound, [&] { return counts_.aborts >= n; });
  }
  // Until an enqueue is in progress and has been polled once.
  bool waitForEnqueuePolled(std::chrono::milliseconds bound) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, bound, [&] { return enqueuePolled_; });
  }

  // ---- NcclApi.
  int deviceCount() override { return 1; }
  int currentDevice() override { return threadDevice(); }
  Result setDevice(int device) override {
    threadDevice() = device;
    return Result::done();
  }
  Stream currentStream(int) override { return threadStream(); }
  fd::Made<Stream> createStream() override {
    std::scoped_lock lock(mutex_);
    ++counts_.streamsCreated;
    const auto s = next_++;
    commStreams_.insert(s);
    return {Result::done(), handle(s)};
  }
  void destroyStream(Stream) override {
    std::scoped_lock lock(mutex_);
    ++counts_.streamsDestroyed;
  }
  fd::Made<void*> allocate(std::size_t) override {
    std::scoped_lock lock(mutex_);
    ++counts_.allocated;
    return {Result::done(), handle(next_++)};
  }
  void release(void*) override {
    std::scoped_lock lock(mutex_);
    ++counts_.released;
  }
  fd::Made<Event> createEvent() override {
    std::scoped_lock lock(mutex_);
    ++counts_.eventsCreated;
    const auto e = next_++;
    events_[e];
    return {Result::done(), handle(e)};
  }
  void destroyEvent(Event event) override {
    std::scoped_lock lock(mutex_);
    ++counts_.eventsDestroyed;
    events_.erase(id(event));
  }
  Result recordEvent(Event event, Stream stream) override {
    std::scoped_lock lock(mutex_);
    const bool onComm = commStreams_.count(id(stream)) != 0;
    if (onComm && !failRecord_.empty()) {
      auto cause = std::move(failRecord_);
      failRecord_.clear();
      return Result::failed("CUDA: " + cause);
    }
    auto& e = events_[id(event)];
    e.recorded = true;
    e.reached = !onComm || autoReach_;
    if (onComm) lastCommEvent_ = event;
    return Result::done();
  }
  Result queryEvent(Event event) override {
    std::scoped_lock lock(mutex_);
    auto& e = events_[id(event)];
    ++e.queries;
    // As CUDA: an event never recorded reads as reached.
    return !e.recorded || e.reached ? Result::done() : Result::pending();
  }
  Result streamWaitEvent(Stream stream, Event event) override {
    std::function<void(Stream, Event)> hook;
    {
      std::scoped_lock lock(mutex_);
      waits_.emplace_back(stream, event);
      if (!events_[id(event)].recorded) ++counts_.waitsOnUnrecorded;
      hook = onWait_;
    }
    if (hook) hook(stream, event);
    return Result::done();
  }
  Result synchronizeStream(Stream stream) override {
    std::function<void(Stream)> hook;
    {
      std::scoped_lock lock(mutex_);
      ++counts_.synchronizes;
      hook = onSync_;
    }
    if (hook) hook(stream);
    return Result::done();
  }

  fd::Made<std::string> uniqueId() override {
    std::scoped_lock lock(mutex_);
    std::string id(fd::kNcclUniqueIdBytes, '\0');
    for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(i * 7 + next_);
    ++next_;
    return {Result::done(), id};
  }
  fd::Made<Comm> commInitRank(int, const std::string&, int) override {
    std::scoped_lock lock(mutex_);
    ++counts_.inits;
    const auto c = next_++;
    auto& comm = comms_[c];
    if (!initFails_.empty()) return {Result::failed(initFails_), handle(c)};
    comm.initializing = initPollCap_ > 0;
    return {comm.initializing ? Result::pending() : Result::done(), handle(c)};
  }
  Result commAsyncError(Comm comm) override {
    std::scoped_lock lock(mutex_);
    auto& c = use(comm, true);
    if (c.pendingPolls != 0) {
      if (c.pendingPolls > 0) --c.pendingPolls;
      return Result::pending();
    }
    if (c.revoked) return revokeHangs_ ? Result::pending() : Result::done();
    if (!c.asyncError.empty()) return Result::failed(c.asyncError);
    if (c.initializing) {
      if (++c.initPolls > initPollCap_) {
        return Result::failed("fake: init polled " + std::to_string(c.initPolls) +
                              " times, past the deadline the caller was given");
      }
      return Result::pending();
    }
    if (c.enqueuePending) {
      enqueuePolled_ = true;
      changed_.notify_all();
      return Result::pending();
    }
    if (c.finalizing) return Result::pending();
    return Result::done();
  }
  Result commFinalize(Comm comm) override {
    std::scoped_lock lock(mutex_);
    ++counts_.finalizes;
    use(comm).finalizing = finalizeHangs_;
    return finalizeHangs_ ? Result::pending() : Result::done();
  }
  void commDestroy(Comm comm) override {
    std::scoped_lock lock(mutex_);
    ++counts_.destroys;
    use(comm).aborted = true;  // freed as well
  }
  void commAbort(Comm comm) override {
    std::scoped_lock lock(mutex_);
    ++counts_.aborts;
    auto& c = use(comm, true);
    c.aborted = true;
    c.enqueuePending = false;
    changed_.notify_all();
  }
  bool canShrink() override {
    std::scoped_lock lock(mutex_);
    return canShrink_;
  }
  Result commRevoke(Comm comm) override {
    std::scoped_lock lock(mutex_);
    ++counts_.revokes;
    auto& c = use(comm);
    if (!canShrink_) ++counts_.callsAfterAbort;  // never called on an older library
    if (!revokeFails_.empty()) return Result::failed(revokeFails_);
    c.revoked = true;
    c.enqueuePending = false;
    changed_.notify_all();
    return Result::pending();  // as NCCL: in progress until quiescent
  }
  fd::Made<Comm> commShrink(Comm parent, const std::vector<int>& exclude, const fsdp::Deadline&) override {
    std::scoped_lock lock(mutex_);
    ++counts_.shrinks;
    auto& p = use(parent, true);
    if (!p.revoked) ++counts_.callsAfterAbort;  // the parent is always revoked first
    shrinkLog_.emplace_back(parent, exclude);
    if (!shrinkFails_.empty()) return {Result::failed(shrinkFails_), nullptr};
    if (shrinkOutlives_) return {Result::pending(), nullptr};
    const auto c = next_++;
    comms_[c];
    return {Result::done(), handle(c)};
  }
  Result allReduce(const void*, void*, std::size_t, at::ScalarType, fsdp::worker::ReduceOp,
                   Comm comm, Stream) override {
    return enqueue(comm);
  }
  Result allGather(const void*, void*, std::size_t, at::ScalarType, Comm comm, Stream) override {
    return enqueue(comm);
  }
  Result reduceScatter(const void*, void*, std::size_t, at::ScalarType, fsdp::worker::ReduceOp,
                       Comm comm, Stream) override {
    return enqueue(comm);
  }
  Result broadcast(const void*, void*, std::size_t, at::ScalarType, int, Comm comm,
                   Stream) override {
    return enqueue(comm);
  }

 private:
  struct EventState {
    bool recorded = false;
    bool reached = false;
    int queries = 0;
  };
  struct CommState {
    bool aborted = false;
    bool initializing = false;
    int initPolls = 0;
    bool hangEnqueues = false;
    bool enqueuePending = false;
    bool finalizing = false;
    bool revoked = false;
    int pendingPolls = 0;  // setAsyncPendingPolls
    std::string asyncError;
  };

  static std::uintptr_t id(const void* h) { return reinterpret_cast<std::uintptr_t>(h); }
  static Stream& threadStream() {
    thread_local Stream stream = handle(kDefaultStream);
    return stream;
  }
  static int& threadDevice() {
    thread_local int device = 0;
    return device;
  }
  // Caller holds mutex_. `management`: a poll, an abort or a shrink, which a revoked
  // communicator takes.
  CommState& use(Comm comm, bool management = false) {
    auto& c = comms_[id(comm)];
    if (c.aborted || (c.revoked && !management)) ++counts_.callsAfterAbort;
    return c;
  }
  Result enqueue(Comm comm) {
    std::scoped_lock lock(mutex_);
    ++counts_.collectives;
    auto& c = use(comm);
    if (c.hangEnqueues) {
      c.enqueuePending = true;
      return Result::pending();
    }
    return Result::done();
  }

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::uintptr_t next_ = 1000;  // handles below are the tests' own streams
  Counts counts_;
  std::map<std::uintptr_t, EventState> events_;
  std::map<std::uintptr_t, CommState> comms_;
  std::set<std::uintptr_t> commStreams_;
  std::vector<std::pair<Stream, Event>> waits_;
  Event lastCommEvent_ = nullptr;
  bool autoReach_ = false;
  std::string failRecord_;
  int initPollCap_ = 0;
  std::string initFails_;
  bool finalizeHangs_ = false;
  bool enqueuePolled_ = false;
  bool canShrink_ = false;
  std::string revokeFails_;
  bool revokeHangs_ = false;
  std::string shrinkFails_;
  bool shrinkOutlives_ = false;
  std::vector<std::pair<Comm, std::vector<int>>> shrinkLog_;
  std::function<void(Stream, Event)> onWait_;
  std::function<void(Stream)> onSync_;
};

}  // namespace fsdp::testing
