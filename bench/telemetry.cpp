// fsdp-bench telemetry: what libfsdp's step timing (every step split into compute, waiting in
// collectives and waiting for data, and the straggler reports fed from it) and the agent's
// /metrics cost a training job. timing: the 3-rank DeepNet job of `hang` with FSDPRUN_STEP_TIMING=1
// vs 0, alternating, plus the recorder's hot paths timed in child processes (the variable is read
// once per process) with timing on and off. scrape: the same job with --metrics_port, its
// /metrics fetched in a tight loop from a thread here vs not fetched.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "bench.hpp"
#include "comm/recorded_communicator.hpp"
#include "fsdp/common/error.hpp"
#include "null_communicator.hpp"
#include "recovery_job.hpp"

namespace fsdp::bench {
namespace {

using namespace recovery_job;
using Clock = std::chrono::steady_clock;

// `env` with NAME=value in place of any NAME= it had.
std::vector<std::string> withVariable(std::vector<std::string> env, const std::string& name,
                                      const std::string& value) {
  std::erase_if(env, [&](const std::string& e) { return e.starts_with(name + "="); });
  env.push_back(name + "=" + value);
  return env;
}

// The body of GET /metrics from 127.0.0.1:`port`, one request per connection, all of it within
// `timeout`; nullopt when refused, cut short, late or not a 200.
std::optional<std::string> getMetrics(std::uint16_t port, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  struct Socket {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ~Socket() {
      if (fd >= 0) ::close(fd);
    }
  } owner;
  const int fd = owner.fd;
  if (fd < 0) throwErrno("telemetry: socket", errno);
  const timeval tv{.tv_sec = timeout.count() / 1000, .tv_usec = (timeout.count() % 1000) * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);  // bounds connect() and send()
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return std::nullopt;
  const std::string request =
      "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return std::nullopt;
  }
  std::string reply;
  char buf[16384];
  for (;;) {  // the server closes after its reply (Connection: close)
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd pfd{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&pfd, 1, static_cast<int>(left)) <= 0) return std::nullopt;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) break;
    if (n < 0 && errno != EINTR) return std::nullopt;
    if (n > 0) reply.append(buf, static_cast<std::size_t>(n));
  }
  const auto body = reply.find("\r\n\r\n");
  if (!reply.starts_with("HTTP/1.1 200") || body == std::string::npos) return std::nullopt;
  return reply.substr(body + 4);
}

// A thread fetching /metrics back to back until stop(); after a refused or failed fetch (the
// endpoint not up yet, or gone) it waits 10 ms rather than spin on the job's cores.
class Scraper {
 public:
  struct Figures {
    std::vector<double> latencyMs, pageBytes;
    double activeSeconds = 0;  // first to last successful fetch
  };
  explicit Scraper(std::uint16_t port)
      : thread_([this, port](std::stop_token stop) { run(stop, port); }) {}
  Figures stop() {
    thread_.request_stop();
    thread_.join();
    return figures_;
  }

 private:
  void run(const std::stop_token& stop, std::uint16_t port) {
    std::optional<Clock::time_point> first;
    while (!stop.stop_requested()) {
      const auto start = Clock::now();
      if (const auto page = getMetrics(port, std::chrono::seconds(5))) {
        const auto end = Clock::now();
        figures_.latencyMs.push_back(
            std::chrono::duration<double, std::milli>(end - start).count());
        figures_.pageBytes.push_back(static_cast<double>(page->size()));
        if (!first) first = start;
        figures_.activeSeconds = std::chrono::duration<double>(end - *first).count();
        continue;
      }
      std::unique_lock lock(mutex_);
      backoff_.wait_for(lock, stop, std::chrono::milliseconds(10), [] { return false; });
    }
  }
  Figures figures_;  // the thread's until stop() joins it
  std::mutex mutex_;
  std::condition_variable_any backoff_;
  std::jthread thread_;  // last: started once the members above exist
};

// One run of the deep job with `variables` set and `launcherFlags` given to fsdprun: stepCost.
std::pair<double, double> deepJob(const std::string& name, long long rep, long long steps,
                                  const std::vector<std::pair<std::string, std::string>>& variables,
                                  const std::vector<std::string>& launcherFlags) {
  RunDir dir;
  const std::string runId =
      "bench-telemetry-" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(rep);
  const std::string metrics = dir.path() + "/metrics.jsonl";
  auto argv = mnistJob(runId, metrics, "auto", steps, 0, "deep");
  argv.insert(argv.begin() + 1, launcherFlags.begin(), launcherFlags.end());
  auto env = jobEnvironment(runId);
  for (const auto& [variable, value] : variables)
    env = withVariable(std::move(env), variable, value);
  const auto seen =
      runJob({{argv}, env, runId, metrics}, dir, Kill::kNone, {}, std::chrono::seconds(600));
  if (!seen.error.empty() || !seen.finished) {
    throw Error(std::string("telemetry: the ") + name + " job (rep " + std::to_string(rep) +
                ") did not finish: " + seen.error);
  }
  return stepCost(seen);
}

