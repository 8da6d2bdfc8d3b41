// A real Prometheus server for tests (prometheus_server.hpp).
#include "prometheus_server.hpp"

#include <algorithm>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "fsdp/common/error.hpp"
#include "http_client.hpp"
#include "processes.hpp"

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

long long msSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

// YAML's double-quoted scalar (targets and names come from tests, but quote them anyway).
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string configText(const PrometheusOptions& options, const std::vector<std::string>& targets) {
  std::ostringstream out;
  out << "# Written by the test harness (tests/support/prometheus_server.cpp).\n"
      << "global:\n"
      << "  scrape_interval: 1s\n"
      << "  scrape_timeout: 1s\n"
      << "  evaluation_interval: 1s\n"
      << "scrape_configs:\n"
      << "  - job_name: " << quoted(options.jobName) << "\n"
      // The agents label their samples with job=<run id>; keep it instead of the scrape job's.
      << "    honor_labels: true\n"
      << "    static_configs:\n"
      << "      - targets: [";
  for (std::size_t i = 0; i < targets.size(); ++i) out << (i > 0 ? ", " : "") << quoted(targets[i]);
  out << "]\n";
  return out.str();
}

}  // namespace

std::string prometheusMissing() {
  std::string why;
  if (fsdp::findExecutable("prometheus", &why)) return "";
  return "prometheus is not installed (" + why +
         "); scripts/install-deps installs Debian's prometheus package, as CI does";
}

std::string QueryWait::describe() const {
  std::string text = promql + " after " + std::to_string(waited.count()) + " ms: " +
                     (result.is_null() ? std::string("no successful query") : result.dump());
  if (!error.empty()) text += " (last error: " + error + ")";
  return text + "\n";
}

PrometheusServer::PrometheusServer(PrometheusOptions options)
    : options_(std::move(options)),
      configPath_(dir_.path() + "/prometheus.yml"),
      logPath_(dir_.path() + "/prometheus.log") {
  // The port is free when asked, not necessarily when Prometheus binds it: another process may
  // take it in between. Only that (an exit naming the address in use) is tried again.
  std::string why;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (startOnce(options_.startTimeout, why)) return;
    if (why.find("address already in use") == std::string::npos) break;
  }
  throw fsdp::Error("prometheus on 127.0.0.1:" + std::to_string(port_) + ": " + why + "\n" + logTail());
}

bool PrometheusServer::startOnce(std::chrono::milliseconds timeout, std::string& why) {
  port_ = freeLoopbackPort();
  std::vector<std::string> targets = options_.targets;
  if (options_.scrapeItself) targets.push_back(address());
  {
    std::ofstream config(configPath_, std::ios::trunc);
    config << configText(options_, targets);
    if (!config.flush()) {
      why = "cannot write " + configPath_;
      return false;
    }
  }
  const std::string data = dir_.path() + "/data";
  std::error_code ec;
  std::filesystem::remove_all(data, ec);  // a failed attempt's TSDB
  fsdp::SpawnOptions spawn{
      .argv = {"prometheus", "--config.file=" + configPath_, "--storage.tsdb.path=" + data,
               "--web.listen-address=" + address(),
               // A test's few minutes of samples: short retention, no lockfile, nothing kept.
               "--storage.tsdb.retention.time=1h", "--no-storage.tsdb.use-lockfile",
               // Samples older than this are not "current": a target that went away drops out
               // of instant queries quickly, not after the default 5 minutes.
               "--query.lookback-delta=30s", "--log.level=info"},
      .env = fsdp::currentEnvironment()};
  spawn.stdoutPath = dir_.path() + "/prometheus.out";  // it logs to stderr; stdout stays empty
  spawn.stderrPath = logPath_;
  process_.reset();  // a failed attempt's process (killed and reaped)
  process_.emplace(fsdp::ChildProcess::spawn(spawn));

  const auto start = Clock::now();
  const auto deadline = start + timeout;
  HttpReply reply;
  for (;;) {
    reply = httpGet("127.0.0.1", port_, "/-/ready", 2s);
    if (reply.status == 200) return true;
    // Paced by the process itself: an exit ends the wait at once.
    if (const auto status = process_->waitFor(100ms)) {
      why = "exited (" + fsdp::describeWaitStatus(*status) + ") before it was ready";
      if (readFile(logPath_).find("address already in use") != std::string::npos) {
        why += ": address already in use";
      }
      return false;
    }
    if (Clock::now() >= deadline) {
      why = "not ready after " + std::to_string(msSince(start)) + " ms (last /-/ready: " +
            (reply.status != 0 ? "HTTP " + std::to_string(reply.status) : reply.error) + ")";
      return false;
    }
  }
}

