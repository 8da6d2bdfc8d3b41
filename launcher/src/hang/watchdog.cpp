// The hang watchdog: local quiet detection, the declaration and exchange through the store, and
// the report (watchdog.hpp).
#include "watchdog.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "fsdp/common/error.hpp"
#include "fsdp/common/log.hpp"
#include "fsdp/rendezvous/store_client.hpp"
#include "report.hpp"
#include "stacks.hpp"

namespace fsdp::launcher::detail {
namespace {

using namespace std::chrono_literals;
constexpr std::size_t kRecordsPerRank = 64;

// What a node sends of a rank's ring: the newest kRecordsPerRank records, plus the oldest one
// not completed of each group (a host that ran ahead of its device can have many after it).
std::vector<flight::Record> selectRecords(const std::vector<flight::Record>& all) {
  const std::size_t from = all.size() > kRecordsPerRank ? all.size() - kRecordsPerRank : 0;
  std::vector<flight::Record> out;
  std::set<std::string> seen;
  for (std::size_t i = 0; i < from; ++i) {
    if (all[i].state == flight::SlotState::kIssued && seen.insert(all[i].group).second) out.push_back(all[i]);
  }
  out.insert(out.end(), all.begin() + static_cast<std::ptrdiff_t>(from), all.end());
  return out;
}

}  // namespace

std::chrono::milliseconds autoHangTimeout(std::int64_t longestGapNs, std::int64_t marks) {
  if (marks < 2) return kBeforeFirstMark;
  return std::max<std::chrono::milliseconds>(60s, std::chrono::milliseconds(longestGapNs / 1000000 * 10));
}

HangWatchdog::HangWatchdog(WatchdogOptions options, std::vector<WatchedWorker> workers)
    : options_(std::move(options)), workers_(std::move(workers)) {
  const rendezvous::ClientOptions client{.connectTimeout = 5s, .runId = options_.runId, .token = options_.token};
  store_ = rendezvous::StoreClient::connect(options_.storeHost, static_cast<std::uint16_t>(options_.storePort), client);
  if (::pipe2(notify_, O_CLOEXEC | O_NONBLOCK) != 0) throwErrno("pipe2 for the hang watchdog", errno);
  try {
    const auto straggling = stragglers::optionsFromEnv();
    if (straggling.every > 0) {
      stragglers_ = std::make_unique<PythonStragglers>(straggling, options_.round, options_.worldSize,
                                                       options_.host, workers_);
    }
  } catch (const ConfigError& e) {  // the workers say it too (libfsdp stops on it)
    log::warn("no straggler reports for PyTorch scripts: {}", e.what());
  }
  thread_ = std::thread([this] { run(); });
}

HangWatchdog::~HangWatchdog() {
  requestStop();
  thread_.join();
  for (const int fd : notify_) ::close(fd);
}

void HangWatchdog::requestStop() {
  if (stopping_.exchange(true)) return;
  // Whatever the thread waits on in the store fails at once (and quietly: it is stopping). No
  // request of our own: a server that went silent would keep the agent waiting on it.
  store_->interrupt();
}

std::string HangWatchdog::key(const std::string& what) const {
  return "fsdprun/hang/" + std::to_string(options_.round) + "/" + what;
}

std::optional<HangReport> HangWatchdog::take() {
  std::scoped_lock lock(mutex_);
  char byte = 0;
  while (::read(notify_[0], &byte, 1) > 0) {
  }
  return std::exchange(report_, std::nullopt);
}

std::optional<HangWatchdog::Quiet> HangWatchdog::quiet() const {
  const std::int64_t now = flight::nowNs();
  bool any = false;
  std::int64_t last = baselineNs_.load(), gap = 0, marks = 0;
  Quiet q;
  for (const auto& w : workers_) {
    const char state = processState(w.pid);
    if (state == '?' || state == 'Z' || state == 'X') continue;  // exited: the others are still judged
    if (!w.ring) continue;
    const auto r = w.ring->read(0);
    if (!r.attached || !r.error.empty()) continue;
    any = true;
    last = std::max({last, r.attachedNs, r.lastCompletedNs, r.progress.lastNs});
    // Inside a long operation (a checkpoint write) is no progress either: it holds the
    // declaration back for a while instead (run()), on every node.
    if (r.progress.busySinceNs != 0 && (!q.busy || r.progress.busySinceNs < q.busy->sinceNs)) {
      q.busy = Busy{w.rank, options_.host, r.progress.busySinceNs, r.progress.busyWhat};
    }
    gap = std::max(gap, r.progress.longestGapNs);
    marks = std::max(marks, r.progress.count);
  }
  if (!any) return std::nullopt;
  auto timeout = options_.timeout.value_or(autoHangTimeout(gap, marks));
  // Start-up (LibTorch, the data, the first step) is not judged by a timeout sized for steps.
  if (marks == 0) timeout = std::max<std::chrono::milliseconds>(timeout, kBeforeFirstMark);
  q.quietNs = now - last;
  q.timeout = timeout;
  return q;
}

void HangWatchdog::publishBusy(const std::optional<Busy>& busy) {
  const std::string value =
      busy ? std::to_string(busy->rank) + " " + std::to_string(busy->sinceNs) + " " + options_.host + " " + busy->what
           : "";
  if (value == publishedBusy_) return;
  store_->set(key("busy/" + std::to_string(options_.nodeRank)), value);
  publishedBusy_ = value;
}

std::optional<HangWatchdog::Busy> HangWatchdog::jobBusy(const std::optional<Busy>& local) {
  std::optional<Busy> out = local;
  for (int n = 0; n < options_.nnodes; ++n) {
    if (n == options_.nodeRank) continue;
    const std::string k = key("busy/" + std::to_string(n));
    if (!store_->check({k})) continue;
    const std::string text = store_->get(k, 1s);
    Busy b;
    char host[256] = {0}, what[64] = {0};
    long long since = 0;
    // "<rank> <since ns> <host> <what>"; a node that left it empty has none.
    if (std::sscanf(text.c_str(), "%d %lld %255s %63[^\n]", &b.rank, &since, host, what) < 3 || since <= 0) continue;
    b.sinceNs = since;
    b.what = what;
    b.host = host;
    if (!out || b.sinceNs < out->sinceNs) out = b;
  }
  return out;
}

void HangWatchdog::run() {
  const std::string declared = key("declared");
  try {
    std::uint64_t seen = store_->revision();
    std::string by, busyNote;
    std::int64_t quietNs = 0, heldSince = 0;
    std::chrono::milliseconds timeout{0};
    auto lastCheck = std::chrono::steady_clock::now();
    while (by.empty()) {
      if (stopping_.load()) return;
      // Time this thread did not run (the node suspended, the clock stepped) is nobody's hang:
      // quiet time counts again from now.
      const auto checked = std::chrono::steady_clock::now();
      if (checked - lastCheck > 3s) baselineNs_.store(flight::nowNs());
      lastCheck = checked;
      if (store_->check({declared})) {
        by = store_->get(declared, 1s);
        break;
      }
      if (stragglers_) stragglers_->poll(*store_);
      if (const auto q = quiet()) {
        quietNs = q->quietNs;
        timeout = q->timeout;
        publishBusy(q->busy);
        if (std::chrono::nanoseconds(q->quietNs) > q->timeout) {
          // A rank of the job busy in its own work (a slow disk) is waited for, up to a bound.
          const auto busy = jobBusy(q->busy);
          const auto bound = q->timeout * kBusyFactor;
          const std::int64_t busyNs = busy ? flight::nowNs() - busy->sinceNs : 0;
          const std::string inside = busy ? "rank " + std::to_string(busy->rank) + " on " + busy->host +
                                                " has been inside its own " + busy->what + " for " +
                                                secondsText(busyNs)
                                          : "";
          if (busy && std::chrono::nanoseconds(busyNs) < bound) {
            if (heldSince != busy->sinceNs) {
              heldSince = busy->sinceNs;
              log::warn("no rank on this node completed a collective or marked progress for {}, but {}: not a "
                        "hang until it has been inside for {} ({}x the hang timeout)",
                        secondsText(q->quietNs), inside,
                        secondsText(std::chrono::nanoseconds(bound).count()), kBusyFactor);
            }
          } else {
            if (busy) {
              busyNote = inside + ", past the " + secondsText(std::chrono::nanoseconds(bound).count()) +
                         " a long operation may take (" + std::to_string(kBusyFactor) + "x the hang timeout)";
            }
            by = options_.host + " (node " + std::to_string(options_.nodeRank) + ")";
            store_->set(declared, by);
            log::error("no rank on this node completed a collective or marked progress for {}{}: declaring the "
                       "job hung",
                       secondsText(q->quietNs), busyNote.empty() ? "" : "; " + busyNote);
            break;
          }
        }
      }
      const auto interval = std::clamp<std::chrono::milliseconds>(
          (options_.timeout.value_or(timeout.count() > 0 ? timeout : 5000ms)) / 5, 100ms, 1000ms);
      const auto change = store_->waitForChange({declared}, seen, interval);
      if (!change) continue;
      seen = change->revision;
      if (stopping_.load()) return;
      if (change->value) by = *change->value;
    }
    HangReport report = collect(by, quietNs, timeout, busyNote);
    if (stopping_.load()) return;
    {
      std::scoped_lock lock(mutex_);
      report_ = std::move(report);
    }
    const char byte = 1;
    while (::write(notify_[1], &byte, 1) < 0 && errno == EINTR) {
    }
  } catch (const std::exception& e) {  // fsdp::Error from the store; anything else must not end the agent
    if (!stopping_.load()) log::warn("hang watchdog of round {} stopped: {}", options_.round, e.what());
  }
}

HangReport HangWatchdog::collect(const std::string& declaredBy, std::int64_t quietNs, std::chrono::milliseconds timeout,
                                 const std::string& busyNote) {
  const std::int64_t now = flight::nowNs();
  std::vector<RankView> local;
  for (const auto& w : workers_) {
    RankView v{.rank = w.rank, .host = options_.host, .pid = w.pid};
    const char state = processState(w.pid);
    if (state == '?' || state == 'Z' || state == 'X') v.state = "exited";
    v.stopped = state == 'T';
    if (w.ring) {
      const auto r = w.ring->read(flight::kDefaultCapacity);
      v.ringAttached = r.attached;
      v.ringError = r.error;
      v.attachedNs = r.attachedNs;
      v.joined = !r.attached || r.attachedNs >= options_.roundStartNs;
      v.lastCompletedNs = r.lastCompletedNs;
      v.progress = r.progress;
      // Only this round's records: a survivor's ring still holds its earlier rounds' (the same
      // group names, their sequence numbers counted from 1 again), which would hide where it is
      // now; one that has not re-formed has none.
      const std::int64_t since = std::max(r.attachedNs, options_.roundStartNs);
      auto records = r.records;
      std::erase_if(records, [since](const flight::Record& record) { return record.issuedNs < since; });
      v.records = selectRecords(records);
    } else {
      v.ringError = "the agent could not make this worker's ring";
    }
    local.push_back(std::move(v));
  }
  // Everyone's records, then the same analysis on every node.
  const auto gather = [&](const std::string& what, std::chrono::milliseconds within) {
    std::vector<std::string> keys;
    for (int n = 0; n < options_.nnodes; ++n) keys.push_back(key(what + "/" + std::to_string(n)));
    // In slices, so that a round that ends meanwhile is not kept waiting.
    const auto until = std::chrono::steady_clock::now() + within;
    for (;;) {
      try {
        store_->wait(keys, 500ms);
        break;
      } catch (const TimeoutError& e) {
        if (stopping_.load()) break;
        if (std::chrono::steady_clock::now() >= until) {
          log::warn("hang report: {}", e.what());
          break;
        }
      }
    }
    std::vector<RankView> all;
    for (const auto& k : keys) {
      if (!store_->check({k})) continue;
      try {
        for (auto& v : rankViewsFromJson(store_->get(k, 1s))) all.push_back(std::move(v));
      } catch (const ProtocolError& e) {
        log::warn("hang report: {} is unreadable: {}", k, e.what());
      }
    }
    std::sort(all.begin(), all.end(), [](const RankView& a, const RankView& b) { return a.rank < b.rank; });
    return all;
  };
  store_->set(key("records/" + std::to_string(options_.nodeRank)), rankViewsToJson(local));
  auto all = gather("records", options_.exchangeTimeout);
  const HangAnalysis analysis = analyzeHang(all, options_.worldSize, now);
  for (auto& v : local) {
    // An exited worker's pid may belong to someone else by now: never traced.
    if (!analysis.lagging.count(v.rank) || stopping_.load() || v.state == "exited") continue;
    const auto worker = std::find_if(workers_.begin(), workers_.end(), [&](const WatchedWorker& w) { return w.rank == v.rank; });
    // The Python stacks first: a ptrace attach would hold the signal that asks for them.
    const std::string python = worker != workers_.end() ? withPythonStacks(*worker, "") : "";
    const auto seen = inspectProcess(static_cast<pid_t>(v.pid), options_.stackTimeout);
    v.state = seen.stateName + (seen.wchan.empty() ? "" : ", waiting in " + seen.wchan);
    v.stack = python.empty() ? seen.stack : python + (seen.stack.empty() ? "" : "native:\n" + seen.stack);
    v.stackError = seen.stackError;
  }
  store_->set(key("stacks/" + std::to_string(options_.nodeRank)), rankViewsToJson(local));
  std::map<int, RankView> inspected;
  // The other nodes take their stacks meanwhile: wait for as long as that may take.
  for (auto& v : gather("stacks", options_.stackTimeout + options_.exchangeTimeout)) inspected[v.rank] = std::move(v);
  for (auto& v : all) {
    const auto it = inspected.find(v.rank);
    if (it == inspected.end()) continue;
    if (!it->second.state.empty()) v.state = it->second.state;
    v.stack = it->second.stack;
    v.stackError = it->second.stackError;
  }
  std::string headline = "the job is hung (declared by " + declaredBy + ")";
  if (quietNs > 0) {
    headline += ": no rank on " + options_.host + " completed a collective or marked progress for " +
                secondsText(quietNs) + " (hang timeout " +
                secondsText(std::chrono::nanoseconds(timeout).count()) + (options_.timeout ? "" : ", auto") + ")";
  }
  if (!busyNote.empty()) headline += "; " + busyNote;
  HangReport report;
  report.text = formatHangReport(headline, analysis, all);
  report.lagging = analysis.lagging;
  report.desync = analysis.desync;
  report.viewsJson = rankViewsToJson(all);
  report.stalledSeconds = static_cast<double>(quietNs) / 1e9;
  // The finding that names the cause comes first in one-line messages.
  report.summary = analysis.lines.empty() ? headline : analysis.lines.front();
  if (analysis.cause >= 0) {
    report.summary = analysis.lines.at(static_cast<std::size_t>(analysis.cause));
  } else {
    for (const auto& line : analysis.lines) {
      if (line.find("never entered") != std::string::npos || line.rfind("desync", 0) == 0) {
        report.summary = line;
        break;
      }
    }
  }
  if (!analysis.lagging.empty()) {
    report.firstRank = *analysis.lagging.begin();
    for (const auto& v : all) {
      if (v.rank != report.firstRank) continue;
      report.firstHost = v.host;
      report.firstPid = v.pid;
    }
  }
  return report;
}

}  // namespace fsdp::launcher::detail
