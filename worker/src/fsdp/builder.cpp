// Wrapping a model, done once: the shard groups, the checks that every rank has the same
// model on a device the communicator serves, unit discovery, flattening into sharded flat
// parameters and the gradient hooks (auto-wrap itself is in auto_wrap.cpp).
#include "builder.hpp"

#include <ATen/Functions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/flight_recorder.hpp"
#include "fsdp/common/sha256.hpp"

namespace fsdp::worker::detail {
namespace {

class GradientHook : public torch::autograd::FunctionPostHook {
 public:
  GradientHook(FsdpState& state, int unit, int flat, int slot)
      : state_(state), unit_(unit), flat_(flat), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    state_.onGradient(unit_, flat_, slot_);
    return outputs;
  }

 private:
  FsdpState& state_;
  int unit_, flat_, slot_;
};

std::string shapeText(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

}  // namespace

std::string joinPath(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

std::string shortTypeName(std::string name) {
  if (const auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.ends_with("Impl")) name.resize(name.size() - 4);
  return name;
}

void FsdpBuilder::build() {
  const auto& options = state_.options_;
  if (std::dynamic_pointer_cast<FullyShardedDataParallelImpl>(root_.inner_ptr_)) {
    throw ConfigError(
        "fsdp: the module is already a FullyShardedDataParallel; a module is wrapped once");
  }
  if (options.limitAllGathers < 1) {
    throw ConfigError("fsdp: limitAllGathers " + std::to_string(options.limitAllGathers) +
                      ": expected >= 1");
  }
  chooseGroups();
  recordOriginalOrder();
  checkParameters();
  checkSameModelEverywhere();
  if (options.syncModuleStates) syncModuleStates();
  if (options.autoWrap) autoWrap();
  discover();
  for (std::size_t u = 0; u < state_.units_.size(); ++u) flatten(static_cast<int>(u));
  if (options.mixedPrecision.bufferDtype) {
    at::NoGradGuard noGrad;
    for (auto& buffer : root_.inner_ptr_->buffers()) {
      if (at::isFloatingType(buffer.scalar_type())) {
        buffer.set_data(buffer.to(*options.mixedPrecision.bufferDtype));
      }
    }
  }
}

void FsdpBuilder::chooseGroups() {
  auto& comm = state_.comm_;
  const auto& options = state_.options_;
  state_.computeDtype_ = options.mixedPrecision.paramDtype.value_or(at::kFloat);
  state_.reduceDtype_ = options.mixedPrecision.reduceDtype.value_or(state_.computeDtype_);
  switch (options.strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      if (comm.size() > 1) state_.shardComm_ = &comm;
      state_.shardSize_ = comm.size();
      state_.shardRank_ = comm.rank();
      break;
    case ShardingStrategy::kNoShard:
      if (comm.size() > 1) state_.gradSyncComm_ = &comm;
      break;
    case ShardingStrategy::kHybridShard: {
      if (options.shardGroup == nullptr || options.replicateGroup == nullptr) {
        throw ConfigError(
            "fsdp: HYBRID_SHARD needs FsdpOptions::shardGroup and replicateGroup "
            "(fsdp::makeHybridGroups builds both)");
      }
      if (options.shardGroup->size() * options.replicateGroup->size() != comm.size()) {
        throw ConfigError("fsdp: HYBRID_SHARD groups of " +
                          std::to_string(options.shardGroup->size()) + " x " +
                          std::to_string(options.replicateGroup->size()) +
                          " ranks do not make the world of " + std::to_string(comm.size()));
      }
      if (options.shardGroup->size() > 1) state_.shardComm_ = options.shardGroup;
      if (options.replicateGroup->size() > 1) state_.gradSyncComm_ = options.replicateGroup;
      state_.shardSize_ = options.shardGroup->size();
      state_.shardRank_ = options.shardGroup->rank();
      break;
    }
  }
}

void FsdpBuilder::recordOriginalOrder() {
  for (const auto& item : root_.inner_ptr_->named_parameters(/*recurse=*/true)) {
    const auto* impl = item.value().unsafeGetTensorImpl();
    if (originalIndex_.count(impl) != 0) continue;
    originalIndex_.emplace(impl, originalNames_.size());
    originalNames_.push_back(item.key());
    originals_.push_back(item.value());
  }
  // The buffers under the same names (every name of a shared one, as a state_dict has them):
  // auto-wrap's units add a level ("module") to the module's own paths.
  for (const auto& item : root_.inner_ptr_->named_buffers(/*recurse=*/true)) {
    state_.buffers_.emplace_back(item.key(), item.value());
  }
}

void FsdpBuilder::checkParameters() {
  const auto& comm = state_.comm_;
  for (std::size_t i = 0; i < originals_.size(); ++i) {
    const auto& p = originals_[i];
    if (managedByFsdp(p)) {
      throw ConfigError("fsdp: parameter '" + originalNames_[i] +
                        "' already belongs to a FullyShardedDataParallel; a module is "
                        "wrapped once");
    }
    if (p.device().type() != comm.deviceType()) {
      throw ConfigError("fsdp: parameter '" + originalNames_[i] + "' is on " + p.device().str() +
                        ", but the " + comm.backendName() + " communicator takes " +
                        c10::DeviceTypeName(comm.deviceType(), /*lower_case=*/true) +
                        " tensors" +
                        (comm.deviceType() == c10::DeviceType::CPU
                             ? " (use the NCCL communicator for CUDA tensors)"
                             : ""));
    }
    if (!at::isFloatingType(p.scalar_type())) {
      throw ConfigError("fsdp: parameter '" + originalNames_[i] + "' is " +
                        c10::toString(p.scalar_type()) + "; FSDP shards floating-point parameters");
    }
  }
}

// Shapes, dtypes and names must agree on every rank; a digest of them is all-gathered.
void FsdpBuilder::checkSameModelEverywhere() {
  auto& comm = state_.comm_;
  Sha256 digest;
  std::int64_t numel = 0;
  for (std::size_t i = 0; i < originals_.size(); ++i) {
    const auto& p = originals_[i];
    digest.update(originalNames_[i] + ":" + shapeText(p.sizes()) + ":" +
                  c10::toString(p.scalar_type()) + (p.requires_grad() ? ":g;" : ":f;"));
    numel += p.numel();
  }
  const auto bytes = digest.digest();
  constexpr int kWords = 4;
  auto mine = at::empty({kWords}, at::kLong);
  std::memcpy(mine.data_ptr(), bytes.data(), 16);
  mine[2] = static_cast<std::int64_t>(originals_.size());
  mine[3] = numel;
  state_.constructionDigest_ = mine;
  joinsSurvivors_ = compareModelDigests(comm, mine, CheckedBy::kConstructor);
}

bool compareModelDigests(Communicator& comm, const at::Tensor& mine, CheckedBy by) {
  const bool survivor = by == CheckedBy::kSurvivor;
  constexpr int kWords = 4;  // compared; a fifth: this rank is a survivor
  if (comm.size() == 1) return survivor;
  // On the communicator's device (NCCL takes CUDA tensors only), read back on the host.
  auto sent = at::cat({mine, at::full({1}, survivor ? 1 : 0, mine.options())}).to(comm.device());
  auto all = at::empty({(kWords + 1) * comm.size()}, sent.options());
  const CommTag tag("init", "shard layout");
  comm.allGather(sent, all).wait();
  all = all.to(at::kCPU);
  const auto* words = all.data_ptr<std::int64_t>();
  bool survivors = false;
  for (int r = 0; r < comm.size(); ++r) {
    survivors = survivors || words[r * (kWords + 1) + kWords] != 0;
  }
  for (int r = 1; r < comm.size(); ++r) {
    const auto* theirs = words + static_cast<std::ptrdiff_t>(r) * (kWords + 1);
    if (!std::equal(theirs, theirs + kWords, words)) {
      throw ConfigError("fsdp: rank " + std::to_string(r) + "'s model differs from rank 0's (" +
                        std::to_string(theirs[2]) + " parameters, " + std::to_string(theirs[3]) +
                        " elements vs " + std::to_string(words[2]) + ", " +
                        std::to_string(words[3]) +
                        "); every rank must build the same model (names, shapes, dtypes)");
    }
  }
  return survivors;
}

void FsdpBuilder::syncModuleStates() {
  auto& comm = state_.comm_;
  if (comm.size() == 1) return;
  // A new process of a round in which survivors re-form in process: the round's restore writes
  // every parameter and buffer (or the round ends and every process starts again), so rank 0's
  // weights would only be overwritten. The whole model's size not copied twice is most of what
  // a re-formation costs (DeepNet, 376 MB: 60-160 ms of a 2-core host's re-formation).
  if (joinsSurvivors_) {
    log::debug("rank {}: survivors of an earlier round re-form with this process: rank 0's "
               "weights are not broadcast (the restore writes them)",
               comm.rank());
    return;
  }
  at::NoGradGuard noGrad;
  std::vector<at::Tensor> tensors = originals_;
  for (const auto& b : root_.inner_ptr_->buffers()) tensors.push_back(b);
  for (auto& t : tensors) {
    if (t.is_contiguous()) {
      comm.broadcast(t, 0).wait();
    } else {
      auto copy = t.contiguous();
      comm.broadcast(copy, 0).wait();
      t.copy_(copy);
    }
  }
}

void FsdpBuilder::discover() {
  addUnit(root_, "");
  discover(*root_.inner_ptr_, 0, "");
}

int FsdpBuilder::addUnit(UnitImpl& module, const std::string& path) {
  if (module.state_ != nullptr) {
    throw ConfigError("fsdp: unit '" + path + "' already belongs to a FullyShardedDataParallel");
  }
  UnitRecord record;
  record.path = path;
  record.module = &module;
  state_.units_.push_back(std::move(record));
  module.state_ = &state_;
  module.index_ = static_cast<int>(state_.units_.size()) - 1;
  slotsByUnit_.emplace_back();
  return module.index_;
}

void FsdpBuilder::discover(torch::nn::Module& module, int owner, const std::string& prefix) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    assign(owner, joinPath(prefix, item.key()), item.value());
  }
  for (const auto& child : module.named_children()) {
    const std::string path = joinPath(prefix, child.key());
    if (auto* unit = dynamic_cast<UnitImpl*>(child.value().get())) {
      state_.units_[static_cast<std::size_t>(owner)].hasChildUnits = true;
      if (unit->state_ == &state_) continue;  // one module used twice: one unit
      const int index = addUnit(*unit, path);
      state_.units_[static_cast<std::size_t>(index)].parent = owner;
      discover(*unit->inner_ptr_, index, innerPrefix(*unit, path));
    } else {
      discover(*child.value(), owner, path);
    }
  }
}