// `fsdp-bench telemetry_micro` in a child process with FSDPRUN_STEP_TIMING=`timing`: its line.
nlohmann::json microInChild(bool timing) {
  RunDir dir;
  SpawnOptions options{.argv = {selfExe(), "telemetry_micro"}, .env = currentEnvironment()};
  options.env = withVariable(withVariable(std::move(options.env), "FSDPRUN_FLIGHT_RECORDER", "1"),
                             "FSDPRUN_STEP_TIMING", timing ? "1" : "0");
  options.stdoutPath = dir.path() + "/out";
  auto child = ChildProcess::spawn(options);
  const auto status = child.waitFor(std::chrono::seconds(120));
  std::ifstream in(dir.path() + "/out");
  std::string line;
  std::getline(in, line);
  if (!status || *status != 0 || line.empty() || line[0] != '{') {
    throw Error(std::string("telemetry: the micro-benchmark child (FSDPRUN_STEP_TIMING=") +
                (timing ? "1" : "0") + ") failed: " +
                (status ? describeWaitStatus(*status) : "still running after 120 s") +
                ", printed '" + line + "'");
  }
  return nlohmann::json::parse(line);
}

void timingCase(long long steps, long long reps) {
  // Straggler reports every `every` steps (default 20) so that even a short job publishes a few
  // windows inside the measured steps: as often as the default or more, a bound from above.
  const long long every = std::min(20LL, std::max(2LL, steps / 4));
  std::vector<double> on, off, ratios;
  double collectivesPerStep = 0;
  std::map<bool, std::vector<double>> collectiveNs, stepMarksNs;
  for (long long rep = 0; rep < reps; ++rep) {
    // Which side runs first alternates: on this VM a run is slower or faster by where it falls.
    for (const bool timing : {rep % 2 == 0, rep % 2 != 0}) {
      const auto [ms, collectives] = deepJob(timing ? "on" : "off", rep, steps,
                                             {{"FSDPRUN_FLIGHT_RECORDER", "1"},
                                              {"FSDPRUN_STEP_TIMING", timing ? "1" : "0"},
                                              {"FSDPRUN_STRAGGLER_EVERY", std::to_string(every)}},
                                             {});
      (timing ? on : off).push_back(ms);
      if (timing) collectivesPerStep = collectives;
      const auto micro = microInChild(timing);
      collectiveNs[timing].push_back(micro.at("ns_per_collective").get<double>());
      stepMarksNs[timing].push_back(micro.at("ns_per_step_marks").get<double>());
    }
    if (off.back() > 0) ratios.push_back(on.back() / off.back());
  }
  const double stepMs = percentile(on, 0.5);
  const double collectiveOn = percentile(collectiveNs[true], 0.0),
               collectiveOff = percentile(collectiveNs[false], 0.0);
  const double marksOn = percentile(stepMarksNs[true], 0.0),
               marksOff = percentile(stepMarksNs[false], 0.0);
  const double timingNs = std::max(0.0, collectiveOn - collectiveOff) * collectivesPerStep +
                                 std::max(0.0, marksOn - marksOff);
  emit({{"bench", "telemetry"}, {"case", "timing"}, {"model", "deep"}, {"ranks", 3},
        {"steps", steps}, {"reps", reps}, {"straggler_every", every},
        {"step_ms_timing_on", stepMs}, {"step_ms_timing_off", percentile(off, 0.5)},
        {"median_ratio_on_over_off", ratios.empty() ? 0.0 : percentile(ratios, 0.5)},
        {"collectives_per_step", collectivesPerStep},
        {"micro_ns_per_collective_timing_on", collectiveOn},
        {"micro_ns_per_collective_timing_off", collectiveOff},
        {"micro_ns_per_step_marks_timing_on", marksOn},
        {"micro_ns_per_step_marks_timing_off", marksOff},
        {"micro_timing_share_of_step_pct", stepMs > 0 ? 100.0 * timingNs / (stepMs * 1e6) : 0.0},
        {"note",
         "step_ms_*: median step_time_ms past step 3 of rank 0, medians over reps (flight "
         "recorder on both sides; straggler reports every straggler_every steps when on). micro_*: "
         "the recorder on a null communicator in a child process with FSDPRUN_STEP_TIMING=1 or 0, "
         "best of reps: ns per recorded allReduce(...).wait() under a CommTag, and ns per step's "
         "own marks (a DataWait, reportStep, markProgress; no straggler monitor there). "
         "micro_timing_share_of_step_pct: (on - off) per collective x collectives_per_step + (on - "
         "off) per step's marks, over step_ms_timing_on"}});
}

