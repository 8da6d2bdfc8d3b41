#pragma once
// One job of `fsdp-bench recovery`: its launchers started, one rank's worker (or its agent)
// SIGKILLed by pid at a chosen moment while rank 0's metrics file is read as it grows, and
// every process of the job gone afterwards. Also the 3-rank mnist job `hang` and `telemetry` run
// through it, and the step cost read from its metrics.

#include <chrono>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bench.hpp"
#include "fsdp/common/process.hpp"

namespace fsdp::bench::recovery_job {

// Seconds since the epoch, the clock of the trainers' metrics lines.
double unixNow();
// The folder of this fsdp-bench binary (fsdprun, fsdprun-rdzv, mnist and gpt live there too).
std::string binDir();

// The launchers' environment: this one's, OMP_NUM_THREADS=1 (ranks on 2 cores, on both sides),
// fsdprun's malloc setting for torchrun's workers too, and FSDP_BENCH_RECOVERY_RUN=runId, by
// which runJob finds what a job left behind.
std::vector<std::string> jobEnvironment(const std::string& runId);

// A private scratch directory, removed with what is in it unless keep() was called.
class RunDir {
 public:
  RunDir();
  ~RunDir();
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;
  const std::string& path() const { return path_; }
  void keep() { keep_ = true; }

 private:
  std::string path_;
  bool keep_ = false;
};

// fsdprun-rdzv on a free loopback port, stopped with SIGTERM by the destructor: the endpoint
// of the multi-agent jobs (unless an agent serves it), outside every agent, so that killing an
// agent leaves it serving.
// Throws Error when it does not report its port within 10 s.
class RdzvServer {
 public:
  explicit RdzvServer(const std::string& logPath);
  ~RdzvServer();
  RdzvServer(const RdzvServer&) = delete;
  RdzvServer& operator=(const RdzvServer&) = delete;
  int port() const { return port_; }

