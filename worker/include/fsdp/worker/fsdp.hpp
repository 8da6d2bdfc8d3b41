#pragma once
// Fully sharded data parallel training for LibTorch modules.
//
//   auto rt = fsdp::init();
//   fsdp::FullyShardedDataParallel model(MyNet(), rt->comm(),
//       {.autoWrap = fsdp::AutoWrapPolicy::minParams(1'000'000)});
//   torch::optim::Adam opt(model->parameters(), 1e-3);   // this rank's shards only
//   auto loss = lossFn(model->forward(x), y);
//   loss.backward();                                      // gradients reduce-scattered
//   opt.step();
//
// How units are found. LibTorch modules have no forward hooks, so a unit boundary is a place
// whose forward call FSDP controls:
//   - the root (the module given to FullyShardedDataParallel);
//   - an fsdp::Unit the model registers itself, at any depth (a pass-through until the root
//     shards it); its path is its module path ("encoder.block", children "encoder.block.module.0");
//   - with an auto-wrap policy: the policy is asked about every module, bottom-up, with the
//     number of its parameters not yet in a unit below it. A pick that is a child of a
//     Sequential a unit holds (the root's own Sequential, or an fsdp::Unit's) becomes a unit:
//     FSDP rebuilds that Sequential with it wrapped (a module placed twice becomes one unit).
//     A pick that is a member of another module cannot be intercepted: its parameters stay in
//     the nearest enclosing unit, with one warning; when that unit is the root, wrapping is
//     refused (ConfigError naming the module and the fix) rather than silently doing nothing.
// Parameters not inside a unit belong to the nearest enclosing unit (ultimately the root).
//
// Each unit flattens its parameters (one flat parameter per requires_grad group), pads it
// to a multiple of the shard group's size and keeps only this rank's shard, an fp32 leaf the
// optimizer steps. Before the unit runs, the shards are all-gathered into one full buffer
// that the original parameter tensors point into; after use the buffer's memory is freed
// (FULL_SHARD) and refilled before the unit's backward. Gradients land in a full-size
// gradient buffer and are reduce-scattered (averaged) into the shard's .grad.
//
// Frozen parameters (requires_grad false) may sit anywhere: they get a flat parameter of their
// own that has no gradient buffer and no reduction, and their unit keeps its full parameters
// until its backward is over (its input's and child units' gradients exist). A unit may be
// called more than once per forward, and one backward may follow several forwards. A backward that throws is cleaned up by the next forward,
// which drops the gradients that backward had not reduced yet (with a warning).
//
// Thread-safety: one model is used by one thread. Every rank must build the same model and
// run the same forward/backward sequence (collectives are issued in that order).

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker {

enum class ShardingStrategy {
  kFullShard,    // shard params, grads, optimizer state; free full params after forward
  kShardGradOp,  // keep full params from forward until the unit's backward is done
  kNoShard,      // replicate (DDP): all-reduce gradients
  kHybridShard,  // FULL_SHARD inside the shard group (a node), replicate across nodes
};
// Parses FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|HYBRID_SHARD; throws ConfigError naming the value.
ShardingStrategy parseShardingStrategy(const std::string& text);
const char* toString(ShardingStrategy strategy);

enum class BackwardPrefetch {
  kNone,
  kPre,   // gather the next unit's parameters when this unit's backward starts
  kPost,  // ... when this unit's gradients have been handed to the reduce-scatter
};

// Dtypes of the compute copy of the parameters, of the gradient reduction, and of buffers.
// Unset means fp32 (the dtype of the parameters). Master shards and shard gradients stay
// fp32 whatever is set here.
struct MixedPrecision {
  std::optional<at::ScalarType> paramDtype;
  std::optional<at::ScalarType> reduceDtype;
  std::optional<at::ScalarType> bufferDtype;
  // no|bf16|fp16: param, reduce and buffer dtypes all set to that type (or none).
  static MixedPrecision parse(const std::string& text);
};

// Decides which children of a Sequential become units. The predicate sees the module, its
// path from the root ("3", "blocks.0") and the number of its parameters not already inside
// a unit below it (children are wrapped first).
struct AutoWrapPolicy {
  std::function<bool(const torch::nn::Module&, const std::string& path, std::int64_t numParams)>
      predicate;
  // Units of at least `minNumParams` parameters (PyTorch's size_based_auto_wrap_policy).
  static AutoWrapPolicy minParams(std::int64_t minNumParams);
  // Modules whose type name (module.name(), with or without namespace and "Impl") is one of
  // `typeNames` (PyTorch's transformer_auto_wrap_policy).
  static AutoWrapPolicy byTypeName(std::vector<std::string> typeNames);
  explicit operator bool() const { return static_cast<bool>(predicate); }
};

struct FsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  AutoWrapPolicy autoWrap;
  MixedPrecision mixedPrecision;
  BackwardPrefetch backwardPrefetch = BackwardPrefetch::kPre;
  bool forwardPrefetch = false;
  // At most this many units' all-gathers issued ahead of use (prefetches wait their turn).
  int limitAllGathers = 2;
  // Broadcast rank 0's parameters and buffers before sharding. Not in a new process of a round
  // in which survivors of a failure re-form in process (reform.hpp): the restore that follows
  // writes them on every rank.
  bool syncModuleStates = false;
  // Recompute each leaf unit's forward during its backward instead of keeping activations,
  // with the RNG states of the first run (CPU, and the CUDA device's: dropout draws the same
  // masks) and its buffers put back afterwards (BatchNorm's statistics move once per forward).
  bool activationCheckpointing = false;
  // Keep shards and shard gradients in host memory (CUDA only; CPU shards already are).
  bool cpuOffload = false;
  // HYBRID_SHARD: the ranks of this node, and the ranks with this local rank on every node
  // (see makeHybridGroups). The communicator given to the constructor spans the world.
  Communicator* shardGroup = nullptr;
  Communicator* replicateGroup = nullptr;
};

