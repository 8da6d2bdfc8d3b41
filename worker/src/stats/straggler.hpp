#pragma once
// Stragglers: which rank sets the pace of the job. Every rank splits each step into compute,
// waiting in collectives and waiting for data (FlightRecorder's step timing); fast ranks wait for
// slow ones, so the rank whose compute stands out is the slow one, found without any collective.
//
// Every `every` steps each rank publishes its window's means in the store (from a thread of its
// own, on a connection of its own: the training thread only hands a few numbers over). Rank 0
// reads every rank's window, names the ranks whose compute is `factor` times the median of the
// other ranks' (with two ranks, the other one's), and at least 1 ms a step more, in one log line
// each, reports a named rank recovered once it is back under the midpoint (1.25x for 1.5x), and
// publishes every rank's factor, which each
// rank writes into its ring for the agent's /metrics (fsdprun_worker_straggler_score).
//
//   FSDPRUN_STRAGGLER_EVERY   steps per report (default 20; 0: off)
//   FSDPRUN_STRAGGLER_FACTOR  times the median compute that names a rank (default 1.5; > 1)
//
// Private to libfsdp. Thread-safety: onStep() from the marking thread; takeEvents() and
// summary() from any thread.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/common/straggler_verdict.hpp"
#include "fsdp/rendezvous/store_client.hpp"

namespace fsdp::worker::detail {

// The verdict's types and rules, shared with the agent (which judges PyTorch scripts' ranks).
using StragglerOptions = stragglers::Options;
using WindowFigures = stragglers::WindowFigures;
using StragglerEvent = stragglers::Event;
using WindowVerdict = stragglers::WindowVerdict;
using stragglers::judgeWindow;
inline StragglerOptions stragglerOptionsFromEnv() { return stragglers::optionsFromEnv(); }

class StragglerMonitor {
 public:
  using Connect = std::function<std::unique_ptr<rendezvous::StoreClient>()>;
  // `prefix`: the round's store prefix. `connect` opens the monitor's own store connection (on
  // its thread, when the first window is due).
  StragglerMonitor(StragglerOptions options, int rank, int world, std::string node, std::string prefix,
                   Connect connect);
  ~StragglerMonitor();
  StragglerMonitor(const StragglerMonitor&) = delete;
  StragglerMonitor& operator=(const StragglerMonitor&) = delete;

  const StragglerOptions& options() const { return options_; }
  // A step's split (FlightRecorder's step observer).
  void onStep(std::int64_t step, std::int64_t stepNs, std::int64_t waitNs, std::int64_t dataNs);
  // Rank 0: the events found since the last call.
  std::vector<StragglerEvent> takeEvents();
  // Rank 0: one line on the run so far ("stragglers: none in 12 reports ...").
  std::string summary() const;
  int reports() const;

  // The monitor of this process's runtime (nullptr: none), for the Trainer.
  static std::shared_ptr<StragglerMonitor> active();
  static void setActive(std::shared_ptr<StragglerMonitor> monitor);

 private:
  struct Window {
    std::int64_t index = 0, firstStep = 0, lastStep = 0;
    WindowFigures mine;
  };
  void run();
  void handle(rendezvous::StoreClient& store, const Window& window);
  std::string key(std::int64_t window, const std::string& what) const;

  const StragglerOptions options_;
  const int rank_;
  const int world_;
  const std::string node_;
  const std::string prefix_;
  Connect connect_;
  // The marking thread's window in progress.
  std::int64_t windowFirst_ = -1;
  double sumStep_ = 0, sumWait_ = 0, sumData_ = 0;
  int steps_ = 0;
  // Handed to the thread.
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Window> queue_;
  bool stopping_ = false;
  rendezvous::StoreClient* store_ = nullptr;  // the thread's connection, for interrupt()
  // Rank 0's findings, under mutex_.
  std::map<int, bool> named_;  // rank -> named now
  struct History {
    std::string node;
    int times = 0;
    double worst = 0;
    std::int64_t recoveredAt = -1;  // the last step of the window it was reported recovered in
  };
  std::map<int, History> history_;
  int reports_ = 0;
  std::vector<StragglerEvent> events_;
  std::thread thread_;
};

}  // namespace fsdp::worker::detail
