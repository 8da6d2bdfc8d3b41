#pragma once
// Stragglers among the ranks of PyTorch scripts (`import fsdprun`), which run no libfsdp monitor
// of their own and cannot reach the job's store: their agents judge them from the step split the
// module writes into each worker's flight ring (fsdprun.mark_progress, report_step, data_wait).
// Every `every` of a rank's steps (or more: the steps since the agent's last look, once a
// second), its agent publishes the window's means in the store; the agent
// of rank 0 reads every rank's, names the slow ones in its log (the lines libfsdp's rank 0
// writes) and publishes each rank's factor, which each agent writes into its workers' rings for
// /metrics (fsdprun_worker_straggler_score). libfsdp programs are left to their own monitor.
//
// Driven from the hang watchdog's thread and store connection (poll() each pass of its loop).
// What it can see: compute (a step's wall time less data waits) and data; DDP's allreduces
// overlap the backward inside compute, so a rank slowed in its backward shows, one slowed only
// in communication does not.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "../workers/worker_group.hpp"
#include "fsdp/common/straggler_verdict.hpp"
#include "fsdp/rendezvous/store_client.hpp"

namespace fsdp::launcher::detail {

class PythonStragglers {
 public:
  PythonStragglers(stragglers::Options options, int round, int worldSize, std::string host,
                   std::vector<WatchedWorker> workers);
  // Publishes the windows this node's Python ranks completed; on rank 0's node judges those every
  // rank has published; writes published factors into the local rings. Never blocks on others;
  // reaches the store only once a local worker is known to be a Python one (a libfsdp job costs
  // the store nothing).
  void poll(rendezvous::StoreClient& store);

 private:
  struct Local {
    WatchedWorker worker;
    bool python = false;  // the module's stack marker seen (judged here), or not yet
    std::int64_t window = 0;  // the next window to publish
    std::int64_t steps = 0, stepNs = 0, waitNs = 0, dataNs = 0;  // the ring's totals at its start
  };
  std::string key(std::int64_t window, const std::string& what) const;
  void publish(rendezvous::StoreClient& store, Local& l);
  void judge(rendezvous::StoreClient& store);
  void applyFactors(rendezvous::StoreClient& store);

  const stragglers::Options options_;
  const int round_;
  const int world_;
  const std::string host_;
  std::vector<Local> locals_;
  std::int64_t nextJudged_ = 0;   // rank 0's node: the next window to judge
  std::int64_t nextFactors_ = 0;  // windows before this one's factors are applied
  std::map<int, bool> named_;
};

}  // namespace fsdp::launcher::detail
