// Stragglers named from every rank's step split (straggler.hpp).
#include "stats/straggler.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "comm/recorded_communicator.hpp"
#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::worker::detail {
namespace {

std::mutex gActiveMutex;
std::shared_ptr<StragglerMonitor> gActive;

std::string fixed(double value, int digits) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.*f", digits, value);
  return text;
}

}  // namespace

StragglerMonitor::StragglerMonitor(StragglerOptions options, int rank, int world, std::string node,
                                   std::string prefix, Connect connect)
    : options_(options),
      rank_(rank),
      world_(world),
      node_(std::move(node)),
      prefix_(std::move(prefix)),
      connect_(std::move(connect)),
      thread_([this] { run(); }) {}

StragglerMonitor::~StragglerMonitor() {
  {
    std::scoped_lock lock(mutex_);
    stopping_ = true;
    if (store_ != nullptr) store_->interrupt();  // a wait for a lost rank's window ends now
  }
  wake_.notify_all();
  thread_.join();
}

std::shared_ptr<StragglerMonitor> StragglerMonitor::active() {
  std::scoped_lock lock(gActiveMutex);
  return gActive;
}

void StragglerMonitor::setActive(std::shared_ptr<StragglerMonitor> monitor) {
  std::scoped_lock lock(gActiveMutex);
  gActive = std::move(monitor);
}

std::string StragglerMonitor::key(std::int64_t window, const std::string& what) const {
  return prefix_ + "straggler/" + std::to_string(window) + "/" + what;
}

void StragglerMonitor::onStep(std::int64_t step, std::int64_t stepNs, std::int64_t waitNs, std::int64_t dataNs) {
  if (options_.every <= 0) return;
  if (windowFirst_ < 0) windowFirst_ = step;
  sumStep_ += static_cast<double>(stepNs) / 1e6;
  sumWait_ += static_cast<double>(waitNs) / 1e6;
  sumData_ += static_cast<double>(dataNs) / 1e6;
  ++steps_;
  if (step % options_.every != 0) return;
  // Windows are numbered by step, so every rank's window w covers the same steps.
  Window w{.index = step / options_.every, .firstStep = windowFirst_, .lastStep = step};
  const double n = steps_;
  w.mine = {.computeMs = std::max(0.0, (sumStep_ - sumWait_ - sumData_) / n), .waitMs = sumWait_ / n,
            .dataMs = sumData_ / n, .node = node_};
  windowFirst_ = -1;
  sumStep_ = sumWait_ = sumData_ = 0;
  steps_ = 0;
  {
    std::scoped_lock lock(mutex_);
    if (queue_.size() >= 8) queue_.pop_front();  // the store fell behind: the newest count
    queue_.push_back(std::move(w));
  }
  wake_.notify_one();
}

void StragglerMonitor::run() {
  std::unique_ptr<rendezvous::StoreClient> store;
  for (;;) {
    Window w;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      w = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      if (!store) {
        store = connect_();
        std::scoped_lock lock(mutex_);
        if (stopping_) return;
        store_ = store.get();
      }
      handle(*store, w);
    } catch (const std::exception& e) {
      std::scoped_lock lock(mutex_);
      if (stopping_) return;
      log::debug("straggler report of steps {}-{}: {}", w.firstStep, w.lastStep, e.what());
      store_ = nullptr;
      store.reset();  // a new connection for the next window
    }
  }
}

void StragglerMonitor::handle(rendezvous::StoreClient& store, const Window& w) {
  std::ostringstream mine;
  mine.precision(6);
  mine << w.mine.computeMs << ' ' << w.mine.waitMs << ' ' << w.mine.dataMs << ' ' << w.mine.node;
  store.set(key(w.index, std::to_string(rank_)), mine.str());
  // The keys of two windows back are read by now (rank 0 waited for them before its verdict).
  if (w.index >= 2) store.remove(key(w.index - 2, std::to_string(rank_)));
  if (rank_ == 0) {
    std::vector<std::string> keys;
    for (int r = 0; r < world_; ++r) keys.push_back(key(w.index, std::to_string(r)));
    store.wait(keys);
    std::vector<WindowFigures> ranks;
    for (const auto& text : store.multiGet(keys)) {
      std::istringstream in(text);
      WindowFigures f;
      in >> f.computeMs >> f.waitMs >> f.dataMs >> f.node;
      ranks.push_back(std::move(f));
    }
    std::vector<StragglerEvent> events;
    WindowVerdict verdict;
    {
      std::scoped_lock lock(mutex_);
      verdict = judgeWindow(ranks, options_, named_, w.firstStep, w.lastStep);
      ++reports_;
      for (const auto& e : verdict.events) {
        auto& h = history_[e.rank];
        h.node = e.node;
        if (e.recovered) {
          h.recoveredAt = e.lastStep;
        } else {
          ++h.times;
          h.worst = std::max(h.worst, e.factor);
          h.recoveredAt = -1;
        }
        events_.push_back(e);
      }
    }
    for (const auto& e : verdict.events) log::warn("{}", e.line());
    std::ostringstream scores;
    scores.precision(4);
    for (const double f : verdict.factors) scores << f << ' ';
    store.set(key(w.index, "scores"), scores.str());
    if (w.index >= 2) store.remove(key(w.index - 2, "scores"));
  }
  // Every rank's own score, for its agent's /metrics.
  const std::string scores = store.get(key(w.index, "scores"));
  std::istringstream in(scores);
  double factor = 0;
  for (int r = 0; r <= rank_ && (in >> factor); ++r) {
  }
  FlightRecorder::process().setStraggler(factor);
}

std::vector<StragglerEvent> StragglerMonitor::takeEvents() {
  std::scoped_lock lock(mutex_);
  return std::exchange(events_, {});
}

int StragglerMonitor::reports() const {
  std::scoped_lock lock(mutex_);
  return reports_;
}

std::string StragglerMonitor::summary() const {
  std::scoped_lock lock(mutex_);
  const std::string rule = "named at " + fixed(options_.factor, 1) + "x the median compute, every " +
                           std::to_string(options_.every) + " steps";
  if (history_.empty()) return "stragglers: none in " + std::to_string(reports_) + " reports (" + rule + ")";
  std::string text = "stragglers (" + rule + "):";
  bool first = true;
  for (const auto& [rank, h] : history_) {
    text += first ? " " : "; ";
    first = false;
    text += "rank " + std::to_string(rank) + " (" + h.node + ") named in " + std::to_string(h.times) + " of " +
            std::to_string(reports_) + " reports, at most " + fixed(h.worst, 1) + "x";
    text += h.recoveredAt >= 0 ? ", recovered by step " + std::to_string(h.recoveredAt) : ", still slow";
  }
  return text;
}

}  // namespace fsdp::worker::detail
