#pragma once
// The flight recorder of this process (one ring, FSDPRUN_FLIGHT_FD from the agent, else private
// memory) and the communicator wrapper that records every collective of the communicator it
// owns into it. Private to libfsdp.

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

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
  void markProgress(std::int64_t step, std::string_view what);
  void enterLongOperation();
  void leaveLongOperation();
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
};

// This thread's CommTag text ("" when none).
const char* currentCommTag();

// Wraps `inner` so that every collective is recorded under `group` ("world", "shard", ...).
// Returns `inner` itself when the recorder is off.
std::unique_ptr<Communicator> recordCollectives(std::unique_ptr<Communicator> inner, std::string group);

}  // namespace fsdp::worker::detail