void FsdpBuilder::assign(int owner, const std::string& path, const at::Tensor& param) {
  const auto* impl = param.unsafeGetTensorImpl();
  if (const auto it = owner_.find(impl); it != owner_.end()) {
    if (it->second != owner) {
      throw ConfigError("fsdp: parameter '" + path + "' is shared between units '" +
                        state_.units_[static_cast<std::size_t>(it->second)].path + "' and '" +
                        state_.units_[static_cast<std::size_t>(owner)].path +
                        "'; put the modules that share it in one unit");
    }
    return;  // tied within one unit: flattened once
  }
  owner_.emplace(impl, owner);
  ParamSlot slot;
  slot.param = param;
  const auto original = originalIndex_.find(impl);
  slot.originalIndex = original->second;
  slot.name = originalNames_[original->second];
  slot.numel = param.numel();
  slot.shape = param.sizes().vec();
  slotsByUnit_[static_cast<std::size_t>(owner)].push_back(std::move(slot));
}

void FsdpBuilder::flatten(int u) {
  auto& unit = state_.units_[static_cast<std::size_t>(u)];
  auto& slots = slotsByUnit_[static_cast<std::size_t>(u)];
  for (const bool trainable : {true, false}) {
    FlatParam flat;
    flat.requiresGrad = trainable;
    for (auto& slot : slots) {
      if (slot.param.requires_grad() == trainable) flat.slots.push_back(slot);
    }
    if (flat.slots.empty()) continue;
    buildFlat(unit, flat);
    unit.flats.push_back(std::move(flat));
  }
  registerHooks(u);
  unit.hasFrozen = std::any_of(unit.flats.begin(), unit.flats.end(), [](const FlatParam& f) {
    return !f.requiresGrad && !f.full.aliasing();
  });
  const bool aliasing = std::all_of(unit.flats.begin(), unit.flats.end(),
                                    [](const FlatParam& f) { return f.full.aliasing(); });
  unit.state = aliasing ? UnitState::kUnsharded : UnitState::kSharded;
}

