#include "fsdp/worker/fsdp.hpp"

#include <ATen/Functions.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cmath>
#include <limits>
#include <deque>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "fsdp/common/error.hpp"
#include "fsdp/common/sha256.hpp"
#include "fsdp/worker/gloo_communicator.hpp"
#include "fsdp/worker/runtime.hpp"

namespace fsdp::worker {

// ---------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------

ShardingStrategy parseShardingStrategy(const std::string& text) {
  if (text == "FULL_SHARD") return ShardingStrategy::kFullShard;
  if (text == "SHARD_GRAD_OP") return ShardingStrategy::kShardGradOp;
  if (text == "NO_SHARD") return ShardingStrategy::kNoShard;
  if (text == "HYBRID_SHARD") return ShardingStrategy::kHybridShard;
  throw ConfigError("--sharding '" + text +
                    "': expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD");
}

const char* toString(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "?";
}

MixedPrecision MixedPrecision::parse(const std::string& text) {
  if (text == "no" || text.empty()) return {};
  if (text == "bf16") return {at::kBFloat16, at::kBFloat16, at::kBFloat16};
  if (text == "fp16") return {at::kHalf, at::kHalf, at::kHalf};
  throw ConfigError("--mixed_precision '" + text + "': expected no, bf16 or fp16");
}

AutoWrapPolicy AutoWrapPolicy::minParams(std::int64_t minNumParams) {
  return {[minNumParams](const torch::nn::Module&, const std::string&, std::int64_t numParams) {
    return numParams >= minNumParams;
  }};
}

namespace {
// "fsdp::examples::BlockImpl" -> "Block".
std::string shortTypeName(std::string name) {
  if (const auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.ends_with("Impl")) name.resize(name.size() - 4);
  return name;
}
}  // namespace

AutoWrapPolicy AutoWrapPolicy::byTypeName(std::vector<std::string> typeNames) {
  for (auto& name : typeNames) name = shortTypeName(name);
  return {[names = std::move(typeNames)](const torch::nn::Module& module, const std::string&,
                                         std::int64_t) {
    return std::find(names.begin(), names.end(), shortTypeName(module.name())) != names.end();
  }};
}

namespace detail {
namespace {

// Full parameters and gradients are large and short-lived: allocated and freed once or twice
// per unit per step. Big CPU blocks are mapped directly with transparent huge pages
// advised, so that refilling a unit does not pay ~250k page faults per GB (measured: the
// system time of a FULL_SHARD DeepNet step was as large as its user time before).
constexpr std::size_t kMapThreshold = std::size_t{1} << 20;
constexpr std::size_t kMapHeader = 64;  // keeps the block's size; data stays 64-byte aligned

void freeMapped(void* base) {
  std::size_t length = 0;
  std::memcpy(&length, base, sizeof length);
  ::munmap(base, length);
}

at::DataPtr mapBlock(std::size_t nbytes, at::Device device) {
  const std::size_t length = nbytes + kMapHeader;
  void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    throw Error("fsdp: cannot map " + std::to_string(nbytes) + " bytes for full parameters: " +
                std::strerror(errno));
  }
  ::madvise(base, length, MADV_HUGEPAGE);  // advice only: ignored where THP is off
  std::memcpy(base, &length, sizeof length);
  return at::DataPtr(static_cast<char*>(base) + kMapHeader, base, &freeMapped, device);
}

// The deleters of full-parameter memory. Besides freeing, they mark a storage as managed by
// FSDP: a second wrap of the same parameters is recognised by them, with no global registry.
void freeCpuFull(void* ptr) { c10::GetAllocator(c10::DeviceType::CPU)->raw_deallocate(ptr); }
void freeCudaFull(void* ptr) { c10::GetAllocator(c10::DeviceType::CUDA)->raw_deallocate(ptr); }

bool managedByFsdp(const at::Tensor& tensor) {
  if (!tensor.has_storage()) return false;
  const auto deleter = tensor.storage().data_ptr().get_deleter();
  return deleter == &freeCpuFull || deleter == &freeCudaFull || deleter == &freeMapped;
}

at::DataPtr allocateBlock(std::size_t nbytes, at::Device device) {
  if (device.is_cpu() && nbytes >= kMapThreshold) return mapBlock(nbytes, device);
  void* ptr = c10::GetAllocator(device.type())->raw_allocate(nbytes);
  return at::DataPtr(ptr, ptr, device.is_cuda() ? &freeCudaFull : &freeCpuFull, device);
}

// A 1-D tensor of `numel` elements over a fresh block (uninitialised).
at::Tensor emptyBlock(std::int64_t numel, const at::TensorOptions& options) {
  const std::size_t nbytes = static_cast<std::size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, allocateBlock(nbytes, options.device()),
                       nullptr, /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

// The memory every original parameter of one flat parameter points into. Freeing and
// refilling keep the same StorageImpl, which autograd's saved tensors still reference.
class FullBuffer {
 public:
  FullBuffer() = default;
  FullBuffer(std::int64_t numel, at::ScalarType dtype, at::Device device)
      : numel_(numel), dtype_(dtype), device_(device) {
    storage_ = c10::Storage(c10::Storage::use_byte_size_t(), 0, emptyPtr(),
                            c10::GetAllocator(device.type()), /*resizable=*/false);
  }
  // A buffer that is never freed and holds `values` (NO_SHARD, or one rank, without mixed
  // precision: the full parameter is the shard). Allocated here so that it carries the mark.
  static FullBuffer permanent(const at::Tensor& values) {
    FullBuffer b(values.numel(), values.scalar_type(), values.device());
    b.allocate();
    b.flat().copy_(values);
    b.alias_ = true;
    return b;
  }
  bool aliasing() const { return alias_; }
  bool allocated() const { return storage_.nbytes() > 0; }
  std::int64_t bytes() const { return static_cast<std::int64_t>(storage_.nbytes()); }
  void allocate() {
    if (allocated() || alias_) return;
    const std::size_t nbytes = static_cast<std::size_t>(numel_) * c10::elementSize(dtype_);
    storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(allocateBlock(nbytes, device_));
    storage_.unsafeGetStorageImpl()->set_nbytes(nbytes);
  }
  void free() {
    if (alias_) return;
    storage_.unsafeGetStorageImpl()->set_data_ptr_noswap(emptyPtr());
    storage_.unsafeGetStorageImpl()->set_nbytes(0);
  }
  // A tensor over [offset, offset + numel) of the buffer with the given shape.
  at::Tensor view(std::int64_t offset, at::IntArrayRef shape) const {
    return at::empty({0}, at::TensorOptions().dtype(dtype_).device(device_))
        .set_(storage_, offset, shape, c10::contiguous_strides(shape));
  }
  at::Tensor flat() const { return view(0, {numel_}); }

 private:
  c10::DeleterFnPtr deleter() const {
    return device_.is_cuda() ? &freeCudaFull : &freeCpuFull;
  }
  at::DataPtr emptyPtr() const { return at::DataPtr(nullptr, nullptr, deleter(), device_); }

  std::int64_t numel_ = 0;
  at::ScalarType dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;
  c10::Storage storage_;
  bool alias_ = false;
};

struct ParamSlot {
  at::Tensor param;  // the original parameter, now a view into the full buffer
  std::string name;  // its path from the root
  std::int64_t offset = 0;
  std::int64_t numel = 0;
  std::vector<std::int64_t> shape;
  std::size_t originalIndex = 0;  // position in the module's named_parameters()
  std::shared_ptr<torch::autograd::Node> accumulator;  // held: autograd keeps only a weak_ptr
};

struct FlatParam {
  std::vector<ParamSlot> slots;
  bool requiresGrad = true;
  std::int64_t numel = 0;
  std::int64_t paddedNumel = 0;
  std::int64_t shardNumel = 0;
  at::Tensor shard;       // this rank's fp32 piece: a leaf the optimizer steps
  FullBuffer full;        // full parameters in the compute dtype
  at::Tensor fullGrad;    // full gradient being accumulated (compute dtype)
  std::vector<char> written;  // per slot: holds a gradient in fullGrad (else uninitialised)
  at::Tensor gatherSource;  // the shard cast for the all-gather in flight
};

enum class UnitState { kSharded, kGathering, kUnsharded };

struct UnitRecord {
  std::string path;
  UnitImpl* module = nullptr;  // owned by the module tree
  std::vector<FlatParam> flats;
  UnitState state = UnitState::kSharded;
  std::vector<Work> gathers;
  int expectedGrads = 0;
  int seenGrads = 0;
  bool preBackwardDone = false;
  bool postBackwardDone = false;
  bool keepUntilBackwardEnd = false;  // forward returned no tensor to hook
  bool hasChildUnits = false;
};

struct PendingReduce {
  int unit = 0;
  int flat = 0;
  at::Tensor output;
  Work work;
  bool needsReplicaSync = false;  // HYBRID_SHARD: the all-reduce across nodes is still to come
};

}  // namespace

class FsdpState {
 public:
  FsdpState(Communicator& comm, FsdpOptions options) : comm_(comm), options_(std::move(options)) {}

