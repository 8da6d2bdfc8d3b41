#pragma once
// One job of `fsdp-bench recovery`: its launchers started, one rank's worker (or its agent)
// SIGKILLed by pid at a chosen moment while rank 0's metrics file is read as it grows, and
// every process of the job gone afterwards.

#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

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

}  // namespace fsdp::bench::recovery_job