namespace detail {
class FsdpState;
class FsdpBuilder;
struct RuntimeReform;
}  // namespace detail

// A unit boundary a model declares itself. Until the root FSDP module shards it, it is a
// plain pass-through to the wrapped module.
class UnitImpl : public torch::nn::Module {
 public:
  explicit UnitImpl(torch::nn::AnyModule module);
  explicit UnitImpl(torch::nn::Sequential module);
  template <typename M>
  explicit UnitImpl(M module) : UnitImpl(torch::nn::AnyModule(std::move(module))) {}
  ~UnitImpl() override;

  torch::Tensor forward(torch::Tensor input);
  // For modules whose forward takes or returns something other than one tensor. A result
  // that is not a tensor keeps the unit's full parameters until the end of backward.
  template <typename Return = torch::Tensor, typename... Args>
  Return call(Args&&... args) {
    const bool active = enter();
    Return result = sequential_ ? sequential_->forward<Return>(std::forward<Args>(args)...)
                                : inner_.forward<Return>(std::forward<Args>(args)...);
    if constexpr (std::is_same_v<Return, torch::Tensor>) {
      return leave(std::move(result), active, torch::Tensor());
    } else {
      leaveOpaque(active);
      return result;
    }
  }
  std::shared_ptr<torch::nn::Module> inner() const { return inner_ptr_; }

 private:
  friend class detail::FsdpState;
  friend class detail::FsdpBuilder;
  friend class FullyShardedDataParallelImpl;
  bool enter();
  // `input`: the unit's input when known (a unit with frozen parameters keeps them until its
  // input's gradient exists); undefined for call<>() with other arguments.
  torch::Tensor leave(torch::Tensor output, bool active, const torch::Tensor& input);
  void leaveOpaque(bool active);
  torch::Tensor runInner(torch::Tensor input);