 private:
  std::optional<ChildProcess> process_;
  int port_ = 0;
};

enum class Kill { kNone, kWorker, kAgent };

// What to start: every launcher of one job at once.
struct Launch {
  std::vector<std::vector<std::string>> agents;  // one argv per launcher
  std::vector<std::string> env;                  // of every launcher (their workers inherit it)
  std::string runId;                             // the --rdzv_id given to the launchers
  std::string metricsFile;                       // rank 0's, in a folder of its own (the same
                                                 // path on every launcher: whichever holds rank 0
                                                 // after a restart appends to it)
};

// What one job did.
struct Observed {
  std::vector<nlohmann::json> lines;   // the metrics file, in order
  double loadBefore = 0;               // 1-minute load average when the job started
  std::optional<double> killUnixTime;  // just before the kill, when there was one
  bool workerDiedWithAgent = true;     // false: alive 3 s after its agent's SIGKILL (then killed)
  bool finished = false;               // every launcher not killed exited 0
  std::string error;                   // why not, or what went wrong on the way
  std::string logDir;                  // the launchers' output, where it was kept
  // The workers' pids by rank just before the kill (spares left out), and the ranks whose
  // process of then still ran once rank 0 wrote its resume line.
  std::map<int, int> pidsAtKill;
  std::optional<std::set<int>> ranksStillRunning;
  // After an agent kill: the index of the launcher killed in Launch::agents.
  std::optional<std::size_t> killedLauncher;
  // The last JSON object a launcher not killed printed on stdout: the summary of the final rank 0
  // ({"world_size": ...}); null when none did.
  nlohmann::json summary;
};

// When to kill: once rank 0 has completed `afterStep` steps, `fractionOfStep` of its median
// step time later (a random moment of the next step); whom: the worker of RANK=`rank` of the
// first attempt, or its launcher.
struct KillAt {
  long long afterStep = 0;
  double fractionOfStep = 0;
  int rank = 1;
};

// Starts the launchers (each with `launch.env`, output in `dir`), waits for the moment `at`,
// SIGKILLs the process with RANK=at.rank and TORCHELASTIC_RUN_ID=launch.runId under them
// (kWorker) or the launcher it runs under (kAgent), and waits for the job to end, at most
// `limit`. Then kills whatever carries FSDP_BENCH_RECOVERY_RUN=launch.runId in its environment:
// the caller puts it in `launch.env`. Failures are reported in Observed::error, not thrown.
Observed runJob(const Launch& launch, const RunDir& dir, Kill kill, KillAt at,
                std::chrono::seconds limit);

// The job of `fsdp-bench hang` and `telemetry`: fsdprun, 3 ranks, --max_restarts 1, --hang_timeout
// `hangTimeout`, running mnist's `model` (no dropout, no evaluation) for `steps` steps of 48
// samples, rank 0's metrics line every step into `metrics`; with `stallStep` > 0, rank 1 stops
// itself (SIGSTOP) after that step. Launcher flags go in at index 1, before the program.
inline std::vector<std::string> mnistJob(const std::string& runId, const std::string& metrics,
                                         const std::string& hangTimeout, long long steps, long long stallStep,
                                         const std::string& model) {
  const std::string bin = binDir();
  std::vector<std::string> argv = {bin + "/fsdprun", "--nproc_per_node", "3", "--max_restarts", "1",
                                   "--rdzv_id", runId, "--hang_timeout", hangTimeout,
                                   bin + "/mnist", "--model", model, "--no_dropout", "--no_eval",
                                   "--progress", "none", "--batch_size", "48", "--max_steps", std::to_string(steps),
                                   "--log_every", "1", "--metrics_file", metrics};
  if (stallStep > 0) {
    argv.insert(argv.end(), {"--fault_kill_at_step", std::to_string(stallStep), "--fault_kill_rank", "1",
                             "--fault_kind", "stop"});
  }
  return argv;
}

// The median of step_time_ms past the first 3 steps of rank 0's metrics lines (0 when none), and
// the collectives recorded per step over those steps.
inline std::pair<double, double> stepCost(const Observed& seen) {
  std::vector<double> times;
  double firstCollectives = -1, lastCollectives = -1, firstStep = 0, lastStep = 0;
  for (const auto& l : seen.lines) {
    if (l.value("type", "") != "train" || l.value("step", 0LL) <= 3) continue;
    times.push_back(l.value("step_time_ms", 0.0));
    const double c = l.value("collectives", 0.0);
    if (firstCollectives < 0) {
      firstCollectives = c;
      firstStep = l.value("step", 0.0);
    }
    lastCollectives = c;
    lastStep = l.value("step", 0.0);
  }
  const double perStep = lastStep > firstStep ? (lastCollectives - firstCollectives) / (lastStep - firstStep) : 0;
  return {times.empty() ? 0.0 : percentile(times, 0.5), perStep};
}

// ---- figures (recovery_job.cpp) ---------------------------------------------------------

// Steps left out of the step-time medians after each start and resume, and never a kill step.
inline constexpr int kWarmupSteps = 3;
// ... and after each resume, whose first steps stay slower for a while (new processes make their
// snapshot buffers, the next spare starts): steps_after_ms shows them, the medians leave them out.
inline constexpr int kStepsAfterResume = 5;
// The median of `v`; -1 when empty.
double median(std::vector<double> v);
// Median step time of the train lines from index `from` on, the first kWarmupSteps left out and
// kStepsAfterResume after each resume line; -1 when none.
double stepMs(const std::vector<nlohmann::json>& lines, std::size_t from = 0);
// Fills the figures of a kill from the metrics lines: steps redone, kill -> restored, -> first
// step, -> caught up, the recovery overhead, the first steps' durations after the resume.
void killFigures(const Observed& seen, nlohmann::json& line);
// Fills what a job of more than two nodes shows besides the kill figures: the world size rank 0
// reported at the end, the launcher killed, the last step in the metrics file (the new rank 0
// appends to it). A world size other than expected, or (agentHosts) a kill of another agent than
// the rendezvous host, is an error of the line.
void nodeFigures(bool agentHosts, int worldAfter, Observed& seen, nlohmann::json& line);

}  // namespace fsdp::bench::recovery_job
