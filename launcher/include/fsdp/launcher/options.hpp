#pragma once
// fsdprun's command line: torchrun's flags and meanings, both spellings ("--nproc_per_node"
// and "--nproc-per-node"), PET_<NAME> environment fallbacks, and where each value came from
// (for --dry_run).

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fsdp/common/env.hpp"
#include "fsdp/launcher/log_spec.hpp"
#include "fsdp/launcher/rdzv_conf.hpp"

namespace fsdp::launcher {

struct LaunchOptions {
  int minNodes = 1;
  int maxNodes = 1;
  int nprocPerNode = 1;
  std::optional<int> nodeRank;  // preferred node rank (torchrun's static backend needs it)
  bool standalone = false;
  std::string rdzvBackend = "static";
  std::string rdzvEndpoint;  // HOST[:PORT] as given; empty = none
  std::string rdzvId = "none";
  RdzvConf rdzvConf;
  int maxRestarts = 0;
  double monitorInterval = 0.1;  // accepted for compatibility; the agent is event driven
  std::string role = "default";
  std::string masterAddr = "127.0.0.1";
  std::optional<int> masterPort;
  std::string localAddr;  // the address this node advertises; empty = the one facing the server
  std::string logDir;
  StreamSpec redirects;
  StreamSpec tee;
  std::optional<std::set<int>> localRanksFilter;
  bool noPython = false;
  bool module = false;
  bool runPath = false;
  std::string startMethod = "spawn";
  // Signals the agent handles. SIGTERM, SIGINT, SIGHUP and SIGQUIT stop the job (forwarded,
  // then SIGKILL after the shutdown timeout); any other listed signal is only forwarded.
  std::vector<int> signalsToHandle;
  std::chrono::milliseconds shutdownTimeout{30000};
  // --hang_timeout: nullopt = auto (adapts to the job, see the flag's help); 0 = off.
  std::optional<std::chrono::milliseconds> hangTimeout;
  // --metrics_port: serve Prometheus /metrics there (0: a free port); nullopt: off.
  std::optional<int> metricsPort;
  std::string metricsAddr = "0.0.0.0";
  // Restarts in a row without a completed step before the job gives up (0: no limit).
  int maxStalledRestarts = 3;
  // Bytes of in-memory snapshots this node's agent may hold (0: none kept).
  std::uint64_t snapshotMemoryLimit = std::uint64_t{1} << 30;
  // Spare workers started ahead of a restart: each waits in fsdp::init() (program loaded, its
  // pre-init work done) and becomes the restarted worker when the group restarts as it was.
  bool standby = false;
  // --restart_mode: "auto" (survivors of a failure elsewhere re-form in process where they can)
  // or "process" (every worker starts again).
  std::string restartMode = "auto";
  bool dryRun = false;
  bool noSlurm = false;
  // --numa_binding: "" (none), node, socket, exclusive or core-complex (numa_binding.hpp).
  std::string numaBinding;
  // One line each for what was accepted for torchrun's sake and ignored (the flag and why).
  std::vector<std::string> warnings;
  std::vector<std::string> command;  // PROGRAM ARGS... as given
  // Where each setting came from, by option name: "flag", "environment PET_NNODES",
  // "default", "Slurm SLURM_NNODES", ...
  std::map<std::string, std::string> sources;
};

// Outcome of parsing: either options to run, or text to print and an exit code (--help,
// --version).
struct ParseResult {
  std::optional<LaunchOptions> options;
  std::string message;
  int exitCode = 0;
};

// Parses argv. Throws ConfigError (one line naming the flag or path and what was expected)
// on bad usage. `env` supplies PET_* fallbacks and the GPU count for "auto"/"gpu".
ParseResult parseCommandLine(int argc, const char* const* argv, const EnvLookup& env);

// Parses --nproc_per_node: a positive integer, "cpu", "auto" or "gpu".
int parseNprocPerNode(const std::string& value, int cpus, int gpus);

// Parses --nnodes "N" or "MIN:MAX" into (min, max).
std::pair<int, int> parseNnodes(const std::string& value);

// GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else the NVIDIA devices present.
int countGpus(const EnvLookup& env);

// The full command line for a worker: PROGRAM resolved and checked (exists, executable),
// `python3 -u` in front of a .py program, a module or --run_path unless --no_python.
std::vector<std::string> workerCommand(const LaunchOptions& options, const EnvLookup& env);

// Whether the executable at `path` is built with libfsdp (read, never run): --standby needs it.
bool usesLibfsdp(const std::string& path);

// The stop signals fsdprun handles by default, and the forward-only ones.
std::vector<int> defaultSignalsToHandle();
bool isStopSignal(int sig);

}  // namespace fsdp::launcher
