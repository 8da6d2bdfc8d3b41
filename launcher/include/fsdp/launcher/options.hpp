#pragma once
// fsdprun's command line: torchrun's flags and meanings, both spellings ("--nproc_per_node"
// and "--nproc-per-node"), PET_<NAME> environment fallbacks.

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/env.hpp"

namespace fsdp::launcher {

struct LaunchOptions {
  int minNodes = 1;
  int maxNodes = 1;
  int nprocPerNode = 1;
  bool standalone = false;
  std::string rdzvBackend = "static";
  std::string rdzvEndpoint;
  std::string rdzvId = "none";
  int maxRestarts = 0;
  double monitorInterval = 0.1;  // accepted for compatibility; the agent is event driven
  std::string role = "default";
  std::string masterAddr = "127.0.0.1";
  std::optional<int> masterPort;
  bool noPython = false;
  bool module = false;
  std::chrono::milliseconds shutdownTimeout{30000};
  bool dryRun = false;
  std::vector<std::string> command;  // PROGRAM ARGS... as given
};

// Outcome of parsing: either options to run, or text to print and an exit code (--help,
// --version).
struct ParseResult {
  std::optional<LaunchOptions> options;
  std::string message;
  int exitCode = 0;
};

// Parses argv. Throws ConfigError (one line naming the flag or path and what was expected)
// on bad usage. `env` supplies PET_* fallbacks.
ParseResult parseCommandLine(int argc, const char* const* argv, const EnvLookup& env);

// Parses --nproc_per_node: a positive integer, "cpu", "auto" or "gpu".
int parseNprocPerNode(const std::string& value, int cpus, int gpus);

// Parses --nnodes "N" or "MIN:MAX" into (min, max).
std::pair<int, int> parseNnodes(const std::string& value);

// The full command line for a worker: PROGRAM resolved and checked (exists, executable),
// `python3 -u` in front of a .py program or a module unless --no_python.
std::vector<std::string> workerCommand(const LaunchOptions& options, const EnvLookup& env);

}  // namespace fsdp::launcher
