// CPU collectives staged through another device's communicator (staged_communicator.hpp).
#include "staged_communicator.hpp"

#include <ATen/Functions.h>

#include <functional>
#include <string>

#include "fsdp/common/error.hpp"

namespace fsdp::worker::detail {
namespace {

class StagedCommunicator final : public Communicator {
 public:
  explicit StagedCommunicator(std::unique_ptr<Communicator> device)
      : device_(std::move(device)), name_(std::string(device_->backendName()) + " (CPU tensors staged)") {}

  int rank() const override { return device_->rank(); }
  int size() const override { return device_->size(); }
  c10::DeviceType deviceType() const override { return c10::DeviceType::CPU; }
  const char* backendName() const override { return name_.c_str(); }
  bool abort(const std::string& why) override { return device_->abort(why); }

  Work allReduce(at::Tensor tensor, ReduceOp op) override {
    return inPlace(tensor, "allReduce", [&](at::Tensor& staged) { return device_->allReduce(staged, op); });
  }

  Work broadcast(at::Tensor tensor, int root) override {
    return inPlace(tensor, "broadcast", [&](at::Tensor& staged) { return device_->broadcast(staged, root); });
  }

  Work barrier() override {
    return completedWork([&] { device_->barrier().wait(); });
  }

  // Each rank's chunk padded to the largest (the first: chunkSizes), gathered, unpadded in order.
  Work allGather(at::Tensor input, at::Tensor output) override {
    checkCpu(input, "allGather");
    checkCpu(output, "allGather");
    checkContiguousOutput(output, "allGather");
    const auto counts = checkGatherSizes(input, output, rank(), size());
    return completedWork([&] {
      const std::int64_t c = counts.front();
      auto mine = at::zeros({c}, input.options().device(device_->device()));
      mine.narrow(0, 0, input.numel()).copy_(input.reshape({-1}));
      auto gathered = at::empty({c * size()}, mine.options());
      device_->allGather(mine, gathered).wait();
      const auto back = gathered.cpu();
      const auto offsets = chunkOffsets(counts);
      auto out = output.view({-1});
      for (int r = 0; r < size(); ++r) {
        const auto i = static_cast<std::size_t>(r);
        out.narrow(0, offsets[i], counts[i]).copy_(back.narrow(0, r * c, counts[i]));
      }
    });
  }

  // Every rank's chunk of the input padded to the largest, reduced, this rank's part kept.
  Work reduceScatter(at::Tensor input, at::Tensor output, ReduceOp op) override {
    checkCpu(input, "reduceScatter");
    checkCpu(output, "reduceScatter");
    checkContiguousOutput(output, "reduceScatter");
    const auto counts = checkScatterSizes(input, output, rank(), size());
    return completedWork([&] {
      const std::int64_t c = counts.front();
      const auto flat = input.reshape({-1});
      auto padded = at::zeros({c * size()}, flat.options());
      const auto offsets = chunkOffsets(counts);
      for (int r = 0; r < size(); ++r) {
        const auto i = static_cast<std::size_t>(r);
        padded.narrow(0, r * c, counts[i]).copy_(flat.narrow(0, offsets[i], counts[i]));
      }
      const auto staged = padded.to(device_->device());
      auto mine = at::empty({c}, staged.options());
      device_->reduceScatter(staged, mine, op).wait();
      output.view({-1}).copy_(mine.narrow(0, 0, output.numel()));
    });
  }

 private:
  // An in-place collective: `run` on a contiguous copy on the device (a new tensor even where the
  // device is the CPU), the caller's tensor written only once it is done.
  Work inPlace(at::Tensor& tensor, const char* op, const std::function<Work(at::Tensor&)>& run) {
    checkCpu(tensor, op);
    return completedWork([&] {
      auto staged = tensor.reshape({-1}).to(device_->device(), /*non_blocking=*/false, /*copy=*/true).contiguous();
      run(staged).wait();
      tensor.copy_(staged.view(tensor.sizes()));
    });
  }
  static void checkCpu(const at::Tensor& t, const char* op) {
    if (!t.defined()) throw Error(std::string(op) + ": undefined tensor");
    if (!t.device().is_cpu()) {
      throw Error(std::string(op) + ": tensor on " + t.device().str() +
                  ", but this communicator takes CPU tensors (it stages them through the device)");
    }
  }
  static void checkContiguousOutput(const at::Tensor& t, const char* op) {
    if (!t.is_contiguous()) throw Error(std::string(op) + ": the output must be contiguous");
  }

  std::unique_ptr<Communicator> device_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Communicator> makeStagedCommunicator(std::unique_ptr<Communicator> device) {
  if (device == nullptr) throw Error("makeStagedCommunicator: no communicator to stage through");
  return std::make_unique<StagedCommunicator>(std::move(device));
}

}  // namespace fsdp::worker::detail
