// --restart_mode auto (the default): survivors never exit. When a round ends with a failure
// elsewhere, the workers that can re-form in process (their libfsdp loop told their control
// channel so) are kept: told to abort their communicators, spared the stop signal, and handed
// the next round, in which only the failed (or stuck) workers start as new processes. The
// worker's side is worker/src/reform/.
#include <algorithm>
#include <string>

#include "../hang/stacks.hpp"
#include "agent_state.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::launcher::detail {
namespace {

std::string rankList(const std::set<int>& localRanks, int offset) {
  std::string out;
  for (int r : localRanks) out += (out.empty() ? "" : ", ") + std::to_string(offset + r);
  return out;
}

}  // namespace

std::set<int> Agent::keepSurvivors(WorkerGroup& group, const std::string& why, const std::set<int>& stuck) {
  // Without a restart left the job ends: nothing to re-form for.
  if (!reformMode() || restarts_ >= options_.maxRestarts) return {};
  std::set<int> keep = group.reformable();
  for (int r : stuck) keep.erase(r);
  // A stopped process (SIGSTOP, SIGTSTP) cannot take the notice: the new round would wait for it
  // until the hang timeout. It starts again, as every worker would in process mode.
  std::set<int> stopped;
  for (const auto& w : group.watched()) {
    if (keep.contains(w.localRank) && processState(w.pid) == 'T') stopped.insert(w.localRank);
  }
  for (int r : stopped) keep.erase(r);
  const int offset = last_ ? last_->rankOffset : 0;
  // What cannot survive in process says why, one line for each reason.
  const std::set<int> reforming = group.reforming();
  std::set<int> secondFailure;
  std::set<int> others;
  for (int r : group.runningLocalRanks()) {
    if (keep.contains(r) || stuck.contains(r) || stopped.contains(r)) continue;
    (reforming.contains(r) ? secondFailure : others).insert(r);
  }
  if (!keep.empty()) {
    group.notifyAbort(keep, why);
    log::info("rank(s) {} keep their processes and re-form in process", rankList(keep, offset));
  }
  if (!stuck.empty()) log::warn("rank(s) {} failed or are stuck: they start again as processes", rankList(stuck, offset));
  if (!stopped.empty()) {
    log::warn("rank(s) {} restart as processes: stopped (SIGSTOP or SIGTSTP), they cannot re-form in process",
              rankList(stopped, offset));
  }
  if (!secondFailure.empty()) {
    log::warn("rank(s) {} restart as processes: a second failure while they re-formed in process "
              "(their round had not resumed training)",
              rankList(secondFailure, offset));
  }
  if (!others.empty()) {
    log::warn("rank(s) {} restart as processes: not in a training loop that re-forms in process "
              "(a program without libfsdp's Trainer or ReformScope, a PyTorch script, a model the "
              "runtime cannot rebuild (HYBRID_SHARD, a second FSDP model: the worker says which), "
              "no snapshot or checkpoint to restore, or still starting)",
              rankList(others, offset));
  }
  return keep;
}

std::unique_ptr<WorkerGroup> Agent::reformKept(const Assignment& a, const std::vector<WorkerSpec>& specs,
                                               const std::string& attemptDir) {
  std::unique_ptr<WorkerGroup> group = std::move(kept_);
  const std::set<int> kept = std::exchange(keptRanks_, {});
  std::string why;
  // The failed workers' places go to their spares where --standby started them.
  noteSpareExits();
  if (!group->reform(specs, kept, attemptDir, why, standby_.get())) {
    log::warn("round {}: the survivors cannot re-form in process ({}): they start again as processes", a.round, why);
    return nullptr;  // stops them, with their group
  }
  log::warn("round {}: rank(s) {} re-form in process; {} worker(s) start as new processes", a.round,
            rankList(kept, a.rankOffset), specs.size() - std::min(specs.size(), kept.size()));
  if (metrics_) metrics_->recovered("in_process", static_cast<int>(kept.size()));
  return group;
}

}  // namespace fsdp::launcher::detail
