#pragma once
// What an agent's /metrics shows (--metrics_port), in the Prometheus text format: each worker's
// figures, read from its flight recorder ring at scrape time (the worker does nothing for a
// scrape), the node's state as the agent thread last set it, and the rendezvous server's figures
// where this agent serves it. Private to the launcher.
//
// Thread-safety: the setters come from the agent's thread, render() from the HTTP server's; one
// mutex. The server and keeper given must stay alive until they are replaced (set to nullptr
// before they go).

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/launcher/snapshot_keeper.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "../workers/worker_group.hpp"

namespace fsdp::launcher::detail {

class AgentMetrics {
 public:
  AgentMetrics(std::string job, std::string node);

  // A round's workers started (`watchdog`: "watching", or "off" without a hang watchdog).
  void roundStarted(int round, int nodeRank, int worldSize, int restarts, std::vector<WatchedWorker> workers,
                    const char* watchdog);
  // The hang watchdog reported a hang (the round ends with it).
  void hangReported();
  // After a failure, `workers` of this node went on by `path`: "in_process" (re-formed, their
  // processes kept) or "process" (started anew).
  void recovered(const std::string& path, int workers);
  // The round's workers are all gone; `failed`: how many of them failed.
  void roundEnded(int failed);
  void setNode(std::string node);
  void setServer(const rendezvous::StoreServer* server);
  void setKeeper(const SnapshotKeeper* keeper);

  std::string render() const;

 private:
  mutable std::mutex mutex_;
  const std::string job_;
  std::string node_;
  int round_ = -1;
  int nodeRank_ = -1;
  int worldSize_ = 0;
  int restarts_ = 0;
  int rounds_ = 0;  // rounds this agent's workers ran in
  std::string watchdog_ = "off";
  bool ended_ = false;
  int failed_ = 0;
  int recoveredInProcess_ = 0;
  int recoveredAsProcess_ = 0;
  std::vector<WatchedWorker> workers_;
  const rendezvous::StoreServer* server_ = nullptr;
  const SnapshotKeeper* keeper_ = nullptr;
};

}  // namespace fsdp::launcher::detail
