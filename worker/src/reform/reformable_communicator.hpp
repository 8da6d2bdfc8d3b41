#pragma once
// The communicator a Runtime hands out (comm(), cpuComm()): a fixed object over the round's
// communicator, so that what holds a reference to it (FSDP, the Trainer, a program's own code)
// keeps it across an in-process re-formation, when the runtime puts the new round's
// communicator under it. Private to libfsdp.

#include <atomic>
#include <memory>
#include <mutex>

#include "comm/nccl/nccl_bootstrap.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker::detail {

class ReformableCommunicator final : public Communicator {
 public:
  explicit ReformableCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  c10::DeviceType deviceType() const override { return inner_->deviceType(); }
  const char* backendName() const override { return inner_->backendName(); }
  c10::Device device() const override { return inner_->device(); }
  Work allReduce(at::Tensor tensor, ReduceOp op) override { return inner_->allReduce(std::move(tensor), op); }
  Work allGather(at::Tensor input, at::Tensor output) override {
    return inner_->allGather(std::move(input), std::move(output));
  }
  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    return inner_->reduceScatter(std::move(input), std::move(output), op);
  }
  Work broadcast(at::Tensor tensor, int root) override { return inner_->broadcast(std::move(tensor), root); }
  Work barrier() override { return inner_->barrier(); }

  // From any thread (the control channel's): aborts the communicator of this round.
  bool abort(const std::string& why) override {
    std::scoped_lock lock(mutex_);
    aborted_ = true;
    return inner_->abort(why);
  }
  bool aborted() const override { return aborted_; }
  // From the training thread, with no operation of it in flight: the old communicator goes (its
  // threads joined), then `next` serves.
  void replace(std::unique_ptr<Communicator> next) {
    std::unique_ptr<Communicator> old;
    {
      std::scoped_lock lock(mutex_);
      old = std::move(inner_);
    }
    old.reset();
    std::scoped_lock lock(mutex_);
    inner_ = std::move(next);
    aborted_ = false;
  }
  // What the round's NCCL communicator keeps after its abort for the next round's shrink
  // (nccl_bootstrap.hpp); nullptr for any other. From the training thread, before release().
  std::unique_ptr<NcclParent> takeNcclParent() {
    std::scoped_lock lock(mutex_);
    return detail::takeNcclParent(*inner_);
  }
  // The old round's communicator destroyed before the new one is built (its shared memory, its
  // sockets, its threads go first). Operations fail until replace().
  void release() {
    std::unique_ptr<Communicator> old;
    {
      std::scoped_lock lock(mutex_);
      old = std::move(inner_);
      inner_ = std::make_unique<Released>(old->rank(), old->size(), old->deviceType(), old->device());
    }
  }

 private:
  // Between release() and replace(): refuses every operation with CommAborted.
  class Released final : public Communicator {
   public:
    Released(int rank, int size, c10::DeviceType type, c10::Device device)
        : rank_(rank), size_(size), type_(type), device_(device) {}
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    c10::DeviceType deviceType() const override { return type_; }
    const char* backendName() const override { return "released"; }
    c10::Device device() const override { return device_; }
    Work allReduce(at::Tensor, ReduceOp) override { refuse(); }
    Work allGather(at::Tensor, at::Tensor) override { refuse(); }
    Work reduceScatter(at::Tensor, at::Tensor, ReduceOp) override { refuse(); }
    Work broadcast(at::Tensor, int) override { refuse(); }
    Work barrier() override { refuse(); }
    bool abort(const std::string&) override { return true; }

   private:
    [[noreturn]] static void refuse();
    int rank_, size_;
    c10::DeviceType type_;
    c10::Device device_;
  };

  std::mutex mutex_;  // abort() against replace()/release(); operations run on the training thread
  std::unique_ptr<Communicator> inner_;
  std::atomic<bool> aborted_{false};  // abort() called; cleared by replace()
};

}  // namespace fsdp::worker::detail
