#pragma once
// The agent's hang watchdog for one round. Its thread reads the node's flight recorder rings
// and, when no local rank has completed a collective or marked progress for the hang timeout
// (while every local worker still runs), declares the job hung under a key of the rendezvous
// store. Every node's watchdog waits on that key server side (no polling): whoever declares,
// all nodes then publish their ranks' records, read everyone's, agree from the same records on
// the lagging ranks, take the stacks of their own lagging ranks, publish those and read them
// all, so that every node prints the same report. Every exchange is bounded; a node that sends
// nothing is named in the report as unknown.
//
// Thread-safety: the agent's thread calls fd() and take(); the watchdog's own thread does the rest.

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../metrics/python_stragglers.hpp"
#include "../workers/worker_group.hpp"

namespace fsdp::rendezvous {
class StoreClient;
}

namespace fsdp::launcher::detail {

struct WatchdogOptions {
  std::optional<std::chrono::milliseconds> timeout;  // nullopt: auto (hangTimeoutFor)
  int round = 0;
  // When the agent began the round (flight::nowNs), before it handed the round to the workers it
  // kept: a ring attached earlier is a survivor's that has not re-formed into this round yet.
  // 0: every attached ring counts as this round's.
  std::int64_t roundStartNs = 0;
  int nodeRank = 0;
  int nnodes = 1;
  int worldSize = 1;
  std::string host;  // this node, for the report
  std::string storeHost;
  int storePort = 0;
  std::string runId;
  std::string token;
  std::chrono::milliseconds exchangeTimeout{10000};
  std::chrono::milliseconds stackTimeout{5000};
};

struct HangReport {
  std::string text;               // the whole report, stacks included
  std::set<int> lagging;
  bool desync = false;
  std::string viewsJson;          // every rank's view (rankViewsToJson), for error.json
  double stalledSeconds = 0;
  // The first lagging rank, where it runs (-1 / "" when the records name none).
  int firstRank = -1;
  std::string firstHost;
  long firstPid = -1;
  std::string summary;            // the report's first finding, for one-line messages
};

// A rank inside its own long operation (fsdp::LongOperation: writing or reading its checkpoint
// files) holds back the declaration on every node, for up to kBusyFactor times the hang timeout:
// its peers waiting for it are no hang. Each node publishes its ranks' long operations.
constexpr int kBusyFactor = 10;

// The auto rule: 10 times the longest interval between two progress marks seen on any rank,
// at least 60 s; kBeforeFirstMark while no rank has marked twice. An explicit timeout applies
// once some rank has marked progress; before that, at least kBeforeFirstMark.
constexpr std::chrono::milliseconds kBeforeFirstMark{180000};
std::chrono::milliseconds autoHangTimeout(std::int64_t longestGapNs, std::int64_t marks);

class HangWatchdog {
 public:
  // Starts the thread; throws Error when the store cannot be reached.
  HangWatchdog(WatchdogOptions options, std::vector<WatchedWorker> workers);
  ~HangWatchdog();
  HangWatchdog(const HangWatchdog&) = delete;
  HangWatchdog& operator=(const HangWatchdog&) = delete;

  // Readable once a report is ready (for poll()).
  int fd() const { return notify_[0]; }
  std::optional<HangReport> take();
  // Tells the thread to end (one store write; no waiting): a round that is over needs no
  // watchdog, and the destructor then has nothing left to wait for.
  void requestStop();

 private:
  void run();
  // A rank inside its own long operation, on this node or another.
  struct Busy {
    int rank = -1;
    std::string host;
    std::int64_t sinceNs = 0;
    std::string what;
  };
  struct Quiet {
    std::int64_t quietNs = 0;  // since the node's last progress or completed collective
    std::chrono::milliseconds timeout{0};
    std::optional<Busy> busy;  // the local rank inside a long operation the longest
  };
  // How long the node has been quiet, and the timeout that applies; nullopt when the watchdog
  // cannot judge (no ring attached, a worker gone).
  std::optional<Quiet> quiet() const;
  // Publishes this node's long operation when it changed since the last call.
  void publishBusy(const std::optional<Busy>& busy);
  // The job's rank inside a long operation the longest (every node's published one).
  std::optional<Busy> jobBusy(const std::optional<Busy>& local);
  HangReport collect(const std::string& declaredBy, std::int64_t quietNs, std::chrono::milliseconds timeout,
                     const std::string& busyNote);
  std::string key(const std::string& what) const;

  WatchdogOptions options_;
  std::vector<WatchedWorker> workers_;
  // PyTorch scripts' straggler windows ride on this thread and its store connection; null when
  // FSDPRUN_STRAGGLER_EVERY is 0 or unreadable.
  std::unique_ptr<PythonStragglers> stragglers_;
  std::unique_ptr<rendezvous::StoreClient> store_;    // the thread's
  int notify_[2] = {-1, -1};
  std::mutex mutex_;
  std::optional<HangReport> report_;
  std::atomic<bool> stopping_{false};
  // Quiet time counts from no earlier than this (the round's start, a suspension's end).
  std::atomic<std::int64_t> baselineNs_{flight::nowNs()};
  std::string publishedBusy_;  // what publishBusy() last wrote ("": none)
  std::thread thread_;
};

}  // namespace fsdp::launcher::detail