  Communicator& comm_;
  FsdpOptions options_;
  Communicator* shardComm_ = nullptr;     // null when a shard is the whole parameter
  Communicator* gradSyncComm_ = nullptr;  // all-reduce of gradients after (or instead of) RS
  int shardSize_ = 1;
  int shardRank_ = 0;
  at::ScalarType computeDtype_ = at::kFloat;
  // Where the parameters (and the full buffers, and the collectives) live.
  at::Device device_ = at::kCPU;
  // CUDA parameters with cpuOffload: shards and their gradients stay in pinned host memory;
  // a shard is copied to the device for its all-gather, a reduced gradient back after it.
  bool offload_ = false;
  at::ScalarType reduceDtype_ = at::kFloat;
  std::vector<UnitRecord> units_;
  std::vector<int> forwardOrder_;          // this iteration's forward, as units entered it
  std::vector<int> previousForwardOrder_;  // the last complete forward (forward prefetch)
  std::deque<PendingReduce> pending_;
  bool noSync_ = false;
  bool callbackQueued_ = false;
  std::vector<std::pair<torch::autograd::Node*, std::uintptr_t>> hookKeys_;

  bool reshardAfterForward(int u) const {
    if (u == 0) return false;  // the root's backward starts right after its forward
    return options_.strategy == ShardingStrategy::kFullShard ||
           options_.strategy == ShardingStrategy::kHybridShard;
  }

