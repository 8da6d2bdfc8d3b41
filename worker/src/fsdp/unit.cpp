// fsdp::Unit: the module wrapper whose forward FSDP controls (gather before, reshard and hook
// after), and activation checkpointing of a unit with the RNG state of its first run.
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>

#include "state.hpp"

namespace fsdp::worker {

UnitImpl::UnitImpl(torch::nn::AnyModule module) : inner_(std::move(module)) {
  inner_ptr_ = register_module("module", inner_.ptr());
}

UnitImpl::UnitImpl(torch::nn::Sequential module) : sequential_(std::move(module)) {
  inner_ptr_ = register_module("module", sequential_.ptr());
}

UnitImpl::~UnitImpl() = default;

bool UnitImpl::enter() {
  if (state_ == nullptr) return false;
  state_->preForward(index_);
  return true;
}

torch::Tensor UnitImpl::leave(torch::Tensor output, bool active, const torch::Tensor& input) {
  if (!active) return output;
  return state_->postForward(index_, std::move(output), input);
}

void UnitImpl::leaveOpaque(bool active) {
  if (!active) return;
  state_->units_[static_cast<std::size_t>(index_)].keepUntilBackwardEnd = true;
  state_->postForward(index_, torch::Tensor(), torch::Tensor());
}

torch::Tensor UnitImpl::runInner(torch::Tensor input) {
  return sequential_ ? sequential_->forward(std::move(input)) : inner_.forward(std::move(input));
}

namespace detail {
namespace {

// The states of the generators a unit's forward draws from: the CPU one, and the current
// CUDA device's when the parameters live there. Each generator's mutex is held only while its
// state is read or written, never while the module runs (its kernels take the same mutex).
struct RngState {
  at::Tensor cpu;
  at::Tensor device;

  static at::Generator deviceGenerator(at::Device device) {
    return at::globalContext().defaultGenerator(device);
  }
  static RngState capture(at::Device device) {
    RngState s;
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::scoped_lock lock(gen.mutex());
      s.cpu = gen.get_state();
    }
    if (device.is_cuda()) {
      auto gen = deviceGenerator(device);
      std::scoped_lock lock(gen.mutex());
      s.device = gen.get_state();
    }
    return s;
  }
  void restore(at::Device device) const {
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::scoped_lock lock(gen.mutex());
      gen.set_state(cpu);
    }
    if (device.is_cuda() && this->device.defined()) {
      auto gen = deviceGenerator(device);
      std::scoped_lock lock(gen.mutex());
      gen.set_state(this->device);
    }
  }
};

// Activation checkpointing of one unit: forward without keeping activations, recompute
// during backward with the RNG states of the first run, so that dropout draws the same masks.
// The unit's parameters are unsharded by then: the pre-backward hook sits on this function's
// output.
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `anchor` is an empty tensor that requires grad: the output must require grad even when
  // the input does not (the unit's parameters are not inputs of this function).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor input,
                               torch::Tensor anchor, std::int64_t unitAddress) {
    (void)anchor;
    // The unit outlives the graph (the model outlives its backward); autograd's context holds
    // only IValues, so its address travels as an integer.
    auto& unit = *reinterpret_cast<UnitImpl*>(unitAddress);
    const at::Device device = FsdpState::deviceOf(unit);
    const RngState rng = RngState::capture(device);
    ctx->saved_data["unit"] = unitAddress;
    ctx->saved_data["rng_cpu"] = rng.cpu;
    if (rng.device.defined()) ctx->saved_data["rng_device"] = rng.device;
    ctx->saved_data["input_requires_grad"] = input.requires_grad();
    ctx->save_for_backward({input});
    return FsdpState::run(unit, input);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& unit = *reinterpret_cast<UnitImpl*>(ctx->saved_data["unit"].toInt());
    const at::Device device = FsdpState::deviceOf(unit);
    const bool inputGrad = ctx->saved_data["input_requires_grad"].toBool();
    at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(inputGrad);
    RngState first;
    first.cpu = ctx->saved_data["rng_cpu"].toTensor();
    if (ctx->saved_data.count("rng_device") != 0) first.device = ctx->saved_data["rng_device"].toTensor();
    at::Tensor output;
    {
      // The generators go on from where this backward found them, whatever the recompute does.
      struct Restore {
        RngState now;
        at::Device device;
        ~Restore() { now.restore(device); }
      } restore{RngState::capture(device), device};
      first.restore(device);
      // The recompute must not count as a second forward: BatchNorm's running statistics (and
      // any buffer a forward updates) are put back as the first run left them.
      std::vector<std::pair<at::Tensor, at::Tensor>> buffers;
      {
        at::NoGradGuard noGrad;
        for (auto& b : unit.buffers()) buffers.emplace_back(b, b.clone());
      }
      at::AutoGradMode enable(true);
      output = FsdpState::run(unit, input);
      // set_data, not copy_: the recomputed graph saved these buffers at their version.
      for (auto& [buffer, before] : buffers) buffer.set_data(before);
    }
    // A unit whose parameters are all frozen, on an input that needs no gradient: nothing to do.
    if (output.requires_grad()) torch::autograd::backward({output}, {grads[0]});
    FsdpState::recomputeDone(unit);
    return {inputGrad ? input.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace
}  // namespace detail

torch::Tensor UnitImpl::forward(torch::Tensor input) {
  const bool active = enter();
  torch::Tensor output;
  // Checkpointed: a leaf unit in training whose output will need a backward (a unit of frozen
  // parameters on an input that needs no gradient has nothing to recompute).
  const auto checkpointed = [&] {
    if (!active || index_ == 0 || !state_->options_.activationCheckpointing || !at::GradMode::is_enabled()) {
      return false;
    }
    const auto& unit = state_->units_[static_cast<std::size_t>(index_)];
    return !unit.hasChildUnits && (unit.expectedGrads > 0 || input.requires_grad());
  };
  if (checkpointed()) {
    state_->onCheckpointedCall(index_);
    output = detail::CheckpointFunction::apply(input, at::empty({0}).requires_grad_(),
                                               reinterpret_cast<std::int64_t>(this));
  } else {
    output = runInner(input);
  }
  return leave(std::move(output), active, input);
}

}  // namespace fsdp::worker
