// Stragglers among PyTorch scripts' ranks, judged by their agents (python_stragglers.hpp).
#include "python_stragglers.hpp"

#include <sstream>

#include "../workers/py_stacks.hpp"
#include "fsdp/common/log.hpp"

namespace fsdp::launcher::detail {

PythonStragglers::PythonStragglers(stragglers::Options options, int round, int worldSize, std::string host,
                                   std::vector<WatchedWorker> workers)
    : options_(options), round_(round), world_(worldSize), host_(std::move(host)) {
  for (auto& w : workers) locals_.push_back(Local{.worker = std::move(w)});
}

std::string PythonStragglers::key(std::int64_t window, const std::string& what) const {
  return "fsdprun/straggler/" + std::to_string(round_) + "/" + std::to_string(window) + "/" + what;
}

void PythonStragglers::poll(rendezvous::StoreClient& store) {
  if (options_.every <= 0) return;
  bool anyPython = false;
  bool rankZeroPython = false;
  for (auto& l : locals_) {
    if (!l.python) {
      // Judged here only once the module is known to run in it (libfsdp judges its own ranks).
      l.python = l.worker.pystacks && l.worker.ring && pythonStacksRegistered(*l.worker.pystacks, l.worker.pid);
      if (!l.python) continue;
    }
    anyPython = true;
    rankZeroPython = rankZeroPython || l.worker.rank == 0;
    publish(store, l);
  }
  if (rankZeroPython) judge(store);
  if (anyPython) applyFactors(store);
}

void PythonStragglers::publish(rendezvous::StoreClient& store, Local& l) {
  const auto r = l.worker.ring->read(0);
  if (!r.attached) return;
  const auto& t = r.timing;
  const std::int64_t steps = t.steps - l.steps;
  if (steps < options_.every) return;
  const double n = static_cast<double>(steps) * 1e6;
  const double wait = static_cast<double>(t.waitNs - l.waitNs) / n;
  const double data = static_cast<double>(t.dataNs - l.dataNs) / n;
  const double compute = std::max(0.0, static_cast<double>(t.stepNs - l.stepNs) / n - wait - data);
  std::ostringstream value;
  // The window's steps: the newest mark and the `steps` before it (a poll sees whatever passed).
  value << compute << ' ' << wait << ' ' << data << ' ' << r.progress.step - steps + 1 << ' ' << r.progress.step
        << ' ' << host_;
  store.set(key(l.window, std::to_string(l.worker.rank)), value.str());
  ++l.window;
  l.steps = t.steps;
  l.stepNs = t.stepNs;
  l.waitNs = t.waitNs;
  l.dataNs = t.dataNs;
}

void PythonStragglers::judge(rendezvous::StoreClient& store) {
  std::vector<std::string> keys;
  for (int rank = 0; rank < world_; ++rank) keys.push_back(key(nextJudged_, std::to_string(rank)));
  if (!store.check(keys)) return;
  std::vector<stragglers::WindowFigures> figures(static_cast<std::size_t>(world_));
  std::int64_t first = -1, last = -1;
  const auto values = store.multiGet(keys);
  for (int rank = 0; rank < world_; ++rank) {
    std::istringstream in(values[static_cast<std::size_t>(rank)]);
    auto& f = figures[static_cast<std::size_t>(rank)];
    std::int64_t a = -1, b = -1;
    in >> f.computeMs >> f.waitMs >> f.dataMs >> a >> b >> f.node;
    if (rank == 0) first = a, last = b;
  }
  const auto verdict = stragglers::judgeWindow(figures, options_, named_, first, last);
  for (const auto& e : verdict.events) log::warn("{}", e.line());
  // One key, overwritten: the newest window's factors, for every node's /metrics.
  std::ostringstream factors;
  factors << nextJudged_;
  for (double f : verdict.factors) factors << ' ' << f;
  store.set("fsdprun/straggler/" + std::to_string(round_) + "/factors", factors.str());
  for (const auto& k : keys) store.remove(k);
  ++nextJudged_;
}

void PythonStragglers::applyFactors(rendezvous::StoreClient& store) {
  const std::string k = "fsdprun/straggler/" + std::to_string(round_) + "/factors";
  if (!store.check({k})) return;
  std::istringstream in(store.get(k));
  std::int64_t window = -1;
  if (!(in >> window) || window < nextFactors_) return;
  std::vector<double> factors;
  for (double f = 0; in >> f;) factors.push_back(f);
  for (auto& l : locals_) {
    const auto at = static_cast<std::size_t>(l.worker.rank);
    if (l.python && at < factors.size()) l.worker.ring->header().straggler.store(factors[at]);
  }
  nextFactors_ = window + 1;
}

}  // namespace fsdp::launcher::detail