  int inFlightGathers() const {
    return static_cast<int>(std::count_if(units_.begin(), units_.end(), [](const UnitRecord& u) {
      return u.state == UnitState::kGathering;
    }));
  }

  // Issues the all-gathers of unit u (no wait).
  void unshard(int u) {
    auto& unit = units_[static_cast<std::size_t>(u)];
    if (unit.state != UnitState::kSharded) return;
    at::NoGradGuard noGrad;
    for (auto& flat : unit.flats) {
      if (flat.full.aliasing()) continue;
      flat.full.allocate();
      at::Tensor source = flat.shard.detach();
      if (offload_) source = source.to(device_, /*non_blocking=*/true);
      if (source.scalar_type() != computeDtype_) source = source.to(computeDtype_);
      if (shardComm_ == nullptr) {
        flat.full.flat().copy_(source);
      } else {
        flat.gatherSource = source;
        unit.gathers.push_back(shardComm_->allGather(source, flat.full.flat()));
      }
    }
    unit.state = UnitState::kGathering;
  }

  void waitUnsharded(int u) {
    auto& unit = units_[static_cast<std::size_t>(u)];
    unshard(u);
    if (unit.state != UnitState::kGathering) return;
    for (auto& work : unit.gathers) work.wait();
    unit.gathers.clear();
    for (auto& flat : unit.flats) flat.gatherSource = at::Tensor();
    unit.state = UnitState::kUnsharded;
  }

