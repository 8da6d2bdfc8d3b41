#pragma once
// The flight recorder of this process (one ring, FSDPRUN_FLIGHT_FD from the agent, else private
// memory) and the communicator wrapper that records every collective of the communicator it
// owns into it. Private to libfsdp.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/flight_ring.hpp"
#include "fsdp/worker/communicator.hpp"

namespace fsdp::worker::detail {

class FlightRecorder {
 public:
  // The process's recorder: attaches the agent's ring on first use (FSDPRUN_FLIGHT_FD, which it
  // removes from the environment), or a private one; none with FSDPRUN_FLIGHT_RECORDER=0.
  static FlightRecorder& process();

  bool enabled() const { return writer_.has_value(); }
  // Called by fsdp::init(): the ring says whose it is.
  void attach(int rank);
  // Returns the slot index; meaningless when !enabled().
  std::uint64_t issue(const flight::Writer::Issue& what, bool started);
  void start(std::uint64_t index);
  void complete(std::uint64_t index, bool ok);
  // A collective that will never complete (its backend went): its record stays as it is, and
  // the step split stops counting it as in flight.
  void abandon(std::uint64_t index) { endWait(index); }
  void markProgress(std::int64_t step, std::string_view what);
  // Step timing (off with FSDPRUN_STEP_TIMING=0): the figures of the step about to be marked,
  // time spent waiting for data, and what each step mark hands the straggler monitor.
  void reportStep(std::int64_t samples, std::int64_t tokens, double loss);
  void addDataWait(std::int64_t ns);
  void addBytes(std::int64_t bytes);
  bool timing() const { return writer_.has_value() && timingOn_; }
  struct StepSplit {
    std::int64_t step = 0;
    std::int64_t stepNs = 0, waitNs = 0, dataNs = 0;
  };
  // Called (on the marking thread, outside the recorder's locks) after every step mark; returns
  // nothing. Replaces the one before; an empty function removes it.
  void setStepObserver(std::function<void(const StepSplit&)> observer);
  // The straggler factor the monitor found for this rank (published with the next step).
  void setStraggler(double factor);
  void enterLongOperation(std::string_view what);
  void leaveLongOperation();
  // A wait for other ranks outside a communicator (RankWait): a record of `group` at the
  // group's next sequence number, open (waits) or completed at once (arrives only).
  std::uint64_t issueRankWait(std::string_view group, int groupRank, int groupSize, std::int64_t step,
                              std::string_view what, bool waits);
  // Collectives recorded so far by this process (0 when off).
  std::uint64_t issued() const;
  // What the agent would read (tests): the newest `last` records.
  flight::Reading read(std::size_t last) const;

 private:
  FlightRecorder();
  std::optional<flight::RingMemory> ring_;
  std::optional<flight::Writer> writer_;
  std::mutex mutex_;  // issue() from several threads (the training thread, a checkpoint thread)
  int longOperations_ = 0;  // under mutex_
  std::map<std::string, std::uint64_t, std::less<>> rankWaitSeq_;  // under mutex_
  // Step timing, under timingMutex_ (collectives start and complete on the backends' threads).
  bool timingOn_ = true;
  std::mutex timingMutex_;
  std::vector<std::uint64_t> inFlight_;  // started, not completed
  std::int64_t busySince_ = 0;           // when inFlight_ last became non-empty
  std::int64_t lastMarkNs_ = 0;
  std::int64_t lastStep_ = -1;
  std::int64_t rawWaitNs_ = 0, rawDataNs_ = 0;  // since the start, marked or not
  std::int64_t waitAtMark_ = 0, dataAtMark_ = 0, samplesAtMark_ = 0, tokensAtMark_ = 0;
  flight::StepTiming timing_;
  std::function<void(const StepSplit&)> observer_;  // under timingMutex_; called outside it
  void beginWait(std::uint64_t index);
  void endWait(std::uint64_t index);
};

// A wait of this rank for other ranks outside a communicator (a checkpoint's commit, a snapshot
// restore's agreement through the store), recorded in the flight ring like a collective of
// `group` (Op::kWait, its count the step): every rank of the group records the same points in
// the same order, so the hang report says who waits in one and who never entered it. A rank
// that only arrives (it does not wait: rank 0 commits a save) records it completed at once.
// The record completes with done(); an exception before it records it failed.
class RankWait {
 public:
  struct Point {
    std::string_view group;  // "checkpoint", "snapshot": no communicator's name
    int rank = 0;            // in the group (the world rank for world-wide waits)
    int size = 1;
    std::int64_t step = 0;
    std::string_view what;   // up to 47 characters: "save step 6: waiting for every rank's files"
  };
  explicit RankWait(const Point& point, bool waits = true);
  ~RankWait();
  RankWait(const RankWait&) = delete;
  RankWait& operator=(const RankWait&) = delete;
  void done();

 private:
  std::uint64_t index_ = 0;
  bool open_ = false;
};

// This thread's CommTag text ("" when none).
const char* currentCommTag();

// Wraps `inner` so that every collective is recorded under `group` ("world", "shard", ...).
// Returns `inner` itself when the recorder is off.
std::unique_ptr<Communicator> recordCollectives(std::unique_ptr<Communicator> inner, std::string group);
// The communicator under recordCollectives()' wrapper; `comm` itself when it is not one.
Communicator& unrecorded(Communicator& comm);

}  // namespace fsdp::worker::detail
