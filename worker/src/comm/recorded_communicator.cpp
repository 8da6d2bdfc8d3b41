// The communicator wrapper that records each collective in the flight recorder: issued when
// called, started when the backend begins it, completed when it is done (recorded_communicator.hpp).
//
// Backends that run an operation when it is issued (shared memory, hierarchical) return a Work
// that is already done. Gloo queues operations and runs them in order on its own thread; a
// watcher thread here waits on them in that order, so each starts when the one before it
// completed and completes when its Work does, whether or not the program waits on it yet.
// Device work (NCCL) completes when its ready() says so: polled by the same watcher, and by the
// program's own ready()/wait().
#include "comm/recorded_communicator.hpp"

#include <condition_variable>
#include <chrono>
#include <deque>
#include <thread>

namespace fsdp::worker::detail {
namespace {

class RecordedCommunicator final : public Communicator {
 public:
  RecordedCommunicator(std::unique_ptr<Communicator> inner, std::string group)
      : inner_(std::move(inner)), group_(std::move(group)), recorder_(FlightRecorder::process()) {}

  ~RecordedCommunicator() override {
    // The backend goes first: its pending operations end (abandoned), so the watcher's waits end.
    inner_.reset();
    {
      std::scoped_lock lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (watcher_.joinable()) watcher_.join();
    // What the backend abandoned never completes (its record says so), and is no longer in
    // flight for the step split, which would count every later step as waiting.
    for (const auto& [index, work] : pending_) recorder_.abandon(index);
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  c10::DeviceType deviceType() const override { return inner_->deviceType(); }
  const char* backendName() const override { return inner_->backendName(); }
  c10::Device device() const override { return inner_->device(); }
  bool abort(const std::string& why) override { return inner_->abort(why); }
  Communicator& inner() { return *inner_; }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    return record(flight::Op::kAllReduce, tensor, [&] { return inner_->allReduce(tensor, op); });
  }
  Work allGather(at::Tensor input, at::Tensor output) override {
    return record(flight::Op::kAllGather, output, [&] { return inner_->allGather(input, output); });
  }
  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    return record(flight::Op::kReduceScatter, input, [&] { return inner_->reduceScatter(input, output, op); });
  }
  Work broadcast(at::Tensor tensor, int root) override {
    return record(flight::Op::kBroadcast, tensor, [&] { return inner_->broadcast(tensor, root); });
  }
  Work barrier() override {
    return record(flight::Op::kBarrier, at::Tensor(), [&] { return inner_->barrier(); });
  }

 private:
  template <typename Fn>
  Work record(flight::Op op, const at::Tensor& sized, Fn&& issueFn) {
    const bool defined = sized.defined();
    std::uint64_t index = 0;
    {
      // Started now when nothing of this group is still queued before it.
      std::scoped_lock lock(mutex_);
      index = recorder_.issue({.group = group_,
                               .groupSize = inner_->size(),
                               .groupRank = inner_->rank(),
                               .seq = ++seq_,
                               .op = op,
                               .count = defined ? sized.numel() : 0,
                               .dtype = defined ? c10::toString(sized.scalar_type()) : "",
                               .tag = currentCommTag()},
                              pending_.empty());
    }
    if (defined) recorder_.addBytes(static_cast<std::int64_t>(sized.numel()) * static_cast<std::int64_t>(sized.element_size()));
    Work work = [&] {
      try {
        return issueFn();
      } catch (...) {
        recorder_.complete(index, false);
        throw;
      }
    }();
    if (work.onHost()) {
      if (!work.ready()) {
        watch(index, work);
        return work;
      }
      try {
        work.wait();
        recorder_.complete(index, true);
      } catch (...) {
        recorder_.complete(index, false);
      }
      return work;
    }
    // Device work: wait() only orders the caller's stream after it; done is what ready() says.
    watch(index, work);
    FlightRecorder* recorder = &recorder_;
    return Work(
        [work, recorder, index] {
          try {
            work.wait();
          } catch (...) {
            recorder->complete(index, false);
            throw;
          }
          if (work.ready()) recorder->complete(index, true);
        },
        [work, recorder, index] {
          const bool done = work.ready();
          if (done) recorder->complete(index, true);
          return done;
        });
  }

  void watch(std::uint64_t index, const Work& work) {
    {
      std::scoped_lock lock(mutex_);
      pending_.push_back({index, work});
      if (!watcher_.joinable()) watcher_ = std::thread([this] { watchLoop(); });
    }
    wake_.notify_one();
  }

  void watchLoop() {
    for (;;) {
      std::pair<std::uint64_t, Work> next{0, Work(std::shared_future<void>())};
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
        if (pending_.empty()) return;  // stopping, nothing left
        next = pending_.front();
      }
      recorder_.start(next.first);
      bool ok = true;
      if (next.second.onHost()) {
        try {
          next.second.wait();
        } catch (...) {
          ok = false;
        }
      } else {
        // A device operation has no host event to block on: its ready() is polled (a flag
        // under a mutex, set by the backend's own poller), backing off to 1 ms.
        auto pause = std::chrono::microseconds(50);
        while (!next.second.ready()) {
          {
            std::unique_lock lock(mutex_);
            if (wake_.wait_for(lock, pause, [this] { return stopping_; })) return;
          }
          pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
        }
      }
      recorder_.complete(next.first, ok);
      std::scoped_lock lock(mutex_);
      pending_.pop_front();
    }
  }

  std::unique_ptr<Communicator> inner_;
  const std::string group_;
  FlightRecorder& recorder_;
  std::uint64_t seq_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<std::uint64_t, Work>> pending_;  // host work not done yet, in issue order
  bool stopping_ = false;
  std::thread watcher_;
};

}  // namespace

Communicator& unrecorded(Communicator& comm) {
  auto* recorded = dynamic_cast<RecordedCommunicator*>(&comm);
  return recorded != nullptr ? recorded->inner() : comm;
}

std::unique_ptr<Communicator> recordCollectives(std::unique_ptr<Communicator> inner, std::string group) {
  if (!inner || !FlightRecorder::process().enabled()) return inner;
  return std::make_unique<RecordedCommunicator>(std::move(inner), std::move(group));
}

}  // namespace fsdp::worker::detail