  void reshard(int u) {
    auto& unit = units_[static_cast<std::size_t>(u)];
    if (unit.state == UnitState::kSharded) return;
    waitUnsharded(u);  // an all-gather in flight still writes into the buffer
    bool freed = true;
    for (auto& flat : unit.flats) {
      flat.full.free();
      freed = freed && !flat.full.aliasing();
    }
    unit.state = freed ? UnitState::kSharded : UnitState::kUnsharded;
  }

  void prefetch(int u) {
    if (u < 0 || units_[static_cast<std::size_t>(u)].state != UnitState::kSharded) return;
    if (inFlightGathers() >= options_.limitAllGathers) return;
    unshard(u);
  }

  // The unit that runs after u in forward (+1) or in backward (-1), or -1.
  static int neighbour(const std::vector<int>& order, int u, int direction) {
    const auto it = std::find(order.begin(), order.end(), u);
    if (it == order.end()) return -1;
    const auto index = (it - order.begin()) + direction;
    if (index < 0 || index >= static_cast<std::ptrdiff_t>(order.size())) return -1;
    return order[static_cast<std::size_t>(index)];
  }

  void preForward(int u) {
    const bool training = at::GradMode::is_enabled();
    if (u == 0) {
      if (!forwardOrder_.empty()) previousForwardOrder_ = std::move(forwardOrder_);
      forwardOrder_.clear();
      if (training) resetBackwardState();
    }
    if (std::find(forwardOrder_.begin(), forwardOrder_.end(), u) == forwardOrder_.end()) {
      forwardOrder_.push_back(u);
    }
    waitUnsharded(u);
    if (options_.forwardPrefetch) prefetch(neighbour(previousForwardOrder_, u, +1));
  }

  torch::Tensor postForward(int u, torch::Tensor output) {
    const bool training = at::GradMode::is_enabled();
    auto& unit = units_[static_cast<std::size_t>(u)];
    if (!training) {
      if (u == 0 || reshardAfterForward(u) || options_.strategy != ShardingStrategy::kNoShard) {
        // Nothing will need these parameters until the next forward: free them all.
        if (u == 0) {
          for (std::size_t i = 0; i < units_.size(); ++i) reshard(static_cast<int>(i));
        } else {
          reshard(u);
        }
      }
      return output;
    }
    if (reshardAfterForward(u) && !unit.keepUntilBackwardEnd) reshard(u);
    if (output.defined() && output.requires_grad()) {
      output.register_hook([this, u](const at::Tensor&) { preBackward(u); });
    }
    return output;
  }

  void preBackward(int u) {
    auto& unit = units_[static_cast<std::size_t>(u)];
    if (unit.preBackwardDone) return;
    unit.preBackwardDone = true;
    if (!callbackQueued_) {
      callbackQueued_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] { finishBackward(); });
    }
    waitUnsharded(u);
    if (options_.backwardPrefetch == BackwardPrefetch::kPre) prefetch(neighbour(forwardOrder_, u, -1));
  }

  // A parameter's gradient was accumulated: move it into the unit's full gradient buffer.
  void onGradient(int u, int f, int s) {
    auto& unit = units_[static_cast<std::size_t>(u)];
    auto& flat = unit.flats[static_cast<std::size_t>(f)];
    auto& slot = flat.slots[static_cast<std::size_t>(s)];
    at::Tensor& grad = slot.param.mutable_grad();
    if (!grad.defined()) return;
    {
      at::NoGradGuard noGrad;
      if (!flat.fullGrad.defined()) {
        // Uninitialised: each slot's first gradient is copied, not added to zeros.
        flat.fullGrad = emptyBlock(flat.paddedNumel, grad.options());
        flat.written.assign(flat.slots.size(), 0);
      }
      auto target = flat.fullGrad.narrow(0, slot.offset, slot.numel).view(grad.sizes());
      if (flat.written[static_cast<std::size_t>(s)] != 0) {
        target.add_(grad);
      } else {
        target.copy_(grad);
        flat.written[static_cast<std::size_t>(s)] = 1;
      }
    }
    grad = at::Tensor();
    if (++unit.seenGrads == unit.expectedGrads) postBackward(u);
  }

