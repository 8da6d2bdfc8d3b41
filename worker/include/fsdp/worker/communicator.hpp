#pragma once
// Collective communication over the ranks of one job. One small interface, two backends:
// Gloo (CPU tensors) and NCCL (CUDA tensors); fsdp::init() picks one (runtime.hpp).
//
// Every operation is asynchronous: it is queued in call order and returns a Work whose
// wait() blocks until it is done and rethrows its error. Tensors must stay alive and
// unchanged until then. Every rank must issue the same operations in the same order.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::worker {

enum class ReduceOp { kSum, kAverage, kMin, kMax };

// The handle of one queued operation.
class Work {
 public:
  explicit Work(std::shared_future<void> done) : done_(std::move(done)) {}
  // Device work (NCCL): `wait` orders the caller's stream after the operation and rethrows
  // its error; `ready` tells whether it has finished.
  Work(std::function<void()> wait, std::function<bool()> ready)
      : waitFn_(std::move(wait)), readyFn_(std::move(ready)) {}
  // Blocks until the operation finished; rethrows its error (fsdp::Error).
  void wait() const {
    if (waitFn_) return waitFn_();
    done_.get();
  }
  // Whether the host can wait on it from any thread (not device work).
  bool onHost() const { return !waitFn_; }
  bool ready() const {
    if (readyFn_) return readyFn_();
    return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

 private:
  std::shared_future<void> done_;
  std::function<void()> waitFn_;
  std::function<bool()> readyFn_;
};

// How `total` elements are split over `worldSize` ranks by allGather/reduceScatter: the
// first total % worldSize ranks get one element more. Returns the element count per rank.
std::vector<std::int64_t> chunkSizes(std::int64_t total, int worldSize);
// Where each rank's chunk starts: the running sum of `counts`.
std::vector<std::int64_t> chunkOffsets(const std::vector<std::int64_t>& counts);

// The checks every backend makes before anything is sent, each throwing fsdp::Error that names
// the operation: input and output of one dtype; allGather's input is this rank's chunk of the
// output; reduceScatter's output is this rank's chunk of the input. Return chunkSizes().
void checkSameType(const at::Tensor& a, const at::Tensor& b, const char* op);
std::vector<std::int64_t> checkGatherSizes(const at::Tensor& input, const at::Tensor& output, int rank, int size);
std::vector<std::int64_t> checkScatterSizes(const at::Tensor& input, const at::Tensor& output, int rank, int size);

// Runs `fn` now, on this thread; the Work is complete and carries its exception, if any. For
// backends whose operations run when issued (shared memory, hierarchical).
Work completedWork(const std::function<void()>& fn);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The device whose tensors this communicator takes, and its name for messages ("Gloo").
  virtual c10::DeviceType deviceType() const = 0;
  virtual const char* backendName() const = 0;
  // Where tensors of this communicator live (NCCL: this rank's CUDA device).
  virtual c10::Device device() const { return c10::Device(deviceType()); }

  // In place on `tensor` (contiguous).
  virtual Work allReduce(at::Tensor tensor, ReduceOp op = ReduceOp::kSum) = 0;
  // Gathers every rank's `input` into `output` (1-D view, rank order). output.numel() is the
  // sum over ranks; input.numel() must be this rank's chunkSizes(output.numel())[rank].
  virtual Work allGather(at::Tensor input, at::Tensor output) = 0;
  // Reduces `input` (same numel on every rank) element-wise over ranks and leaves this rank's
  // chunk (chunkSizes(input.numel())[rank] elements, in rank order) in `output`. `input`
  // is not modified.
  virtual Work reduceScatter(at::Tensor input, at::Tensor output,
                             ReduceOp op = ReduceOp::kSum) = 0;
  // Copies root's `tensor` into every rank's `tensor`.
  virtual Work broadcast(at::Tensor tensor, int root = 0) = 0;
  virtual Work barrier() = 0;

  // Wakes every operation of this rank blocked in the communicator, and fails every pending and
  // later one, with fsdp::CommAborted naming `why`; the communicator is of no further use (build
  // a new one). Shared memory: every rank of the group is woken (the group goes); Gloo: this
  // rank's pairs are closed; NCCL: ncclCommAbort, and the communication stream synchronised.
  // Returns false where the backend cannot abort (then only the process's end frees what is
  // blocked). Thread-safe: called from another thread than the one blocked.
  virtual bool abort(const std::string& why) {
    (void)why;
    return false;
  }
  // Whether abort() was called on this communicator (the runtime's comm() and cpuComm(): until
  // the next round's communicator replaces the aborted one). Cheap, from any thread: a long
  // computation between two collectives may ask it and end early (FSDP's gradient hooks do).
  virtual bool aborted() const { return false; }
};

}  // namespace fsdp::worker
