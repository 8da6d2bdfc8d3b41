// FSDP's side of an in-process re-formation (reform.hpp): the interrupted step dropped, the
// collective of construction replayed with the round's new processes (as a survivor), the
// shards laid out again when the world changed size.
#include <ATen/Functions.h>

#include <algorithm>

#include "fsdp/builder.hpp"
#include "fsdp/state.hpp"
#include "fsdp/worker/flight_recorder.hpp"

namespace fsdp::worker::detail {

void FsdpState::abandonAfterAbort() {
  // Nothing issued on the aborted communicators completes: its Works are failed or never end.
  pending_.clear();
  for (auto& unit : units_) {
    unit.gathers.clear();
    for (auto& flat : unit.flats) {
      flat.gatherSource = at::Tensor();
      flat.fullGrad = at::Tensor();
      std::fill(flat.written.begin(), flat.written.end(), 0);
      // A backward ended early (a gradient hook saw the abort) leaves gradients that no hook
      // took: the next backward would add to them.
      for (auto& slot : flat.slots) slot.param.mutable_grad() = at::Tensor();
      flat.full.free();
    }
    unit.state = UnitState::kSharded;
    for (const auto& flat : unit.flats) {
      if (flat.full.aliasing()) unit.state = UnitState::kUnsharded;
    }
  }
  resetBackwardState();
  callbackQueued_ = false;
  noSync_ = false;
  forwardOrder_.clear();
}

void FsdpState::replayConstruction() {
  // As a survivor: the new processes' constructors then broadcast nothing (builder.cpp).
  if (constructionDigest_.defined()) {
    compareModelDigests(comm_, constructionDigest_, CheckedBy::kSurvivor);
  }
}

bool FsdpState::relayout() {
  // The shard group as chooseGroups() makes it for this world.
  int size = 1;
  int rank = 0;
  switch (options_.strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      shardComm_ = comm_.size() > 1 ? &comm_ : nullptr;
      size = comm_.size();
      rank = comm_.rank();
      break;
    case ShardingStrategy::kNoShard:
      gradSyncComm_ = comm_.size() > 1 ? &comm_ : nullptr;
      break;
    case ShardingStrategy::kHybridShard:
      return false;  // its groups are the program's (reform() refuses such a model first)
  }
  const bool resized = size != shardSize_;
  shardSize_ = size;
  shardRank_ = rank;
  if (!resized) return false;
  // Every flat parameter laid out as the constructor lays it out for `size` ranks. The shard
  // keeps its tensor (the optimizer holds it) and gets memory of the new size; its values, and
  // the optimizer's state for it, are the restore's to write. The original parameters stay
  // views of the (new) full buffer, with their shapes: their gradient hooks hold.
  at::NoGradGuard noGrad;
  for (auto& unit : units_) {
    for (auto& flat : unit.flats) {
      const auto dtype = flat.shard.scalar_type();
      flat.paddedNumel = (flat.numel + size - 1) / size * size;
      flat.shardNumel = flat.paddedNumel / size;
      flat.shard.mutable_grad() = at::Tensor();
      if (size == 1 && computeDtype_ == dtype && !offload_) {
        flat.full = FullBuffer::permanent(at::zeros({flat.paddedNumel}, flat.shard.options()));
        flat.shard.set_data(flat.full.flat());
      } else {
        flat.full = FullBuffer(flat.paddedNumel, computeDtype_, device_);
        flat.full.allocate();  // views are made over allocated memory (set_ checks the size)
        auto shard = at::zeros({flat.shardNumel}, flat.shard.options());
        flat.shard.set_data(offload_ ? shard.pin_memory() : shard);
      }
      for (auto& slot : flat.slots) slot.param.set_data(flat.full.view(slot.offset, slot.shape));
      flat.full.free();
    }
    const bool aliasing = std::all_of(unit.flats.begin(), unit.flats.end(),
                                      [](const FlatParam& f) { return f.full.aliasing(); });
    unit.state = aliasing ? UnitState::kUnsharded : UnitState::kSharded;
  }
  return true;
}

}  // namespace fsdp::worker::detail
