// FSDP's side of an in-process re-formation (reform.hpp): the interrupted step dropped, the
// collectives of construction replayed with the round's new processes.
#include <ATen/Functions.h>

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
  if (constructionDigest_.defined()) compareModelDigests(comm_, constructionDigest_);
  if (comm_.size() == 1) return;
  at::NoGradGuard noGrad;
  const CommTag tag("init", "sync module states (re-formed)");
  for (std::size_t i = 0; i < constructionBroadcasts_.size(); ++i) {
    auto scratch = at::zeros(constructionShapes_[i], constructionBroadcasts_[i]);
    comm_.broadcast(scratch, 0).wait();
  }
}

}  // namespace fsdp::worker::detail
