// The process's flight recorder, progress marks and collective tags (flight_recorder.hpp).
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <string>

#include "comm/recorded_communicator.hpp"
#include "reform/control.hpp"
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

RankWait::RankWait(const Point& p, bool waits) {
  auto& recorder = FlightRecorder::process();
  index_ = recorder.issueRankWait(p.group, p.rank, p.size, p.step, p.what, waits);
  open_ = waits && recorder.enabled();
}

RankWait::~RankWait() {
  if (open_) FlightRecorder::process().complete(index_, false);
}

void RankWait::done() {
  if (!open_) return;
  open_ = false;
  FlightRecorder::process().complete(index_, true);
}

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
  const char* timing = std::getenv("FSDPRUN_STEP_TIMING");
  timingOn_ = timing == nullptr || std::string(timing) != "0";
  timing_.loss = std::numeric_limits<double>::quiet_NaN();
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
  std::uint64_t index = 0;
  {
    std::scoped_lock lock(mutex_);
    index = writer_->issue(what, started);
  }
  if (started) beginWait(index);
  return index;
}

void FlightRecorder::start(std::uint64_t index) {
  if (!writer_) return;
  writer_->start(index);
  beginWait(index);
}

void FlightRecorder::complete(std::uint64_t index, bool ok) {
  // A peer's death seen here before the agent's notice (reformPending waits for the notice then).
  if (!ok) ReformControl::process().noteCollectiveFailure();
  if (!writer_) return;
  writer_->complete(index, ok);
  endWait(index);
}

// Waiting in collectives: the union of the intervals from start to completion, counted as the
// time at least one collective is in flight (overlapping collectives of several groups count
// once).
void FlightRecorder::beginWait(std::uint64_t index) {
  if (!timingOn_) return;
  std::scoped_lock lock(timingMutex_);
  if (std::find(inFlight_.begin(), inFlight_.end(), index) != inFlight_.end()) return;
  if (inFlight_.empty()) busySince_ = flight::nowNs();
  inFlight_.push_back(index);
}

void FlightRecorder::endWait(std::uint64_t index) {
  if (!timingOn_) return;
  std::scoped_lock lock(timingMutex_);
  const auto it = std::find(inFlight_.begin(), inFlight_.end(), index);
  if (it == inFlight_.end()) return;  // told twice (the watcher and the caller's wait)
  inFlight_.erase(it);
  if (inFlight_.empty()) rawWaitNs_ += flight::nowNs() - busySince_;
}

void FlightRecorder::addDataWait(std::int64_t ns) {
  if (!timing()) return;
  std::scoped_lock lock(timingMutex_);
  rawDataNs_ += ns;
}

void FlightRecorder::addBytes(std::int64_t bytes) {
  if (writer_) writer_->addBytes(bytes);
}

void FlightRecorder::reportStep(std::int64_t samples, std::int64_t tokens, double loss) {
  if (!timing()) return;
  std::scoped_lock lock(timingMutex_);
  timing_.samples += samples;
  timing_.tokens += tokens;
  timing_.loss = loss;
}

void FlightRecorder::setStepObserver(std::function<void(const StepSplit&)> observer) {
  std::scoped_lock lock(timingMutex_);
  observer_ = std::move(observer);
}

void FlightRecorder::setStraggler(double factor) {
  if (!timing()) return;
  std::scoped_lock lock(timingMutex_);
  timing_.straggler = factor;
}

void FlightRecorder::markProgress(std::int64_t step, std::string_view what) {
  if (!writer_) return;
  writer_->markProgress(step, what);
  if (!timingOn_ || step < 0) return;
  StepSplit split;
  std::function<void(const StepSplit&)> observer;
  {
    std::scoped_lock lock(timingMutex_);
    // A step counts once: the same step marked again (Snapshotter::save after the Trainer's or
    // the program's own mark) is activity.
    if (lastMarkNs_ != 0 && step == lastStep_) return;
    lastStep_ = step;
    const std::int64_t now = flight::nowNs();
    if (!inFlight_.empty()) {  // the part of a wait in progress belongs to this step
      rawWaitNs_ += now - busySince_;
      busySince_ = now;
    }
    // The totals count marked steps only: what came before the first mark (start-up, a
    // restore) is no step's.
    if (lastMarkNs_ != 0) {
      auto& t = timing_;
      t.lastStepNs = now - lastMarkNs_;
      t.lastDataNs = std::min(rawDataNs_ - dataAtMark_, t.lastStepNs);
      t.lastWaitNs = std::min(rawWaitNs_ - waitAtMark_, t.lastStepNs - t.lastDataNs);
      t.lastSamples = t.samples - samplesAtMark_;
      t.lastTokens = t.tokens - tokensAtMark_;
      t.stepNs += t.lastStepNs;
      t.waitNs += t.lastWaitNs;
      t.dataNs += t.lastDataNs;
      ++t.steps;
      split = {step, t.lastStepNs, t.lastWaitNs, t.lastDataNs};
      observer = observer_;
    }
    waitAtMark_ = rawWaitNs_;
    dataAtMark_ = rawDataNs_;
    samplesAtMark_ = timing_.samples;
    tokensAtMark_ = timing_.tokens;
    lastMarkNs_ = now;
    writer_->publishTiming(timing_);
  }
  if (observer) observer(split);
}

void FlightRecorder::enterLongOperation(std::string_view what) {
  std::scoped_lock lock(mutex_);
  if (writer_ && longOperations_++ == 0) writer_->setBusy(true, what);
}

std::uint64_t FlightRecorder::issueRankWait(std::string_view group, int groupRank, int groupSize,
                                            std::int64_t step, std::string_view what, bool waits) {
  if (!writer_) return 0;
  std::uint64_t index = 0;
  {
    std::scoped_lock lock(mutex_);
    auto it = rankWaitSeq_.find(group);
    if (it == rankWaitSeq_.end()) it = rankWaitSeq_.emplace(std::string(group), 0).first;
    index = writer_->issue({.group = group,
                            .groupSize = groupSize,
                            .groupRank = groupRank,
                            .seq = ++it->second,
                            .op = flight::Op::kWait,
                            .count = step,
                            .dtype = "",
                            .tag = what},
                           true);
  }
  if (waits) {
    beginWait(index);  // the step split counts it as waiting, like a collective
  } else {
    writer_->complete(index, true);
  }
  return index;
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

void reportStep(std::int64_t samples, std::int64_t tokens, double loss) {
  detail::FlightRecorder::process().reportStep(samples, tokens, loss);
}

DataWait::DataWait() : startNs_(flight::nowNs()) {}
DataWait::~DataWait() { detail::FlightRecorder::process().addDataWait(flight::nowNs() - startNs_); }

LongOperation::LongOperation(std::string_view what) { detail::FlightRecorder::process().enterLongOperation(what); }
LongOperation::~LongOperation() { detail::FlightRecorder::process().leaveLongOperation(); }

CommTag::CommTag(std::string_view phase, std::string_view what) {
  std::memcpy(previous_, tlsTag, sizeof(previous_));
  setTag(phase, what);
}

CommTag::~CommTag() { std::memcpy(tlsTag, previous_, sizeof(previous_)); }

}  // namespace fsdp::worker