  void postBackward(int u) {
    auto& unit = units_[static_cast<std::size_t>(u)];
    if (unit.postBackwardDone) return;
    unit.postBackwardDone = true;
    reshard(u);
    if (!noSync_) {
      for (std::size_t f = 0; f < unit.flats.size(); ++f) reduceGradient(u, static_cast<int>(f));
    }
    drainPending(/*wait=*/false);
    if (options_.backwardPrefetch == BackwardPrefetch::kPost) prefetch(neighbour(forwardOrder_, u, -1));
  }

  void reduceGradient(int u, int f) {
    auto& flat = units_[static_cast<std::size_t>(u)].flats[static_cast<std::size_t>(f)];
    if (!flat.fullGrad.defined()) return;
    at::NoGradGuard noGrad;
    // Parameters that got no gradient, and the padding, count as zero.
    for (std::size_t s = 0; s < flat.slots.size(); ++s) {
      if (flat.written[s] == 0) flat.fullGrad.narrow(0, flat.slots[s].offset, flat.slots[s].numel).zero_();
    }
    if (flat.paddedNumel > flat.numel) {
      flat.fullGrad.narrow(0, flat.numel, flat.paddedNumel - flat.numel).zero_();
    }
    at::Tensor input = flat.fullGrad;
    flat.fullGrad = at::Tensor();  // the queued operation holds it until it is done
    if (input.scalar_type() != reduceDtype_) input = input.to(reduceDtype_);
    if (shardComm_ != nullptr) {
      at::Tensor output = at::empty({flat.shardNumel}, input.options());
      pending_.push_back({u, f, output, shardComm_->reduceScatter(input, output, ReduceOp::kAverage),
                          options_.strategy == ShardingStrategy::kHybridShard && gradSyncComm_ != nullptr});
    } else if (gradSyncComm_ != nullptr) {
      pending_.push_back({u, f, input, gradSyncComm_->allReduce(input, ReduceOp::kAverage)});
    } else {
      pending_.push_back({u, f, input, Work(readyFuture())});
    }
  }

  static std::shared_future<void> readyFuture() {
    std::promise<void> done;
    done.set_value();
    return done.get_future().share();
  }

  // The engine's end-of-backward callback: reduce what the hooks did not, then hand every
  // reduced gradient to its shard.
  void finishBackward() {
    callbackQueued_ = false;
    for (int u = static_cast<int>(units_.size()) - 1; u >= 0; --u) {
      const auto& unit = units_[static_cast<std::size_t>(u)];
      const bool hasGrad = std::any_of(unit.flats.begin(), unit.flats.end(),
                                       [](const FlatParam& f) { return f.fullGrad.defined(); });
      if (!unit.postBackwardDone && (unit.preBackwardDone || hasGrad)) postBackward(u);
    }
    // Across nodes (HYBRID_SHARD): every all-reduce issued, in order, before waiting on any.
    for (auto& p : pending_) startReplicaSync(p);
    drainPending(/*wait=*/true);
    for (std::size_t u = 0; u < units_.size(); ++u) reshard(static_cast<int>(u));
    resetBackwardState();
  }

  void startReplicaSync(PendingReduce& p) {
    if (!p.needsReplicaSync) return;
    p.work.wait();
    p.work = gradSyncComm_->allReduce(p.output, ReduceOp::kAverage);
    p.needsReplicaSync = false;
  }