void FsdpBuilder::buildFlat(UnitRecord& unit, FlatParam& flat) {
  at::NoGradGuard noGrad;
  const auto dtype = flat.slots.front().param.scalar_type();
  const auto device = flat.slots.front().param.device();
  state_.device_ = device;
  state_.offload_ = state_.options_.cpuOffload && device.is_cuda();
  std::vector<at::Tensor> pieces;
  for (auto& slot : flat.slots) {
    if (slot.param.scalar_type() != dtype) {
      throw ConfigError("fsdp: unit '" + unit.path + "' mixes parameter dtypes (" + slot.name +
                        " is " + c10::toString(slot.param.scalar_type()) + ", " +
                        flat.slots.front().name + " is " + c10::toString(dtype) + ")");
    }
    slot.offset = flat.numel;
    flat.numel += slot.numel;
    pieces.push_back(slot.param.detach().reshape({-1}));
  }
  const std::int64_t world = state_.shardSize_;
  flat.paddedNumel = (flat.numel + world - 1) / world * world;
  flat.shardNumel = flat.paddedNumel / world;
  if (flat.paddedNumel > flat.numel) {
    pieces.push_back(at::zeros({flat.paddedNumel - flat.numel}, pieces.front().options()));
  }
  if (world == 1 && state_.computeDtype_ == dtype && !state_.offload_) {
    flat.full = FullBuffer::permanent(at::cat(pieces));
    flat.shard = flat.full.flat();
  } else {
    flat.full = FullBuffer(flat.paddedNumel, state_.computeDtype_, device);
    flat.full.allocate();  // views are made over allocated memory (set_ checks the size)
    if (joinsSurvivors_) {
      // A new process of a round with survivors: the restore writes every shard (or the round
      // ends), so the model's own values are not laid out; the shard's memory is not even
      // touched where the restore maps it (DeepNet: 376 + 188 MB not copied, 50-100 ms of the
      // survivors' wait on a 2-core host). The block is touched first by the first gather
      // (a --standby spare faulted it in while it waited).
      flat.shard = at::empty({flat.shardNumel}, pieces.front().options());
    } else {
      // Flattened straight into the full buffer when it has the parameters' dtype: the block,
      // written here, goes back to the block cache and the first gather reuses it instead of
      // touching fresh memory (on a VM whose host backs guest pages lazily, ~2 ms per MB).
      at::Tensor full = flat.full.flat();
      const at::Tensor values = state_.computeDtype_ == dtype && !state_.offload_
                                    ? at::cat_out(full, pieces)
                                    : at::cat(pieces);
      flat.shard = values.narrow(0, flat.shardNumel * state_.shardRank_, flat.shardNumel).clone();
    }
    if (state_.offload_) flat.shard = flat.shard.to(at::kCPU).pin_memory();
  }
  for (auto& slot : flat.slots) slot.param.set_data(flat.full.view(slot.offset, slot.shape));
  flat.full.free();
  flat.shard.set_requires_grad(flat.requiresGrad);
}

void FsdpBuilder::registerHooks(int u) {
  auto& unit = state_.units_[static_cast<std::size_t>(u)];
  for (std::size_t f = 0; f < unit.flats.size(); ++f) {
    auto& flat = unit.flats[f];
    if (!flat.requiresGrad) continue;
    for (std::size_t s = 0; s < flat.slots.size(); ++s) {
      auto& slot = flat.slots[s];
      slot.accumulator = torch::autograd::impl::grad_accumulator(slot.param);
      const auto key = slot.accumulator->add_post_hook(std::make_unique<GradientHook>(
          state_, u, static_cast<int>(f), static_cast<int>(s)));
      state_.hookKeys_.emplace_back(slot.accumulator.get(), key);
      ++unit.expectedGrads;
    }
  }
}

}  // namespace fsdp::worker::detail