  torch::nn::AnyModule inner_;
  torch::nn::Sequential sequential_{nullptr};
  std::shared_ptr<torch::nn::Module> inner_ptr_;
  detail::FsdpState* state_ = nullptr;  // set by the root that shards this unit
  int index_ = -1;                      // this unit's index in the root's unit list
};
TORCH_MODULE(Unit);

// What FSDP tells about one unit (for tests, logs and benchmarks).
struct UnitInfo {
  std::string path;            // "" for the root
  std::int64_t numel = 0;      // parameters, unpadded
  std::int64_t shardNumel = 0; // elements this rank holds (over all flat parameters)
  bool unsharded = false;      // full parameters are materialised now
  std::int64_t fullBytes = 0;  // bytes of full parameters allocated now
  std::int64_t trainableNumel = 0;  // parameters that require grad, unpadded
  // Bytes of gradient memory held now: full gradients being accumulated and this rank's shard
  // gradients. Frozen parameters never have any.
  std::int64_t gradBytes = 0;
  std::int64_t gradReductions = 0;  // gradient reduce-scatters (or all-reduces) issued so far
};

// How the parameters are sharded on this rank, for checkpoints: one entry per flat parameter,
// in the same order on every rank.
struct FlatParamInfo {
  struct Param {
    std::string name;  // the original parameter's path from the root
    std::vector<std::int64_t> shape;
    std::int64_t offset = 0;  // in the flat parameter, in elements
    std::int64_t numel = 0;
  };
  std::string unit;              // the unit's path ("" for the root)
  std::int64_t numel = 0;        // elements of the flat parameter, padding excluded
  std::int64_t shardOffset = 0;  // where this rank's shard starts in the flat parameter
  std::int64_t shardNumel = 0;   // elements of this rank's shard, padding included
  bool requiresGrad = true;
  at::Tensor shard;              // this rank's shard: the optimizer's parameter (fp32)
  std::vector<Param> params;     // in flat order
};
struct ShardLayout {
  int shardRank = 0;            // this rank's place among the ranks that split a parameter
  int shardSize = 1;            // how many ranks split a parameter (1: NO_SHARD)
  bool primaryReplica = true;   // the copy that checkpoints write (HYBRID_SHARD: node 0's)
  std::vector<FlatParamInfo> flats;
};

class FullyShardedDataParallelImpl : public torch::nn::Module {
 public:
  // `comm` spans the world and must outlive this module. Throws ConfigError for bad use
  // (a module already wrapped, models that differ across ranks, tensors on a device the
  // communicator does not serve, parameters shared between units).
  FullyShardedDataParallelImpl(std::shared_ptr<UnitImpl> root, Communicator& comm,
                               FsdpOptions options = {});
  template <typename M>
  FullyShardedDataParallelImpl(M module, Communicator& comm, FsdpOptions options = {})
      : FullyShardedDataParallelImpl(std::make_shared<UnitImpl>(std::move(module)), comm,
                                     std::move(options)) {}
  ~FullyShardedDataParallelImpl() override;

  torch::Tensor forward(torch::Tensor input);
  template <typename Return = torch::Tensor, typename... Args>
  Return call(Args&&... args) {
    return rootUnit_->call<Return>(std::forward<Args>(args)...);
  }

  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;

  // Clips the gradient norm over all shards of all ranks; returns the total norm before
  // clipping. normType 2 (default) or infinity.
  double clipGradNorm(double maxNorm, double normType = 2.0);

  // While the guard lives, backward accumulates full gradients locally and skips the
  // reduce-scatter; the next backward outside a guard reduces everything accumulated.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(detail::FsdpState& state);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    detail::FsdpState& state_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard noSync();