  // Folds finished reductions into the shard gradients, oldest first, releasing their
  // buffers as soon as possible (without waiting: only those already done). Collectives are
  // issued in the same order on every rank because only the oldest entry moves on.
  void drainPending(bool wait) {
    at::NoGradGuard noGrad;
    while (!pending_.empty()) {
      auto& p = pending_.front();
      if (!wait && !p.work.ready()) return;
      if (p.needsReplicaSync) {
        startReplicaSync(p);
        if (!wait) return;
      }
      p.work.wait();
      auto& shard = units_[static_cast<std::size_t>(p.unit)].flats[static_cast<std::size_t>(p.flat)].shard;
      // A tensor of its own (not a view): optimizers detach_() gradients in zero_grad().
      at::Tensor grad = p.output.scalar_type() == shard.scalar_type() &&
                                p.output.device() == shard.device()
                            ? p.output
                            : p.output.to(shard.device(), shard.scalar_type());
      at::Tensor& current = shard.mutable_grad();
      if (!current.defined()) {
        current = grad;
      } else {
        current.add_(grad);
      }
      pending_.pop_front();
    }
  }

  void resetBackwardState() {
    for (auto& unit : units_) {
      unit.seenGrads = 0;
      unit.preBackwardDone = false;
      unit.postBackwardDone = false;
    }
  }

  static torch::Tensor run(UnitImpl& unit, torch::Tensor input) { return unit.runInner(std::move(input)); }
};

}  // namespace detail

// ---------------------------------------------------------------------------------------
// Units
// ---------------------------------------------------------------------------------------

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

torch::Tensor UnitImpl::leave(torch::Tensor output, bool active) {
  if (!active) return output;
  return state_->postForward(index_, std::move(output));
}

void UnitImpl::leaveOpaque(bool active) {
  if (!active) return;
  state_->units_[static_cast<std::size_t>(index_)].keepUntilBackwardEnd = true;
  state_->postForward(index_, torch::Tensor());
}

torch::Tensor UnitImpl::runInner(torch::Tensor input) {
  return sequential_ ? sequential_->forward(std::move(input)) : inner_.forward(std::move(input));
}

namespace detail {
namespace {

// Activation checkpointing of one unit: forward without keeping activations, recompute
// during backward (with the RNG state of the first run, so dropout matches). The unit's
// parameters are unsharded by then: the pre-backward hook sits on this function's output.
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `anchor` is an empty tensor that requires grad: the output must require grad even when
  // the input does not (the unit's parameters are not inputs of this function).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor input,
                               torch::Tensor anchor, std::int64_t unitAddress) {
    (void)anchor;
    // The unit outlives the graph (the model outlives its backward); autograd's context holds
    // only IValues, so its address travels as an integer.
    ctx->saved_data["unit"] = unitAddress;
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::scoped_lock lock(gen.mutex());
      ctx->saved_data["rng"] = gen.get_state();
    }
    ctx->saved_data["input_requires_grad"] = input.requires_grad();
    ctx->save_for_backward({input});
    return FsdpState::run(*reinterpret_cast<UnitImpl*>(unitAddress), input);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* unit = reinterpret_cast<UnitImpl*>(ctx->saved_data["unit"].toInt());
    const bool inputGrad = ctx->saved_data["input_requires_grad"].toBool();
    at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(inputGrad);
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor output;
    {
      std::scoped_lock lock(gen.mutex());
      const at::Tensor current = gen.get_state();
      gen.set_state(ctx->saved_data["rng"].toTensor());
      at::AutoGradMode enable(true);
      output = FsdpState::run(*unit, input);
      gen.set_state(current);
    }
    torch::autograd::backward({output}, {grads[0]});
    return {inputGrad ? input.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace
}  // namespace detail

torch::Tensor UnitImpl::forward(torch::Tensor input) {
  const bool active = enter();
  torch::Tensor output;
  if (active && index_ > 0 && state_->options_.activationCheckpointing &&
      !state_->units_[static_cast<std::size_t>(index_)].hasChildUnits &&
      at::GradMode::is_enabled()) {
    output = detail::CheckpointFunction::apply(input, at::empty({0}).requires_grad_(),
                                               reinterpret_cast<std::int64_t>(this));
  } else {
    output = runInner(std::move(input));
  }
  return leave(std::move(output), active);
}

// ---------------------------------------------------------------------------------------
// The root
// ---------------------------------------------------------------------------------------

namespace {

class GradientHook : public torch::autograd::FunctionPostHook {
 public:
  GradientHook(detail::FsdpState& state, int unit, int flat, int slot)
      : state_(state), unit_(unit), flat_(flat), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    state_.onGradient(unit_, flat_, slot_);
    return outputs;
  }

