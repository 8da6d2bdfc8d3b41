#include "fsdp/worker/gloo_communicator.hpp"

#include <ATen/Functions.h>
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <numeric>
#include <thread>

#include "fsdp/common/error.hpp"

namespace fsdp::worker {
namespace {

// Gloo's rendezvous store interface over our store client, under a key prefix.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(rendezvous::StoreClient& client, std::string prefix, std::chrono::milliseconds timeout)
      : client_(client), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    client_.set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string value = client_.get(prefix_ + key, timeout_);
    return {value.begin(), value.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> prefixed;
    prefixed.reserve(keys.size());
    for (const auto& key : keys) prefixed.push_back(prefix_ + key);
    client_.wait(prefixed, timeout);
  }

 private:
  rendezvous::StoreClient& client_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// Runs queued operations one at a time, in order, on one thread it owns. abort() settles every
// operation not finished yet with an error at once (their Works wake) even while one is stuck in
// Gloo; abandon() lets a stuck thread finish on its own and run a last function (the
// communicator's deletion) instead of being joined.
class TaskQueue {
 public:
  TaskQueue() : thread_([this] { run(); }) {}
  ~TaskQueue() {
    {
      std::scoped_lock lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    if (thread_.joinable()) thread_.join();
  }
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  Work push(std::function<void()> fn) {
    Task task{std::move(fn), std::make_shared<Outcome>()};
    Work work(task.outcome->promise.get_future().share());
    {
      std::scoped_lock lock(mutex_);
      if (failure_) {
        task.outcome->settle(failure_);
        return work;
      }
      tasks_.push_back(std::move(task));
    }
    ready_.notify_one();
    return work;
  }

  // Every operation queued or running fails with `error` now; later ones too.
  void abort(std::exception_ptr error) {
    std::deque<Task> dropped;
    std::shared_ptr<Outcome> current;
    {
      std::scoped_lock lock(mutex_);
      failure_ = error;
      dropped.swap(tasks_);
      current = running_;
    }
    if (current) current->settle(error);
    for (auto& task : dropped) task.outcome->settle(error);
  }

  // When an operation is running (stuck): the thread is let go, and runs `last` once it is done
  // (nothing of this queue may be touched after: `last` deletes it). False when idle.
  bool abandon(std::function<void()> last) {
    std::scoped_lock lock(mutex_);
    if (!running_) return false;
    last_ = std::move(last);
    stopping_ = true;
    thread_.detach();
    return true;
  }

 private:
  struct Outcome {
    std::promise<void> promise;
    std::atomic<bool> settled{false};
    void settle(std::exception_ptr error) {
      if (settled.exchange(true)) return;
      if (error) {
        promise.set_exception(error);
      } else {
        promise.set_value();
      }
    }
  };
  struct Task {
    std::function<void()> fn;
    std::shared_ptr<Outcome> outcome;
  };

  void run() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        // Pending operations are abandoned on shutdown: their Work reports broken_promise.
        if (stopping_) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
        running_ = task.outcome;
      }
      std::exception_ptr error;
      try {
        task.fn();
      } catch (...) {
        error = std::current_exception();
      }
      task.outcome->settle(error);
      std::function<void()> last;
      {
        std::scoped_lock lock(mutex_);
        running_.reset();
        last = std::move(last_);
      }
      if (last) {
        last();  // deletes this queue: nothing of it is touched after
        return;
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Task> tasks_;
  std::shared_ptr<Outcome> running_;
  std::exception_ptr failure_;
  std::function<void()> last_;
  bool stopping_ = false;
  std::thread thread_;
};

// Calls fn(T{}) with the C++ element type Gloo uses for `type`.
template <typename Fn>
void dispatchType(at::ScalarType type, Fn&& fn) {
  switch (type) {
    case at::kFloat: return fn(float{});
    case at::kDouble: return fn(double{});
    case at::kHalf: return fn(gloo::float16{});
    case at::kBFloat16: return fn(c10::BFloat16{});  // Gloo's templates reduce it via float
    case at::kInt: return fn(std::int32_t{});
    case at::kLong: return fn(std::int64_t{});
    case at::kByte: return fn(std::uint8_t{});
    case at::kChar: return fn(std::int8_t{});
    default:
      throw Error(std::string("Gloo communicator: dtype ") + c10::toString(type) +
                  " is not supported (float32, float64, float16, bfloat16, int8/32/64, uint8 are)");
  }
}

template <typename T>
gloo::AllreduceOptions::Func reduceFunc(ReduceOp op) {
  using Fn = void (*)(void*, const void*, const void*, size_t);
  switch (op) {
    case ReduceOp::kMin: return static_cast<Fn>(&gloo::min<T>);
    case ReduceOp::kMax: return static_cast<Fn>(&gloo::max<T>);
    case ReduceOp::kSum:
    case ReduceOp::kAverage: break;
  }
  return static_cast<Fn>(&gloo::sum<T>);
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context, GlooOptions options)
      : context_(std::move(context)), options_(std::move(options)) {}

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CPU; }
  const char* backendName() const override { return "Gloo"; }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    check(tensor, "allReduce");
    return queue_.push([this, tensor, op] {
      guard("allReduce", [&] {
        dispatchType(tensor.scalar_type(), [&](auto tag) {
          using T = decltype(tag);
          if (size() == 1 || tensor.numel() == 0) return;
          gloo::AllreduceOptions opts(context_);
          opts.setOutput(static_cast<T*>(tensor.data_ptr()), static_cast<size_t>(tensor.numel()));
          opts.setReduceFunction(reduceFunc<T>(op));
          opts.setTag(nextTag());
          opts.setTimeout(options_.timeout);
          gloo::allreduce(opts);
        });
        if (op == ReduceOp::kAverage && size() > 1) tensor.div_(size());
      });
    });
  }

