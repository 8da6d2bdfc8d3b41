// The process's flight recorder, progress marks and collective tags (flight_recorder.hpp).
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/recorded_communicator.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/worker/flight_recorder.hpp"

namespace fsdp::worker {
namespace {

thread_local char tlsTag[48] = {0};

void setTag(std::string_view phase, std::string_view what) {
  std::size_t n = std::min(phase.size(), sizeof(tlsTag) - 1);
  if (n > 0) std::memcpy(tlsTag, phase.data(), n);  // an empty view may hold no pointer at all
  if (!what.empty() && n + 1 < sizeof(tlsTag) - 1) {
    tlsTag[n++] = ' ';
    const std::size_t m = std::min(what.size(), sizeof(tlsTag) - 1 - n);
    std::memcpy(tlsTag + n, what.data(), m);
    n += m;
  }
  tlsTag[n] = '\0';
}

}  // namespace

namespace detail {

const char* currentCommTag() { return tlsTag; }

FlightRecorder::FlightRecorder() {
  const char* off = std::getenv("FSDPRUN_FLIGHT_RECORDER");
  if (off != nullptr && std::string(off) == "0") {
    ::unsetenv("FSDPRUN_FLIGHT_FD");
    return;
  }
  if (const char* text = std::getenv("FSDPRUN_FLIGHT_FD")) {
    const int fd = std::atoi(text);
    ::unsetenv("FSDPRUN_FLIGHT_FD");  // a child this program starts must not write into it
    std::string why;
    if (fd >= 0) ring_ = flight::RingMemory::attach(fd, &why);
    if (!ring_) log::warn("no flight recorder for the hang watchdog: {}", why);
    // Where Yama restricts ptrace to descendants, the agent's stack tools (its children) may
    // attach to this process all the same. Without Yama this fails harmlessly.
    if (ring_) ::prctl(PR_SET_PTRACER, static_cast<unsigned long>(::getppid()), 0, 0, 0);
  }
  if (!ring_) ring_ = flight::RingMemory::anonymous();
  writer_.emplace(*ring_);
}

FlightRecorder& FlightRecorder::process() {
  static FlightRecorder recorder;  // the process's one ring, as its one agent gave it
  return recorder;
}

void FlightRecorder::attach(int rank) {
  if (writer_) writer_->attach(rank);
}

std::uint64_t FlightRecorder::issue(const flight::Writer::Issue& what, bool started) {
  if (!writer_) return 0;
  std::scoped_lock lock(mutex_);
  return writer_->issue(what, started);
}

void FlightRecorder::start(std::uint64_t index) {
  if (writer_) writer_->start(index);
}

void FlightRecorder::complete(std::uint64_t index, bool ok) {
  if (writer_) writer_->complete(index, ok);
}

void FlightRecorder::markProgress(std::int64_t step, std::string_view what) {
  if (writer_) writer_->markProgress(step, what);
}

void FlightRecorder::enterLongOperation() {
  std::scoped_lock lock(mutex_);
  if (writer_ && longOperations_++ == 0) writer_->setBusy(true);
}

void FlightRecorder::leaveLongOperation() {
  std::scoped_lock lock(mutex_);
  if (writer_ && --longOperations_ == 0) writer_->setBusy(false);
}

std::uint64_t FlightRecorder::issued() const {
  return ring_ ? ring_->header().issued.load(std::memory_order_relaxed) : 0;
}

flight::Reading FlightRecorder::read(std::size_t last) const {
  return ring_ ? ring_->read(last) : flight::Reading{};
}

}  // namespace detail

void markProgress(std::int64_t step, std::string_view what) {
  detail::FlightRecorder::process().markProgress(step, what);
}

LongOperation::LongOperation() { detail::FlightRecorder::process().enterLongOperation(); }
LongOperation::~LongOperation() { detail::FlightRecorder::process().leaveLongOperation(); }

CommTag::CommTag(std::string_view phase, std::string_view what) {
  std::memcpy(previous_, tlsTag, sizeof(previous_));
  setTag(phase, what);
}

CommTag::~CommTag() { std::memcpy(tlsTag, previous_, sizeof(previous_)); }

}  // namespace fsdp::worker
