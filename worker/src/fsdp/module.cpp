// FullyShardedDataParallel's public face: wrapping, forward, no_sync, gradient clipping, the
// full parameters, what tests and checkpoints read about units and shards.
#include <ATen/Functions.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <unordered_set>

#include "builder.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/worker/flight_recorder.hpp"

namespace fsdp::worker {

namespace detail {
namespace {
// The process's count, as the flight recorder and the control channel are the process's.
std::atomic<int>& models() {
  static std::atomic<int> count{0};
  return count;
}
}  // namespace

int liveModels() { return models().load(); }
void countModel(int delta) { models() += delta; }
}  // namespace detail

FullyShardedDataParallelImpl::FullyShardedDataParallelImpl(std::shared_ptr<UnitImpl> root,
                                                           Communicator& comm,
                                                           FsdpOptions options)
    : state_(std::make_unique<detail::FsdpState>(comm, std::move(options))),
      rootUnit_(std::move(root)) {
  try {
    detail::FsdpBuilder(*state_, *rootUnit_).build();
  } catch (...) {
    for (auto& unit : state_->units_) unit.module->state_ = nullptr;
    throw;
  }
  for (const auto& unit : state_->units_) {
    for (const auto& flat : unit.flats) {
      std::string name = unit.path.empty() ? "flat_param" : unit.path + "_flat_param";
      std::replace(name.begin(), name.end(), '.', '_');
      if (!flat.requiresGrad) name += "_frozen";
      register_parameter(name, flat.shard, flat.requiresGrad);
    }
  }
  detail::countModel(+1);
}

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() {
  detail::countModel(-1);
  for (const auto& [node, key] : state_->hookKeys_) node->del_post_hook(key);
  for (auto& unit : state_->units_) unit.module->state_ = nullptr;
}

torch::Tensor FullyShardedDataParallelImpl::forward(torch::Tensor input) {
  if (state_->computeDtype_ != at::kFloat && at::isFloatingType(input.scalar_type())) {
    input = input.to(state_->computeDtype_);
  }
  return rootUnit_->forward(std::move(input));
}

void FullyShardedDataParallelImpl::train(bool on) {
  torch::nn::Module::train(on);
  rootUnit_->train(on);
}

void FullyShardedDataParallelImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::FullyShardedDataParallel(strategy=" << toString(state_->options_.strategy)
         << ", units=" << state_->units_.size() << ", shard_size=" << state_->shardSize_ << ")";
}

FullyShardedDataParallelImpl::NoSyncGuard::NoSyncGuard(detail::FsdpState& state)
    : state_(state), previous_(state.noSync_) {
  state_.noSync_ = true;
}
FullyShardedDataParallelImpl::NoSyncGuard::~NoSyncGuard() { state_.noSync_ = previous_; }

FullyShardedDataParallelImpl::NoSyncGuard FullyShardedDataParallelImpl::noSync() {
  return NoSyncGuard(*state_);
}

double FullyShardedDataParallelImpl::clipGradNorm(double maxNorm, double normType) {
  at::NoGradGuard noGrad;
  const bool inf = std::isinf(normType);
  if (!inf && normType != 2.0) {
    throw ConfigError("clipGradNorm: norm type " + std::to_string(normType) +
                      " is not supported (2 or infinity)");
  }
  std::vector<at::Tensor> grads;
  for (auto& unit : state_->units_) {
    for (auto& flat : unit.flats) {
      if (flat.shard.grad().defined()) grads.push_back(flat.shard.grad());
    }
  }
  double local = 0;
  for (const auto& g : grads) {
    local = inf ? std::max(local, g.abs().max().item<double>())
                : local + g.to(at::kDouble).pow(2).sum().item<double>();
  }
  // On the communicator's device (NCCL reduces CUDA tensors only).
  auto total = at::full({1}, local, at::TensorOptions().dtype(at::kDouble).device(state_->device_));
  if (state_->shardComm_ != nullptr) {
    const CommTag tag("clip_grad_norm");
    state_->shardComm_->allReduce(total, inf ? ReduceOp::kMax : ReduceOp::kSum).wait();
  }
  const double norm = inf ? total.item<double>() : std::sqrt(total.item<double>());
  const double coef = maxNorm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return norm;
}

namespace {
// The whole flat parameter (padding included), gathered from the shards when they are split.
at::Tensor gatherFlat(detail::FsdpState& state, const detail::FlatParam& flat) {
  if (state.shardComm_ == nullptr) return flat.shard.detach();
  at::Tensor full = at::empty({flat.paddedNumel},
                              flat.shard.options().device(state.device_).requires_grad(false));
  const CommTag tag("full_state_dict");
  state.shardComm_->allGather(flat.shard.detach().to(state.device_), full).wait();
  return full;
}
}  // namespace

void FullyShardedDataParallelImpl::visitFullParameters(
    const std::function<void(const std::string&, const at::Tensor&)>& sink) {
  at::NoGradGuard noGrad;
  for (auto& unit : state_->units_) {
    for (auto& flat : unit.flats) {
      const at::Tensor full = gatherFlat(*state_, flat);
      for (const auto& slot : flat.slots) {
        sink(slot.name, full.narrow(0, slot.offset, slot.numel).view(slot.shape));
      }
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallelImpl::fullParameters() {
  at::NoGradGuard noGrad;
  std::vector<std::pair<std::size_t, std::pair<std::string, at::Tensor>>> found;
  for (auto& unit : state_->units_) {
    for (auto& flat : unit.flats) {
      const at::Tensor full = gatherFlat(*state_, flat);
      for (const auto& slot : flat.slots) {
        found.push_back({slot.originalIndex,
                         {slot.name, full.narrow(0, slot.offset, slot.numel).view(slot.shape).clone()}});
      }
    }
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<std::string, at::Tensor>> result;
  result.reserve(found.size());
  for (auto& item : found) result.push_back(std::move(item.second));
  return result;
}

void FullyShardedDataParallelImpl::checkOptimizer(const torch::optim::Optimizer& optimizer) const {
  std::unordered_set<const c10::TensorImpl*> shards;
  for (const auto& unit : state_->units_) {
    for (const auto& flat : unit.flats) shards.insert(flat.shard.unsafeGetTensorImpl());
  }
  std::size_t foreign = 0;
  std::size_t total = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      ++total;
      if (shards.count(p.unsafeGetTensorImpl()) == 0) ++foreign;
    }
  }
  if (foreign > 0) {
    throw ConfigError("fsdp: the optimizer holds " + std::to_string(foreign) + " of " +
                      std::to_string(total) +
                      " tensors that are not this model's shards; it was built before wrapping "
                      "or from the original module. Build it from model->parameters() after "
                      "wrapping");
  }
}

std::vector<UnitInfo> FullyShardedDataParallelImpl::units() const {
  std::vector<UnitInfo> result;
  for (const auto& unit : state_->units_) {
    UnitInfo info;
    info.path = unit.path;
    info.unsharded = unit.state != detail::UnitState::kSharded;
    for (const auto& flat : unit.flats) {
      info.numel += flat.numel;
      info.shardNumel += flat.shardNumel;
      if (!flat.full.aliasing()) info.fullBytes += flat.full.bytes();
      if (flat.requiresGrad) info.trainableNumel += flat.numel;
      if (flat.fullGrad.defined()) info.gradBytes += flat.fullGrad.nbytes();
      if (flat.shard.grad().defined()) info.gradBytes += flat.shard.grad().nbytes();
    }
    info.gradReductions = unit.reductions;
    result.push_back(std::move(info));
  }
  return result;
}

ShardLayout FullyShardedDataParallelImpl::shardLayout() const {
  ShardLayout layout;
  layout.shardRank = state_->shardRank_;
  layout.shardSize = state_->shardSize_;
  // Replicas hold the same shards: across nodes (HYBRID_SHARD) or everywhere (NO_SHARD).
  if (state_->shardComm_ == nullptr) {
    layout.primaryReplica = state_->comm_.rank() == 0;
  } else if (state_->options_.strategy == ShardingStrategy::kHybridShard &&
             state_->options_.replicateGroup != nullptr) {
    layout.primaryReplica = state_->options_.replicateGroup->rank() == 0;
  }
  for (const auto& unit : state_->units_) {
    for (const auto& flat : unit.flats) {
      FlatParamInfo info;
      info.unit = unit.path;
      info.numel = flat.numel;
      info.shardNumel = flat.shardNumel;
      info.shardOffset = flat.shardNumel * state_->shardRank_;
      info.requiresGrad = flat.requiresGrad;
      info.shard = flat.shard;
      for (const auto& slot : flat.slots) {
        info.params.push_back({slot.name, slot.shape, slot.offset, slot.numel});
      }
      layout.flats.push_back(std::move(info));
    }
  }
  return layout;
}

const FsdpOptions& FullyShardedDataParallelImpl::options() const { return state_->options_; }

const std::vector<std::pair<std::string, at::Tensor>>& FullyShardedDataParallelImpl::namedBuffers() const {
  return state_->buffers_;
}

std::shared_ptr<torch::nn::Module> FullyShardedDataParallelImpl::module() const {
  return rootUnit_->inner();
}

}  // namespace fsdp::worker