void scrapeCase(long long steps, long long reps) {
  std::vector<double> scraped, unscraped, ratios, latencyMs, pageBytes;
  double scrapes = 0, activeSeconds = 0;
  for (long long rep = 0; rep < reps; ++rep) {
    for (const bool scrape : {rep % 2 == 0, rep % 2 != 0}) {
      const std::uint16_t port = freePort();
      const std::vector<std::string> flags = {"--metrics_port", std::to_string(port),
                                              "--metrics_addr", "127.0.0.1"};
      const std::vector<std::pair<std::string, std::string>> variables = {
          {"FSDPRUN_FLIGHT_RECORDER", "1"}, {"FSDPRUN_STEP_TIMING", "1"}};
      if (!scrape) {
        unscraped.push_back(deepJob("unscraped", rep, steps, variables, flags).first);
        continue;
      }
      Scraper scraper(port);
      const double ms = deepJob("scraped", rep, steps, variables, flags).first;
      auto figures = scraper.stop();
      scraped.push_back(ms);
      scrapes += static_cast<double>(figures.latencyMs.size());
      activeSeconds += figures.activeSeconds;
      latencyMs.insert(latencyMs.end(), figures.latencyMs.begin(), figures.latencyMs.end());
      pageBytes.insert(pageBytes.end(), figures.pageBytes.begin(), figures.pageBytes.end());
    }
    if (unscraped.back() > 0) ratios.push_back(scraped.back() / unscraped.back());
  }
  emit({{"bench", "telemetry"}, {"case", "scrape"}, {"model", "deep"}, {"ranks", 3},
        {"steps", steps}, {"reps", reps}, {"step_ms_scraped", percentile(scraped, 0.5)},
        {"step_ms_unscraped", percentile(unscraped, 0.5)},
        {"median_ratio_scraped_over_unscraped", ratios.empty() ? 0.0 : percentile(ratios, 0.5)},
        {"scrapes", scrapes},
        {"scrapes_per_second", activeSeconds > 0 ? scrapes / activeSeconds : 0.0},
        {"scrape_ms_median", percentile(latencyMs, 0.5)},
        {"scrape_ms_p99", percentile(latencyMs, 0.99)},
        {"page_bytes_median", percentile(pageBytes, 0.5)},
        {"note",
         "both sides serve /metrics (--metrics_port); the scraped side's is fetched back to back "
         "by one thread of the bench (whose CPU shares the job's cores), a new connection each, "
         "over the whole job. step_ms_*: median step_time_ms past step 3 of rank 0, medians over "
         "reps"}});
}

}  // namespace

int telemetryMicro() {
  auto recorded = worker::detail::recordCollectives(std::make_unique<NullCommunicator>(), "world");
  const double collectiveNs = nsPerCollective(*recorded, 200000);
  // A step's own marks, as the Trainer makes them: its batch's data wait, its figures, its mark.
  constexpr int kSteps = 200000;
  std::int64_t step = 0;
  double best = 1e18;
  for (int run = 0; run < 5; ++run) {
    const auto start = Clock::now();
    for (int i = 0; i < kSteps; ++i) {
      {
        const DataWait data;  // a batch that was ready at once
      }
      reportStep(48, 0, 0.5);
      markProgress(++step, "trainer step");
    }
    best = std::min(
        best, std::chrono::duration<double, std::nano>(Clock::now() - start).count() / kSteps);
  }
  emit({{"step_timing", worker::detail::FlightRecorder::process().timing()},
        {"ns_per_collective", collectiveNs},
        {"ns_per_step_marks", best}});
  return 0;
}

void telemetry(const Args& args) {
  const long long steps = args.ints("steps", "24").front();
  const long long reps = args.ints("reps", "2").front();
  const std::string cases = args.str("cases", "timing,scrape");
  std::stringstream in(cases);
  std::vector<std::string> which;
  for (std::string c; std::getline(in, c, ',');) {
    if (c != "timing" && c != "scrape")
      throw ConfigError("--cases '" + cases + "': expected timing and/or scrape");
    which.push_back(c);
  }
  for (const auto& c : which) {
    if (c == "timing") timingCase(steps, reps);
    if (c == "scrape") scrapeCase(steps, reps);
  }
}

}  // namespace fsdp::bench
