// The unit state machine at run time: unshard before use, reshard after, catch gradients,
// reduce them, and finish every unit at the end of backward (see state.hpp).
#include "state.hpp"

#include <ATen/Functions.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <future>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/flight_recorder.hpp"

namespace fsdp::worker::detail {
namespace {

std::shared_future<void> readyFuture() {
  std::promise<void> done;
  done.set_value();
  return done.get_future().share();
}

// The unit that runs after u in forward (+1) or in backward (-1), or -1.
int neighbour(const std::vector<int>& order, int u, int direction) {
  const auto it = std::find(order.begin(), order.end(), u);
  if (it == order.end()) return -1;
  const auto index = (it - order.begin()) + direction;
  if (index < 0 || index >= static_cast<std::ptrdiff_t>(order.size())) return -1;
  return order[static_cast<std::size_t>(index)];
}

}  // namespace

bool FsdpState::reshardAfterForward(int u) const {
  if (u == 0) return false;  // the root's backward starts right after its forward
  return options_.strategy == ShardingStrategy::kFullShard ||
         options_.strategy == ShardingStrategy::kHybridShard;
}

int FsdpState::inFlightGathers() const {
  return static_cast<int>(std::count_if(units_.begin(), units_.end(), [](const UnitRecord& u) {
    return u.state == UnitState::kGathering;
  }));
}

void FsdpState::unshard(int u) {
  auto& unit = units_[static_cast<std::size_t>(u)];
  if (unit.state != UnitState::kSharded) return;
  at::NoGradGuard noGrad;
  const CommTag tag(callbackQueued_ ? "backward" : "forward", unit.path.empty() ? "(root)" : unit.path);
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

void FsdpState::waitUnsharded(int u) {
  auto& unit = units_[static_cast<std::size_t>(u)];
  unshard(u);
  if (unit.state != UnitState::kGathering) return;
  for (auto& work : unit.gathers) work.wait();
  unit.gathers.clear();
  for (auto& flat : unit.flats) flat.gatherSource = at::Tensor();
  unit.state = UnitState::kUnsharded;
}

void FsdpState::reshard(int u) {
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

void FsdpState::prefetch(int u) {
  if (u < 0 || units_[static_cast<std::size_t>(u)].state != UnitState::kSharded) return;
  if (inFlightGathers() >= options_.limitAllGathers) return;
  unshard(u);
}

void FsdpState::preForward(int u) {
  if (u == 0) {
    if (callbackQueued_) abandonBackward();
    if (!forwardOrder_.empty()) previousForwardOrder_ = std::move(forwardOrder_);
    forwardOrder_.clear();
    // The backward state is not reset here but when a backward ends: a loss made of two
    // forwards counts both forwards' calls, inputs and recomputes.
  }
  if (std::find(forwardOrder_.begin(), forwardOrder_.end(), u) == forwardOrder_.end()) {
    forwardOrder_.push_back(u);
  }
  waitUnsharded(u);
  if (options_.forwardPrefetch) prefetch(neighbour(previousForwardOrder_, u, +1));
}

torch::Tensor FsdpState::postForward(int u, torch::Tensor output, const torch::Tensor& input) {
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
  if (unit.hasFrozen) {
    if (!input.defined()) {
      unit.frozenNeedsEnd = true;
    } else {
      awaitGradient(u, input);
    }
  }
  if (reshardAfterForward(u) && !unit.keepUntilBackwardEnd) reshard(u);
  if (output.defined() && output.requires_grad()) {
    output.register_hook([this, u](const at::Tensor&) { preBackward(u); });
    if (unit.parent >= 0 && units_[static_cast<std::size_t>(unit.parent)].hasFrozen) {
      awaitGradient(unit.parent, output);
    }
  }
  return output;
}

void FsdpState::awaitGradient(int u, const at::Tensor& tensor) {
  if (!tensor.requires_grad()) return;
  ++units_[static_cast<std::size_t>(u)].pendingInputGrads;
  const std::uint64_t generation = generation_;
  tensor.register_hook([this, u, generation](const at::Tensor&) { onInputGradient(u, generation); });
}

void FsdpState::preBackward(int u) {
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

void FsdpState::onGradient(int u, int f, int s) {
  // The round ended (the runtime's communicator was aborted: a failure elsewhere): the rest of
  // this backward would be dropped; it ends here instead of at its next collective.
  if (comm_.aborted()) {
    throw CommAborted("backward: the communicator was aborted; the rest of this step is dropped");
  }
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
  if (++unit.seenGrads == unit.expectedGrads * std::max(1, unit.checkpointedCalls)) gradientsLanded(u);
}

void FsdpState::onCheckpointedCall(int u) {
  auto& unit = units_[static_cast<std::size_t>(u)];
  ++unit.checkpointedCalls;
  ++unit.pendingRecomputes;
}

void FsdpState::onRecomputeDone(int u) {
  --units_[static_cast<std::size_t>(u)].pendingRecomputes;
  releaseIfDone(u);
}

void FsdpState::gradientsLanded(int u) {
  if (!reduceUnit(u)) return;
  releaseIfDone(u);
  if (options_.backwardPrefetch == BackwardPrefetch::kPost) prefetch(neighbour(forwardOrder_, u, -1));
}

bool FsdpState::reduceUnit(int u) {
  auto& unit = units_[static_cast<std::size_t>(u)];
  if (unit.reduced) return false;
  unit.reduced = true;
  if (!noSync_) {
    for (std::size_t f = 0; f < unit.flats.size(); ++f) reduceGradient(u, static_cast<int>(f));
  }
  drainPending(/*wait=*/false);
  return true;
}

void FsdpState::releaseIfDone(int u) {
  auto& unit = units_[static_cast<std::size_t>(u)];
  if (unit.postBackwardDone) return;
  if (!unit.reduced && unit.expectedGrads > 0) return;  // trainable gradients still to come
  if (unit.pendingRecomputes > 0) return;                // a recompute still reads the parameters
  if (unit.hasFrozen && (unit.frozenNeedsEnd || unit.pendingInputGrads > 0)) return;
  unit.postBackwardDone = true;
  reshard(u);
}

void FsdpState::onInputGradient(int u, std::uint64_t generation) {
  if (generation != generation_) return;  // a hook of an earlier, abandoned backward
  --units_[static_cast<std::size_t>(u)].pendingInputGrads;
  releaseIfDone(u);
}

void FsdpState::reduceGradient(int u, int f) {
  auto& unit = units_[static_cast<std::size_t>(u)];
  auto& flat = unit.flats[static_cast<std::size_t>(f)];
  if (!flat.fullGrad.defined()) return;
  at::NoGradGuard noGrad;
  // Parameters that got no gradient, and the padding, count as zero.
  for (std::size_t s = 0; s < flat.slots.size(); ++s) {
    if (flat.written[s] == 0) flat.fullGrad.narrow(0, flat.slots[s].offset, flat.slots[s].numel).zero_();
  }
  if (flat.paddedNumel > flat.numel) {
    flat.fullGrad.narrow(0, flat.numel, flat.paddedNumel - flat.numel).zero_();
  }
  ++unit.reductions;
  at::Tensor input = flat.fullGrad;
  flat.fullGrad = at::Tensor();  // the queued operation holds it until it is done
  if (input.scalar_type() != reduceDtype_) input = input.to(reduceDtype_);
  const auto& unitPath = units_[static_cast<std::size_t>(u)].path;
  const CommTag tag("backward", unitPath.empty() ? "(root)" : unitPath);
  if (shardComm_ != nullptr) {
    at::Tensor output = emptyBlock(flat.shardNumel, input.options());
    pending_.push_back({u, f, output, shardComm_->reduceScatter(input, output, ReduceOp::kAverage),
                        options_.strategy == ShardingStrategy::kHybridShard && gradSyncComm_ != nullptr});
  } else if (gradSyncComm_ != nullptr) {
    pending_.push_back({u, f, input, gradSyncComm_->allReduce(input, ReduceOp::kAverage)});
  } else {
    pending_.push_back({u, f, input, Work(readyFuture())});
  }
}

// The engine's end-of-backward callback: reduce what the hooks did not, then hand every
// reduced gradient to its shard.
void FsdpState::finishBackward() {
  for (int u = static_cast<int>(units_.size()) - 1; u >= 0; --u) {
    const auto& unit = units_[static_cast<std::size_t>(u)];
    const bool hasGrad = std::any_of(unit.flats.begin(), unit.flats.end(),
                                     [](const FlatParam& f) { return f.fullGrad.defined(); });
    if (!(unit.preBackwardDone || hasGrad)) continue;
    if (!reduceUnit(u) && hasGrad && !noSync_) {
      // Gradients that landed after the unit's reduction (a use the counts did not foresee):
      // reduced now, never carried into the next step.
      for (std::size_t f = 0; f < unit.flats.size(); ++f) reduceGradient(u, static_cast<int>(f));
    }
  }
  // Across nodes (HYBRID_SHARD): every all-reduce issued, in order, before waiting on any.
  for (auto& p : pending_) startReplicaSync(p);
  drainPending(/*wait=*/true);
  for (std::size_t u = 0; u < units_.size(); ++u) reshard(static_cast<int>(u));
  resetBackwardState();
  // Last: if anything above threw, the next forward finds the flag set and cleans up.
  callbackQueued_ = false;
}

void FsdpState::startReplicaSync(PendingReduce& p) {
  if (!p.needsReplicaSync) return;
  p.work.wait();
  const auto& unitPath = units_[static_cast<std::size_t>(p.unit)].path;
  const CommTag tag("backward replicas", unitPath.empty() ? "(root)" : unitPath);
  p.work = gradSyncComm_->allReduce(p.output, ReduceOp::kAverage);
  p.needsReplicaSync = false;
}

// Folds finished reductions into the shard gradients, oldest first, releasing their
// buffers as soon as possible (without waiting: only those already done). Collectives are
// issued in the same order on every rank because only the oldest entry moves on.
void FsdpState::drainPending(bool wait) {
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
    at::Tensor grad = p.output.scalar_type() == shard.scalar_type() && p.output.device() == shard.device()
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

void FsdpState::resetBackwardState() {
  ++generation_;  // hooks registered before this point belong to a backward that is over
  for (auto& unit : units_) {
    unit.seenGrads = 0;
    unit.pendingInputGrads = 0;
    unit.checkpointedCalls = 0;
    unit.pendingRecomputes = 0;
    unit.frozenNeedsEnd = false;
    unit.preBackwardDone = false;
    unit.reduced = false;
    unit.postBackwardDone = false;
  }
}

void FsdpState::abandonBackward() {
  log::warn("fsdp: the previous backward did not finish (it threw); the gradients it had not "
            "reduced yet are dropped");
  // Every reduction issued is completed, on every rank alike (the cross-node ones of
  // HYBRID_SHARD too: a peer may have issued its part already), and its result dropped: this
  // runs in the next forward, after the user's zero_grad().
  for (auto& p : pending_) startReplicaSync(p);
  for (auto& p : pending_) p.work.wait();
  pending_.clear();
  for (std::size_t u = 0; u < units_.size(); ++u) {
    for (auto& flat : units_[u].flats) flat.fullGrad = at::Tensor();
    reshard(static_cast<int>(u));
  }
  resetBackwardState();
  callbackQueued_ = false;
}

}  // namespace fsdp::worker::detail
