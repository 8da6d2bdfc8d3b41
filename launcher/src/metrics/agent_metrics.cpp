// The agent's /metrics (agent_metrics.hpp).
#include "agent_metrics.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <optional>

#include "fsdp/common/flight_ring.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/common/prometheus_text.hpp"
#include "fsdp/rendezvous/server_metrics.hpp"

namespace fsdp::launcher::detail {
namespace {

// What /proc says of a worker process now.
struct ProcessView {
  std::string state = "exited";  // running, stopped, exited
  double rssBytes = 0;
};

ProcessView viewProcess(pid_t pid) {
  ProcessView v;
  if (pid <= 0) return v;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return v;
  const auto close = text.rfind(')');  // the command may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= text.size()) return v;
  const char state = text[close + 2];
  if (state == 'Z' || state == 'X') return v;
  v.state = state == 'T' || state == 't' ? "stopped" : "running";
  std::ifstream statm("/proc/" + std::to_string(pid) + "/statm");
  long pages = 0, resident = 0;
  if (statm >> pages >> resident) v.rssBytes = static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  return v;
}

double seconds(std::int64_t ns) { return static_cast<double>(ns) / 1e9; }

}  // namespace

AgentMetrics::AgentMetrics(std::string job, std::string node) : job_(std::move(job)), node_(std::move(node)) {}

void AgentMetrics::roundStarted(int round, int nodeRank, int worldSize, int restarts, std::vector<WatchedWorker> workers,
                                const char* watchdog) {
  std::scoped_lock lock(mutex_);
  round_ = round;
  nodeRank_ = nodeRank;
  worldSize_ = worldSize;
  restarts_ = restarts;
  ++rounds_;
  workers_ = std::move(workers);
  watchdog_ = watchdog;
  ended_ = false;
  failed_ = 0;
}

void AgentMetrics::hangReported() {
  std::scoped_lock lock(mutex_);
  watchdog_ = "reported";
}

void AgentMetrics::recovered(const std::string& path, int workers) {
  std::scoped_lock lock(mutex_);
  (path == "in_process" ? recoveredInProcess_ : recoveredAsProcess_) += workers;
}

void AgentMetrics::roundEnded(int failed) {
  std::scoped_lock lock(mutex_);
  ended_ = true;
  failed_ = failed;
  if (watchdog_ == "watching") watchdog_ = "off";
}

void AgentMetrics::setNode(std::string node) {
  std::scoped_lock lock(mutex_);
  node_ = std::move(node);
}

void AgentMetrics::setServer(const rendezvous::StoreServer* server) {
  std::scoped_lock lock(mutex_);
  server_ = server;
}

void AgentMetrics::setKeeper(const SnapshotKeeper* keeper) {
  std::scoped_lock lock(mutex_);
  keeper_ = keeper;
}

std::string AgentMetrics::render() const {
  std::scoped_lock lock(mutex_);
  prom::TextWriter out;
  const prom::Labels node{{"job", job_}, {"node", node_}};

  struct Worker {
    prom::Labels labels;
    flight::Reading ring;
    ProcessView process;
    std::optional<KeeperStats::Newest> snapshot;
  };
  const KeeperStats keeper = keeper_ != nullptr ? keeper_->stats() : KeeperStats{};
  std::vector<Worker> workers;
  for (const auto& w : workers_) {
    Worker v{.labels = {{"job", job_}, {"node", node_}, {"rank", std::to_string(w.rank)},
                        {"local_rank", std::to_string(w.localRank)}}};
    if (w.ring) v.ring = w.ring->read(0);
    if (!ended_) v.process = viewProcess(w.pid);
    if (const auto it = keeper.newest.find(w.rank); it != keeper.newest.end()) v.snapshot = it->second;
    workers.push_back(std::move(v));
  }
  const auto each = [&](const char* name, const char* type, const char* help, auto value) {
    out.family(name, type, help);
    for (const auto& w : workers) {
      if (const std::optional<double> v = value(w)) out.sample(w.labels, *v);
    }
  };
  using Opt = std::optional<double>;
  const auto timed = [](const Worker& w) { return w.ring.attached && w.ring.timing.steps > 0; };

  each("fsdprun_worker_up", "gauge", "1 while the worker process runs (a stopped one too), else 0",
       [](const Worker& w) -> Opt { return w.process.state != "exited" ? 1.0 : 0.0; });
  each("fsdprun_worker_step", "gauge", "The last step the worker marked (fsdp::markProgress, the Trainer's steps)",
       [](const Worker& w) -> Opt {
         if (!w.ring.attached || w.ring.progress.step < 0) return std::nullopt;
         return static_cast<double>(w.ring.progress.step);
       });
  each("fsdprun_worker_steps_total", "counter", "Steps the worker marked since it started",
       [](const Worker& w) -> Opt { return w.ring.attached ? Opt(static_cast<double>(w.ring.timing.steps)) : Opt(); });
  each("fsdprun_worker_seconds_since_progress", "gauge",
       "Seconds since the worker last marked progress or completed a collective",
       [](const Worker& w) -> Opt {
         const std::int64_t last = std::max(w.ring.progress.lastNs, w.ring.lastCompletedNs);
         if (!w.ring.attached || last == 0) return std::nullopt;
         return std::max(0.0, seconds(flight::nowNs() - last));
       });
  out.family("fsdprun_worker_last_step_seconds", "gauge",
             "The last step's wall time (part=total) and its split: compute, collective_wait (at least one "
             "collective in flight), data (waiting for input)");
  for (const auto& w : workers) {
    if (!timed(w)) continue;
    const auto& t = w.ring.timing;
    const std::pair<const char*, std::int64_t> parts[] = {
        {"total", t.lastStepNs}, {"compute", t.lastComputeNs()}, {"collective_wait", t.lastWaitNs}, {"data", t.lastDataNs}};
    for (const auto& [part, ns] : parts) {
      auto labels = w.labels;
      labels.push_back({"part", part});
      out.sample(labels, seconds(ns));
    }
  }
  out.family("fsdprun_worker_step_seconds_total", "counter",
             "Time in marked steps since the worker started, by part (rate() of each over rate(steps) is the mean split)");
  for (const auto& w : workers) {
    if (!timed(w)) continue;
    const auto& t = w.ring.timing;
    const std::pair<const char*, std::int64_t> parts[] = {
        {"total", t.stepNs}, {"compute", t.computeNs()}, {"collective_wait", t.waitNs}, {"data", t.dataNs}};
    for (const auto& [part, ns] : parts) {
      auto labels = w.labels;
      labels.push_back({"part", part});
      out.sample(labels, seconds(ns));
    }
  }
  each("fsdprun_worker_samples_per_second", "gauge", "This rank's samples in the last step over its wall time",
       [&](const Worker& w) -> Opt {
         if (!timed(w) || w.ring.timing.lastStepNs <= 0 || w.ring.timing.samples == 0) return std::nullopt;
         return static_cast<double>(w.ring.timing.lastSamples) / seconds(w.ring.timing.lastStepNs);
       });
  each("fsdprun_worker_tokens_per_second", "gauge", "This rank's tokens in the last step over its wall time",
       [&](const Worker& w) -> Opt {
         if (!timed(w) || w.ring.timing.lastStepNs <= 0 || w.ring.timing.tokens == 0) return std::nullopt;
         return static_cast<double>(w.ring.timing.lastTokens) / seconds(w.ring.timing.lastStepNs);
       });
  each("fsdprun_worker_samples_total", "counter", "Samples this rank trained on (as the program reported)",
       [](const Worker& w) -> Opt { return w.ring.attached ? Opt(static_cast<double>(w.ring.timing.samples)) : Opt(); });
  each("fsdprun_worker_tokens_total", "counter", "Tokens this rank trained on (as the program reported)",
       [](const Worker& w) -> Opt { return w.ring.attached ? Opt(static_cast<double>(w.ring.timing.tokens)) : Opt(); });
  each("fsdprun_worker_loss", "gauge", "The loss of the last step on this rank (as the program reported)",
       [](const Worker& w) -> Opt {
         if (!w.ring.attached || std::isnan(w.ring.timing.loss) || w.ring.timing.samples == 0) return std::nullopt;
         return w.ring.timing.loss;
       });
  each("fsdprun_worker_collectives_total", "counter", "Collectives the worker issued",
       [](const Worker& w) -> Opt { return w.ring.attached ? Opt(static_cast<double>(w.ring.issued)) : Opt(); });
  each("fsdprun_worker_collective_bytes_total", "counter", "Bytes of the collectives the worker issued (whole tensors)",
       [](const Worker& w) -> Opt { return w.ring.attached ? Opt(static_cast<double>(w.ring.timing.bytes)) : Opt(); });
  each("fsdprun_worker_straggler_score", "gauge",
       "This rank's compute over the median rank's at the last straggler report (1: typical)",
       [](const Worker& w) -> Opt { return w.ring.timing.straggler > 0 ? Opt(w.ring.timing.straggler) : Opt(); });
  each("fsdprun_worker_snapshot_step", "gauge", "The step of the newest in-memory snapshot this node holds of the rank",
       [](const Worker& w) -> Opt { return w.snapshot ? Opt(static_cast<double>(w.snapshot->step)) : Opt(); });
  each("fsdprun_worker_snapshot_age_seconds", "gauge", "Seconds since this node received the rank's newest snapshot",
       [](const Worker& w) -> Opt {
         if (!w.snapshot) return std::nullopt;
         return std::chrono::duration<double>(std::chrono::system_clock::now() - w.snapshot->at).count();
       });
  each("fsdprun_worker_resident_memory_bytes", "gauge", "Resident memory of the worker process",
       [](const Worker& w) -> Opt { return w.process.state != "exited" ? Opt(w.process.rssBytes) : Opt(); });

  const auto nodeGauge = [&](const char* name, const char* type, const char* help, double value) {
    out.family(name, type, help);
    out.sample(node, value);
  };
  nodeGauge("fsdprun_node_restarts_total", "counter", "Restarts of the job so far (TORCHELASTIC_RESTART_COUNT)", restarts_);
  nodeGauge("fsdprun_node_rounds_total", "counter", "Rounds this node's workers ran in", rounds_);
  nodeGauge("fsdprun_node_round", "gauge", "The rendezvous round this node is in (-1: none yet)", round_);
  nodeGauge("fsdprun_node_rank", "gauge", "This node's rank in the round (-1: none yet)", nodeRank_);
  nodeGauge("fsdprun_node_world_size", "gauge", "Ranks in the round", worldSize_);
  out.family("fsdprun_node_workers", "gauge", "This node's workers by state");
  {
    int running = 0, stopped = 0, exited = 0;
    for (const auto& w : workers) {
      (w.process.state == "running" ? running : w.process.state == "stopped" ? stopped : exited)++;
    }
    const std::pair<const char*, int> states[] = {{"running", running}, {"stopped", stopped}, {"exited", exited},
                                                 {"failed", ended_ ? failed_ : 0}};
    for (const auto& [state, count] : states) {
      auto labels = node;
      labels.push_back({"state", state});
      out.sample(labels, count);
    }
  }
  out.family("fsdprun_node_worker_recoveries_total", "counter",
             "Workers of this node that went on after a failure, by path: in_process (re-formed, the "
             "process kept: --restart_mode auto) or process (started anew)");
  for (const auto& [path, count] : {std::pair<const char*, int>{"in_process", recoveredInProcess_},
                                    std::pair<const char*, int>{"process", recoveredAsProcess_}}) {
    auto labels = node;
    labels.push_back({"path", path});
    out.sample(labels, count);
  }
  out.family("fsdprun_node_hang_watchdog", "gauge",
             "The hang watchdog's state: watching (a round runs), reported (it found a hang), off");
  for (const char* state : {"watching", "reported", "off"}) {
    auto labels = node;
    labels.push_back({"state", state});
    out.sample(labels, watchdog_ == state ? 1 : 0);
  }
  double worst = 0;
  for (const auto& w : workers) worst = std::max(worst, w.ring.timing.straggler);
  if (worst > 0) nodeGauge("fsdprun_node_straggler_score", "gauge", "The highest straggler score of this node's ranks", worst);
  nodeGauge("fsdprun_node_snapshot_bytes", "gauge", "Bytes of in-memory snapshots this node holds (its own and its peer's)",
            static_cast<double>(keeper.bytesHeld));
  if (server_ != nullptr) {
    try {
      rendezvous::writeServerMetrics(out, server_->stats());
    } catch (const std::exception& e) {
      log::debug("metrics: the rendezvous server's figures: {}", e.what());
    }
  }
  return out.take();
}

}  // namespace fsdp::launcher::detail