  Work allGather(at::Tensor input, at::Tensor output) override {
    check(input, "allGather");
    check(output, "allGather");
    const auto counts = checkGatherSizes(input, output, rank(), size());
    return queue_.push([this, input, output, counts] {
      guard("allGather", [&] {
        if (output.numel() == 0) return;  // gloo::allgather divides by the element count
        if (size() == 1) {
          output.view({-1}).copy_(input.view({-1}));
          return;
        }
        dispatchType(input.scalar_type(), [&](auto tag) {
          using T = decltype(tag);
          const bool even = std::all_of(counts.begin(), counts.end(),
                                        [&](auto c) { return c == counts.front(); });
          if (even) {
            gloo::AllgatherOptions opts(context_);
            opts.setInput(static_cast<T*>(input.data_ptr()), static_cast<size_t>(input.numel()));
            opts.setOutput(static_cast<T*>(output.data_ptr()), static_cast<size_t>(output.numel()));
            opts.setTag(nextTag());
            opts.setTimeout(options_.timeout);
            gloo::allgather(opts);
          } else {
            gloo::AllgathervOptions opts(context_);
            opts.setInput(static_cast<T*>(input.data_ptr()), static_cast<size_t>(input.numel()));
            opts.setOutput(static_cast<T*>(output.data_ptr()),
                           std::vector<size_t>(counts.begin(), counts.end()));
            opts.setTag(nextTag());
            opts.setTimeout(options_.timeout);
            gloo::allgatherv(opts);
          }
        });
      });
    });
  }

  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    check(input, "reduceScatter");
    check(output, "reduceScatter");
    const auto counts = checkScatterSizes(input, output, rank(), size());
    return queue_.push([this, input, output, counts, op] {
      guard("reduceScatter", [&] {
        if (input.numel() == 0) return;
        if (size() == 1) {
          output.view({-1}).copy_(input.view({-1}));
          return;
        }
        ringReduceScatter(input.view({-1}), output.view({-1}), counts, op);
        if (op == ReduceOp::kAverage) output.div_(size());
      });
    });
  }

  Work broadcast(at::Tensor tensor, int root) override {
    check(tensor, "broadcast");
    if (root < 0 || root >= size()) {
      throw Error("broadcast: root " + std::to_string(root) + " is not a rank of 0.." +
                  std::to_string(size() - 1));
    }
    return queue_.push([this, tensor, root] {
      guard("broadcast", [&] {
        if (size() == 1 || tensor.numel() == 0) return;
        dispatchType(tensor.scalar_type(), [&](auto tag) {
          using T = decltype(tag);
          gloo::BroadcastOptions opts(context_);
          opts.setOutput(static_cast<T*>(tensor.data_ptr()), static_cast<size_t>(tensor.numel()));
          opts.setRoot(root);
          opts.setTag(nextTag());
          opts.setTimeout(options_.timeout);
          gloo::broadcast(opts);
        });
      });
    });
  }

  Work barrier() override {
    return queue_.push([this] {
      guard("barrier", [&] {
        if (size() == 1) return;
        gloo::BarrierOptions opts(context_);
        opts.setTag(nextTag());
        opts.setTimeout(options_.timeout);
        gloo::barrier(opts);
      });
    });
  }

 private:
  void check(const at::Tensor& t, const char* op) const {
    if (!t.defined()) throw Error(std::string(op) + ": undefined tensor");
    if (!t.device().is_cpu()) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() +
                  ", but the Gloo communicator takes CPU tensors (use NCCL for CUDA)");
    }
    if (!t.is_contiguous()) throw Error(std::string(op) + ": tensor must be contiguous");
    dispatchType(t.scalar_type(), [](auto) {});  // throws for dtypes Gloo cannot reduce
  }

 public:
  // Every operation not finished fails with CommAborted at once, as every later one (guard()).
  // One stuck in Gloo stays so until its peers close their pairs (their communicators go) or its
  // timeout: the communicator's deletion waits for it on that thread, not on the caller's.
  bool abort(const std::string& why) override {
    std::string message;
    {
      std::scoped_lock lock(abortMutex_);
      if (!abortReason_.empty()) return true;
      abortReason_ = why.empty() ? "aborted" : why;
      message = "gloo on rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                ": the communicator was aborted: " + abortReason_;
    }
    aborted_.store(true, std::memory_order_release);
    queue_.abort(std::make_exception_ptr(CommAborted(message)));
    return true;
  }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  TaskQueue& queue() { return queue_; }

 private:
  // Turns Gloo's exceptions into ours, naming the rank and the operation.
  template <typename Fn>
  void guard(const char* op, Fn&& fn) {
    const auto refuse = [&] {
      std::scoped_lock lock(abortMutex_);
      throw CommAborted("gloo " + std::string(op) + " on rank " + std::to_string(rank()) + " of " +
                        std::to_string(size()) + ": the communicator was aborted: " + abortReason_);
    };
    if (aborted_.load(std::memory_order_acquire)) refuse();
    try {
      fn();
    } catch (const gloo::Exception&) {
      if (aborted_.load(std::memory_order_acquire)) refuse();
      rethrow(op);
    }
  }
  // Called inside a handler: the exception being handled, as ours.
  [[noreturn]] void rethrow(const char* op) {
    try {
      throw;
    } catch (const gloo::IoException& e) {
      throw NetworkError("gloo " + std::string(op) + " failed on rank " + std::to_string(rank()) +
                             " of " + std::to_string(size()) + ": " + e.what(),
                         "gloo peers");
    } catch (const gloo::Exception& e) {
      throw Error("gloo " + std::string(op) + " failed on rank " + std::to_string(rank()) +
                  " of " + std::to_string(size()) + ": " + e.what());
    }
  }
  std::uint32_t nextTag() { return tag_++; }

  // Ring reduce-scatter on Gloo's transport. At step s rank r sends its running sum of chunk
  // (r-s-1) to the right and receives chunk (r-s-2) from the left, adding its own piece; after
  // n-1 steps the chunk it holds complete is chunk r. Every rank sends and receives (n-1)/n of
  // the buffer, once, with no scratch copy of the input: Gloo's ReduceScatterHalvingDoubling
  // allocates and registers a full-size buffer on every call, which made it slower than
  // PyTorch's all-reduce-then-slice at 16 MB (fsdp-bench collectives).
  void ringReduceScatter(const at::Tensor& input, const at::Tensor& output,
                         const std::vector<std::int64_t>& counts, ReduceOp op) {
    const int n = size();
    const int r = rank();
    const auto mod = [n](int v) { return ((v % n) + n) % n; };
    const auto offsets = chunkOffsets(counts);
    const auto chunk = [&](int j) { return input.narrow(0, offsets[j], counts[j]); };
    const std::size_t element = input.element_size();
    const std::uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, nextTag());
    // Two scratch chunks alternate between "being sent" and "being received" (n > 2 only).
    std::array<at::Tensor, 2> scratch;
    if (n > 2) {
      for (auto& t : scratch) t = at::empty({counts[0]}, input.options());
    }
    at::Tensor sending = chunk(mod(r - 1));
    for (int s = 0; s < n - 1; ++s) {
      const int recvIndex = mod(r - s - 2);
      const bool last = s == n - 2;
      at::Tensor receiving = last ? output : scratch[s % 2].narrow(0, 0, counts[recvIndex]);
      auto recvBuf = context_->createUnboundBuffer(receiving.data_ptr(), receiving.numel() * element);
      auto sendBuf = context_->createUnboundBuffer(sending.data_ptr(), sending.numel() * element);
      recvBuf->recv(mod(r - 1), slot + static_cast<std::uint64_t>(s));
      sendBuf->send(mod(r + 1), slot + static_cast<std::uint64_t>(s));
      sendBuf->waitSend(options_.timeout);
      recvBuf->waitRecv(options_.timeout);
      const at::Tensor mine = chunk(recvIndex);
      switch (op) {
        case ReduceOp::kMin: at::minimum_out(receiving, receiving, mine); break;
        case ReduceOp::kMax: at::maximum_out(receiving, receiving, mine); break;
        case ReduceOp::kSum:
        case ReduceOp::kAverage: receiving.add_(mine); break;
      }
      sending = receiving;
    }
  }
  static constexpr std::uint8_t kReduceScatterSlotPrefix = 0x21;  // clear of Gloo's own prefixes

  std::shared_ptr<gloo::rendezvous::Context> context_;
  GlooOptions options_;
  std::atomic<bool> aborted_{false};
  std::mutex abortMutex_;
  std::string abortReason_;  // under abortMutex_
  std::uint32_t tag_ = 1;  // touched only on the queue's thread
  TaskQueue queue_;        // last: joined before the context goes away
};