std::string PrometheusServer::address() const { return "127.0.0.1:" + std::to_string(port_); }

nlohmann::json PrometheusServer::query(const std::string& promql) const {
  const auto reply = httpGet("127.0.0.1", port_, "/api/v1/query?query=" + urlEncode(promql), 10s);
  if (reply.status == 0) {
    throw fsdp::Error("prometheus query '" + promql + "' on " + address() + ": " + reply.error);
  }
  const auto body = nlohmann::json::parse(reply.body, nullptr, false);
  if (!body.is_object()) {
    throw fsdp::Error("prometheus query '" + promql + "': HTTP " + std::to_string(reply.status) +
                      ", not JSON: " + reply.body.substr(0, 200));
  }
  if (body.value("status", "") != "success" || !body.contains("data") ||
      !body["data"].contains("result")) {
    throw fsdp::Error("prometheus query '" + promql + "': HTTP " + std::to_string(reply.status) +
                      ", " + body.value("errorType", "no errorType") + ": " +
                      body.value("error", body.dump()));
  }
  return body["data"]["result"];
}

QueryWait PrometheusServer::waitFor(const std::string& promql,
                                    const std::function<bool(const nlohmann::json&)>& done,
                                    std::chrono::milliseconds timeout) {
  QueryWait w;
  w.promql = promql;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  for (;;) {
    try {
      w.result = query(promql);
      w.error.clear();
      w.met = done(w.result);
    } catch (const fsdp::Error& e) {
      w.error = e.what();  // not answered yet: the next round asks again
    }
    w.waited = std::chrono::milliseconds(msSince(start));
    if (w.met || Clock::now() >= deadline) return w;
    // Paced by Prometheus itself (one scrape per second): if it exits, stop asking.
    if (const auto status = process_->waitFor(500ms)) {
      w.error = "prometheus exited (" + fsdp::describeWaitStatus(*status) + ")";
      return w;
    }
  }
}

std::string PrometheusServer::logTail(std::size_t lines) const {
  std::deque<std::string> tail;
  std::ifstream in(logPath_);
  std::string line;
  while (std::getline(in, line)) {
    tail.push_back(line);
    if (tail.size() > lines) tail.pop_front();
  }
  std::string text = "---- prometheus log (" + address() + ", last " + std::to_string(tail.size()) +
                     " lines)\n";
  for (const auto& line : tail) text += line + "\n";
  return text;
}

double sampleValue(const nlohmann::json& sample) {
  if (!sample.is_object() || !sample.contains("value") || !sample["value"].is_array() ||
      sample["value"].size() != 2 || !sample["value"][1].is_string()) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  // Prometheus writes the number as a string: "12", "1.5e+06", "NaN", "+Inf".
  return std::strtod(sample["value"][1].get<std::string>().c_str(), nullptr);
}

std::map<std::string, double> valuesBy(const nlohmann::json& result, const std::string& label) {
  std::map<std::string, double> values;
  if (!result.is_array()) return values;
  for (const auto& sample : result) {
    if (!sample.contains("metric") || !sample["metric"].contains(label)) continue;
    const auto& name = sample["metric"][label];
    if (name.is_string()) values[name.get<std::string>()] = sampleValue(sample);
  }
  return values;
}

}  // namespace fsdp::testing
