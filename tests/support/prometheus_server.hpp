#pragma once
// Test helper: a real Prometheus server (Debian's `prometheus`, 2.42) scraping targets a test
// names, and its HTTP query API. The test asks Prometheus, as an operator's dashboard would,
// instead of reading the scraped pages itself.
//
//   if (const auto why = prometheusMissing(); !why.empty()) GTEST_SKIP() << why;
//   PrometheusServer prom({.targets = {"127.0.0.1:" + std::to_string(port)}});
//   const auto w = prom.waitFor("fsdprun_worker_step", [](const auto& r) { return r.size() == 4; }, 60s);
//   ASSERT_TRUE(w.met) << w.describe() << prom.logTail();
//
// Timing: /-/ready answers within a fraction of a second, but 2.42 hands its targets to the
// scrape loops on a fixed 5 s tick, so the first samples come about 5 s after the start.
//
// Ownership: the server owns the Prometheus process (SIGKILLed and reaped by the destructor)
// and its temporary directory (config, TSDB, log; removed by the destructor). Not thread-safe:
// one test thread uses it.

#include <chrono>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/process.hpp"
#include "run_command.hpp"

namespace fsdp::testing {

// "" when `prometheus` is on PATH; otherwise why a test needing it should skip.
std::string prometheusMissing();

struct PrometheusOptions {
  // "HOST:PORT" of every endpoint to scrape (its /metrics), in one scrape job.
  std::vector<std::string> targets;
  // The scrape job's name. With honor_labels the targets' own `job` label wins over it.
  std::string jobName = "fsdprun";
  // Include Prometheus' own listen address as a target (a self-check of the harness).
  bool scrapeItself = false;
  // How long Prometheus may take to answer 200 on /-/ready.
  std::chrono::milliseconds startTimeout = std::chrono::seconds(30);
};

// The end of a waitFor: whether the predicate held, and what the last query said.
struct QueryWait {
  bool met = false;
  std::string promql;
  nlohmann::json result;  // the last successful query's data.result; null if none succeeded
  std::string error;      // the last failed query's error, "" when the last one succeeded
  std::chrono::milliseconds waited{0};
  // "<promql> after N ms: <result>" (and the error), for a failing assertion's message.
  std::string describe() const;
};

class PrometheusServer {
 public:
  // Writes the config (scrape and evaluation every 1 s, scrape timeout 1 s, honor_labels),
  // starts Prometheus on 127.0.0.1:<a free port> and waits until /-/ready answers 200. Throws
  // fsdp::Error with the log's tail when it exits or is not ready within startTimeout.
  explicit PrometheusServer(PrometheusOptions options);
  ~PrometheusServer() = default;
  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;

  int port() const { return port_; }
  // "127.0.0.1:PORT": where Prometheus listens (and a target when scrapeItself).
  std::string address() const;

  // An instant query through /api/v1/query: data.result, an array of {"metric": {labels},
  // "value": [time, "number"]} for a vector. Throws fsdp::Error naming the query when there is
  // no reply (10 s) or Prometheus reports an error (a bad expression).
  nlohmann::json query(const std::string& promql) const;

  // Queries every 500 ms until `done` holds on the result or `timeout` passes (a failed query
  // counts as "not yet"). Stops early when Prometheus exits.
  QueryWait waitFor(const std::string& promql, const std::function<bool(const nlohmann::json&)>& done,
                    std::chrono::milliseconds timeout);

  // The last `lines` lines of Prometheus' log (its stderr), under a header line.
  std::string logTail(std::size_t lines = 40) const;
  const std::string& configPath() const { return configPath_; }

 private:
  bool startOnce(std::chrono::milliseconds timeout, std::string& why);

  PrometheusOptions options_;
  TempDir dir_;  // before process_: the process goes first
  std::string configPath_;
  std::string logPath_;
  int port_ = 0;
  std::optional<fsdp::ChildProcess> process_;
};

// The number in a result sample's "value" ([time, "1.5"]); NaN when it has none.
double sampleValue(const nlohmann::json& sample);

// label value -> sample value over a query's result ("rank" gives {"0": 12, "1": 12, ...});
// samples without the label are left out.
std::map<std::string, double> valuesBy(const nlohmann::json& result, const std::string& label);

}  // namespace fsdp::testing
