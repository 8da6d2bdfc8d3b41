#pragma once
// The per-model state of FSDP at run time: units, their flat parameters, and the state
// machine that unshards before use, reshards after, catches gradients and reduces them.
// Private to libfsdp; built once by FsdpBuilder (builder.cpp), driven by UnitImpl's forward.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/worker/fsdp.hpp"
#include "fsdp/worker/torch_compat.hpp"
#include "full_buffer.hpp"

namespace fsdp::worker::detail {

struct ParamSlot {
  at::Tensor param;  // the original parameter, now a view into the full buffer
  std::string name;  // its path from the root
  std::int64_t offset = 0;
  std::int64_t numel = 0;
  std::vector<std::int64_t> shape;
  std::size_t originalIndex = 0;  // position in the module's named_parameters()
  compat::GradAccumulatorPtr accumulator;  // held: autograd keeps only a weak reference
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
  // Frozen parameters are read by the backward of the ops that use them, which may run after
  // the last trainable gradient of the unit landed: such a unit reshards only once the
  // gradients of its inputs exist (pendingInputGrads back to 0), or at the end of backward.
  // Pending: one per input that requires grad and per output of a child unit that does (the
  // unit's own ops read the child's output gradient, so they ran before it exists).
  bool hasFrozen = false;
  int pendingInputGrads = 0;
  int parent = -1;              // the enclosing unit (-1: the root)
  // Checkpointed calls in this forward: each recompute accumulates every parameter's
  // gradient once more (a unit called twice is recomputed twice).
  int checkpointedCalls = 0;
  int pendingRecomputes = 0;  // checkpointed calls whose backward (a recompute) is still to run
  bool frozenNeedsEnd = false;  // an input could not be hooked: keep until the end of backward
  bool preBackwardDone = false;
  bool reduced = false;           // this backward's gradients handed to the reduction
  bool postBackwardDone = false;  // ... and the full parameters released
  bool keepUntilBackwardEnd = false;  // forward returned no tensor to hook
  bool hasChildUnits = false;
  std::int64_t reductions = 0;  // gradient reductions issued (UnitInfo::gradReductions)
};

struct PendingReduce {
  int unit = 0;
  int flat = 0;
  at::Tensor output;
  Work work;
  bool needsReplicaSync = false;  // HYBRID_SHARD: the all-reduce across nodes is still to come
};

class FsdpState {
 public:
  FsdpState(Communicator& comm, FsdpOptions options) : comm_(comm), options_(std::move(options)) {}

  // Forward of unit u: gather its parameters (and prefetch the next unit's).
  void preForward(int u);
  // After unit u's forward on `input`: reshard as the strategy says, hook `output` so that the
  // unit is gathered again before its backward. `input` may be undefined (unknown inputs).
  torch::Tensor postForward(int u, torch::Tensor output, const torch::Tensor& input);
  // A parameter's gradient was accumulated (the gradient accumulator's post hook).
  void onGradient(int u, int f, int s);
  // Activation checkpointing: a call of unit u was run in forward / recomputed in backward.
  void onCheckpointedCall(int u);
  void onRecomputeDone(int u);
  // Issues unit u's all-gathers (no wait) / waits for them.
  void unshard(int u);
  void waitUnsharded(int u);
  void reshard(int u);
  static torch::Tensor run(UnitImpl& unit, torch::Tensor input) { return unit.runInner(std::move(input)); }
  static at::Device deviceOf(const UnitImpl& unit) { return unit.state_->device_; }
  static void recomputeDone(UnitImpl& unit) { unit.state_->onRecomputeDone(unit.index_); }

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
  // The module's buffers with the original module's names (what checkpoints save them under).
  std::vector<std::pair<std::string, at::Tensor>> buffers_;
  std::vector<int> forwardOrder_;          // this iteration's forward, as units entered it
  std::vector<int> previousForwardOrder_;  // the last complete forward (forward prefetch)
  std::deque<PendingReduce> pending_;
  bool noSync_ = false;
  // The end-of-backward callback is queued; still set at the next forward when the backward
  // threw (the engine drops its callbacks then).
  bool callbackQueued_ = false;
  // Counts backward passes, so that a hook of an abandoned one recognises itself.
  std::uint64_t generation_ = 0;
  std::vector<std::pair<torch::autograd::Node*, std::uintptr_t>> hookKeys_;
  // The collective of construction, kept so that a survivor of a failure replays it with the new
  // processes of the round (reform/fsdp_reform.cpp): the model digest all-gathered. Where it
  // finds a survivor, syncModuleStates broadcasts nothing (the restore writes every parameter
  // and buffer), so that is all a survivor replays.
  at::Tensor constructionDigest_;

  // After the communicators were aborted mid-step: drops what the step left (gathers,
  // reductions, full gradients and parameters) without waiting on any of it.
  void abandonAfterAbort();
  // Issues the collective of construction again, over the new round's communicators, as a new
  // process's constructor does; as a survivor, which tells the new processes to skip their
  // broadcast of rank 0's weights (a restore follows, and writes them).
  void replayConstruction();
  // After the communicators were rebuilt for a new round: the shard group, this rank's place in
  // it, and, when the group's size changed (a node lost or added), every flat parameter laid
  // out again for it, as the constructor would lay it out: new shard memory under the same
  // tensors (the optimizer's), unfilled. Returns whether the layout changed.
  bool relayout();

 private:
  bool reshardAfterForward(int u) const;
  int inFlightGathers() const;
  void prefetch(int u);
  void preBackward(int u);
  // Unit u's trainable gradients are all in: reduce them (once per backward).
  void gradientsLanded(int u);
  // Issues unit u's reductions unless this backward already did; false if it had.
  bool reduceUnit(int u);
  // Releases unit u's full parameters (once per backward) when nothing of its backward can
  // still read them: its trainable gradients are in, its recomputes ran, and with frozen
  // parameters, the gradients it awaits exist.
  void releaseIfDone(int u);
  // Unit u keeps its full parameters until the gradient of `tensor` exists (if it needs one).
  void awaitGradient(int u, const at::Tensor& tensor);
  void onInputGradient(int u, std::uint64_t generation);
  void reduceGradient(int u, int f);
  void finishBackward();
  void startReplicaSync(PendingReduce& p);
  void drainPending(bool wait);
  void resetBackwardState();
  // A backward that threw left gathers, reductions and partial gradients behind: wait for the
  // collectives (every rank issued them), drop their results, release the memory.
  void abandonBackward();
};

// The FSDP models alive in this process, over any communicator (counted by their constructors
// and destructors): an in-process re-formation rebuilds one model's state (reform.hpp), so a
// process with two (a GAN's, a teacher beside its student, on comm() or cpuComm()) cannot re-form.
int liveModels();
void countModel(int delta);

}  // namespace fsdp::worker::detail