 private:
  detail::FsdpState& state_;
  int unit_, flat_, slot_;
};

std::string joinPath(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

std::int64_t countParams(const torch::nn::Module& module) {
  std::int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

std::string shapeText(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

}  // namespace

namespace detail {

// Everything done once when a model is wrapped.
class FsdpBuilder {
 public:
  FsdpBuilder(FsdpState& state, UnitImpl& root) : state_(state), root_(root) {}

  void build() {
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
    if (options.autoWrap && root_.sequential_) wrapSequentialChildren();
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

 private:
  void chooseGroups() {
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

  void recordOriginalOrder() {
    for (const auto& item : root_.inner_ptr_->named_parameters(/*recurse=*/true)) {
      const auto* impl = item.value().unsafeGetTensorImpl();
      if (originalIndex_.count(impl) != 0) continue;
      originalIndex_.emplace(impl, originalNames_.size());
      originalNames_.push_back(item.key());
      originals_.push_back(item.value());
    }
  }

  void checkParameters() {
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
  void checkSameModelEverywhere() {
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
    if (comm.size() == 1) return;
    auto all = at::empty({kWords * comm.size()}, at::kLong);
    comm.allGather(mine, all).wait();
    const auto* words = all.data_ptr<std::int64_t>();
    for (int r = 1; r < comm.size(); ++r) {
      const auto* theirs = words + static_cast<std::ptrdiff_t>(r) * kWords;
      if (!std::equal(theirs, theirs + kWords, words)) {
        throw ConfigError("fsdp: rank " + std::to_string(r) + "'s model differs from rank 0's (" +
                          std::to_string(theirs[2]) + " parameters, " + std::to_string(theirs[3]) +
                          " elements vs " + std::to_string(words[2]) + ", " +
                          std::to_string(words[3]) +
                          "); every rank must build the same model (names, shapes, dtypes)");
      }
    }
  }

  void syncModuleStates() {
    auto& comm = state_.comm_;
    if (comm.size() == 1) return;
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

  // The root Sequential is rebuilt with the children the policy picks wrapped as units.
  void wrapSequentialChildren() {
    const auto& policy = state_.options_.autoWrap.predicate;
    torch::nn::Sequential rebuilt;
    const auto names = root_.sequential_->named_children();
    std::size_t i = 0;
    for (const auto& child : *root_.sequential_) {
      const std::string& name = names[i++].key();
      const auto ptr = child.ptr();
      if (!std::dynamic_pointer_cast<UnitImpl>(ptr) && countParams(*ptr) > 0 &&
          policy(*ptr, name, countParams(*ptr))) {
        rebuilt->push_back(name, torch::nn::AnyModule(Unit(std::make_shared<UnitImpl>(child))));
      } else {
        rebuilt->push_back(name, child);
      }
    }
    root_.sequential_ = rebuilt;
    root_.inner_ptr_ = root_.replace_module("module", rebuilt.ptr());
  }

  void discover() {
    addUnit(root_, "");
    discover(*root_.inner_ptr_, 0, "");
  }

  int addUnit(UnitImpl& module, const std::string& path) {
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

  void discover(torch::nn::Module& module, int owner, const std::string& prefix) {
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      assign(owner, joinPath(prefix, item.key()), item.value());
    }
    for (const auto& child : module.named_children()) {
      const std::string path = joinPath(prefix, child.key());
      if (auto* unit = dynamic_cast<UnitImpl*>(child.value().get())) {
        state_.units_[static_cast<std::size_t>(owner)].hasChildUnits = true;
        const int index = addUnit(*unit, path);
        discover(*unit->inner_ptr_, index, path);
      } else {
        discover(*child.value(), owner, path);
      }
    }
  }

  void assign(int owner, const std::string& path, const at::Tensor& param) {
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

  void flatten(int u) {
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
    const bool aliasing = std::all_of(unit.flats.begin(), unit.flats.end(),
                                      [](const FlatParam& f) { return f.full.aliasing(); });
    unit.state = aliasing ? UnitState::kUnsharded : UnitState::kSharded;
  }

  void buildFlat(UnitRecord& unit, FlatParam& flat) {
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
    const at::Tensor values = at::cat(pieces);
    if (world == 1 && state_.computeDtype_ == dtype && !state_.offload_) {
      flat.full = FullBuffer::permanent(values);
      flat.shard = flat.full.flat();
    } else {
      flat.shard = values.narrow(0, flat.shardNumel * state_.shardRank_, flat.shardNumel).clone();
      if (state_.offload_) flat.shard = flat.shard.to(at::kCPU).pin_memory();
      flat.full = FullBuffer(flat.paddedNumel, state_.computeDtype_, device);
      flat.full.allocate();  // views are made over allocated memory (set_ checks the size)
    }
    for (auto& slot : flat.slots) slot.param.set_data(flat.full.view(slot.offset, slot.shape));
    flat.full.free();
    flat.shard.set_requires_grad(flat.requiresGrad);
  }

  void registerHooks(int u) {
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

  FsdpState& state_;
  UnitImpl& root_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> originalIndex_;
  std::vector<std::string> originalNames_;
  std::vector<at::Tensor> originals_;
  std::unordered_map<const c10::TensorImpl*, int> owner_;
  std::vector<std::vector<ParamSlot>> slotsByUnit_;
};

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
}

FullyShardedDataParallelImpl::~FullyShardedDataParallelImpl() {
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
    }
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

std::shared_ptr<torch::nn::Module> FullyShardedDataParallelImpl::module() const {
  return rootUnit_->inner();
}

HybridGroups makeHybridGroups(rendezvous::StoreClient& store, const HybridGroupOptions& options) {
  const int local = options.localWorldSize;
  if (local < 1 || options.worldSize % local != 0) {
    throw ConfigError("HYBRID_SHARD: world size " + std::to_string(options.worldSize) +
                      " is not a multiple of the local world size " + std::to_string(local));
  }
  const int node = options.rank / local;
  const int localRank = options.rank % local;
  HybridGroups groups;
  groups.shard = createGlooCommunicator(
      store, {.rank = localRank,
              .size = local,
              .localAddress = options.localAddress,
              .storePrefix = options.storePrefix + "/shard/" + std::to_string(node),
              .timeout = options.timeout});
  groups.replicate = createGlooCommunicator(
      store, {.rank = node,
              .size = options.worldSize / local,
              .localAddress = options.localAddress,
              .storePrefix = options.storePrefix + "/replicate/" + std::to_string(localRank),
              .timeout = options.timeout});
  return groups;
}

HybridGroups makeHybridGroups(Runtime& runtime) {
  const auto& env = runtime.env();
  return makeHybridGroups(runtime.store(), {.rank = env.rank,
                                            .worldSize = env.worldSize,
                                            .localWorldSize = env.localWorldSize,
                                            .localAddress = env.localAddress,
                                            .storePrefix = runtime.roundPrefix() + "gloo/hybrid"});
}

}  // namespace fsdp::worker