  // The full fp32 parameters, gathered unit by unit, in the original module's order and with
  // its names. Collective: every rank must call it.
  std::vector<std::pair<std::string, at::Tensor>> fullParameters();
  // Collective: gathers one flat parameter at a time and hands each original parameter (full,
  // fp32, a view valid during the call) to `sink` with its name; at most one flat parameter is
  // ever whole on a rank.
  void visitFullParameters(const std::function<void(const std::string&, const at::Tensor&)>& sink);
  // The module's buffers (whole on every rank), named as the original module names them: what
  // checkpoints save, whatever the auto-wrap policy. Not collective; valid as long as the model.
  const std::vector<std::pair<std::string, at::Tensor>>& namedBuffers() const;

  // Throws ConfigError if `optimizer` holds tensors that are not this model's shards (it was
  // built before wrapping, or from the original module).
  void checkOptimizer(const torch::optim::Optimizer& optimizer) const;

  std::vector<UnitInfo> units() const;
  // The sharded layout (checkpoints read and write shards through it).
  ShardLayout shardLayout() const;
  const FsdpOptions& options() const;
  std::shared_ptr<torch::nn::Module> module() const;

 private:
  friend struct detail::RuntimeReform;  // an in-process re-formation resets the state (reform.hpp)
  std::unique_ptr<detail::FsdpState> state_;
  std::shared_ptr<UnitImpl> rootUnit_;
};

// The holder users keep (like torch::nn::Linear for LinearImpl).
class FullyShardedDataParallel : public torch::nn::ModuleHolder<FullyShardedDataParallelImpl> {
 public:
  FullyShardedDataParallel(std::nullptr_t) : ModuleHolder(nullptr) {}
  explicit FullyShardedDataParallel(std::shared_ptr<FullyShardedDataParallelImpl> impl)
      : ModuleHolder(std::move(impl)) {}
  template <typename M>
  FullyShardedDataParallel(M module, Communicator& comm, FsdpOptions options = {})
      : ModuleHolder(std::make_shared<FullyShardedDataParallelImpl>(std::move(module), comm,
                                                                    std::move(options))) {}
};

// The two communicators of HYBRID_SHARD for rank `rank` of a world made of nodes of
// `localWorldSize` consecutive ranks, connected through `store` under `storePrefix`.
struct HybridGroups {
  std::unique_ptr<Communicator> shard;      // the ranks of this node
  std::unique_ptr<Communicator> replicate;  // this local rank on every node
};
struct HybridGroupOptions {
  int rank = 0;
  int worldSize = 1;
  int localWorldSize = 1;
  std::string localAddress = "127.0.0.1";
  std::string storePrefix = "hybrid";
  std::chrono::milliseconds timeout{300000};
  // CPU: Gloo groups; CUDA: NCCL groups on CUDA device `device`.
  c10::DeviceType deviceType = c10::DeviceType::CPU;
  int device = 0;
  // CPU: the shard group (this node's ranks) over shared memory instead of Gloo.
  bool sharedMemoryShard = false;
  std::string runId = "none";  // names the shared-memory segment (the agent's cleanup)
};
}  // namespace fsdp::worker
namespace fsdp::rendezvous {
class StoreClient;
}
namespace fsdp::worker {
// Throws ConfigError when worldSize is not a multiple of localWorldSize.
HybridGroups makeHybridGroups(rendezvous::StoreClient& store, const HybridGroupOptions& options);
class Runtime;
// The groups of this worker's job: nodes as fsdprun started them (LOCAL_WORLD_SIZE ranks each),
// on the runtime's device (NCCL when runtime.comm() is NCCL), the node's group over shared memory
// when fsdp::init() chose it.
HybridGroups makeHybridGroups(Runtime& runtime);

}  // namespace fsdp::worker

namespace fsdp {
using worker::AutoWrapPolicy;
using worker::BackwardPrefetch;
using worker::FsdpOptions;
using worker::FullyShardedDataParallel;
using worker::FullyShardedDataParallelImpl;
using worker::ShardLayout;
using worker::MixedPrecision;
using worker::ShardingStrategy;
using worker::Unit;
using worker::UnitImpl;
}  // namespace fsdp