// What createGlooCommunicator hands out: the communicator, deleted when its owner lets go, or,
// after an abort with an operation stuck in Gloo, by its queue's thread once that ends.
class GlooHandle final : public Communicator {
 public:
  explicit GlooHandle(GlooCommunicator* impl) : impl_(impl) {}
  ~GlooHandle() override {
    GlooCommunicator* impl = impl_;
    if (impl->aborted() && impl->queue().abandon([impl] { delete impl; })) return;
    delete impl;
  }
  GlooHandle(const GlooHandle&) = delete;
  GlooHandle& operator=(const GlooHandle&) = delete;
  int rank() const override { return impl_->rank(); }
  int size() const override { return impl_->size(); }
  c10::DeviceType deviceType() const override { return impl_->deviceType(); }
  const char* backendName() const override { return impl_->backendName(); }
  Work allReduce(at::Tensor tensor, ReduceOp op) override { return impl_->allReduce(std::move(tensor), op); }
  Work allGather(at::Tensor input, at::Tensor output) override {
    return impl_->allGather(std::move(input), std::move(output));
  }
  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    return impl_->reduceScatter(std::move(input), std::move(output), op);
  }
  Work broadcast(at::Tensor tensor, int root) override { return impl_->broadcast(std::move(tensor), root); }
  Work barrier() override { return impl_->barrier(); }
  bool abort(const std::string& why) override { return impl_->abort(why); }

 private:
  GlooCommunicator* impl_;
};

}  // namespace

bool glooAvailable() { return true; }
const char* glooUnavailableReason() { return ""; }

std::unique_ptr<Communicator> createGlooCommunicator(rendezvous::StoreClient& store,
                                                     const GlooOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw ConfigError("Gloo communicator: rank " + std::to_string(options.rank) +
                      " is not in a world of size " + std::to_string(options.size));
  }
  auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
  context->setTimeout(options.timeout);
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.localAddress;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    GlooStore glooStore(store, options.storePrefix + "/", options.timeout);
    context->connectFullMesh(glooStore, device);
  } catch (const gloo::Exception& e) {
    throw NetworkError("Gloo communicator: rank " + std::to_string(options.rank) + " of " +
                           std::to_string(options.size) + " could not connect (store " +
                           store.endpoint() + ", local address " + options.localAddress +
                           "): " + e.what(),
                       store.endpoint());
  }
  return std::make_unique<GlooHandle>(new GlooCommunicator(std::move(context), options));
}

}  // namespace fsdp::worker
