#pragma once
// The elastic agent: one per node. It joins the job's rendezvous (hosting the server when it
// runs on the endpoint's host, or an embedded loopback server for --standalone), spawns the
// node's workers with the torchrun environment, watches them (SIGCHLD through signalfd, no
// polling), and follows the rounds: a failed worker ends the round for every node (a restart
// counted against --max_restarts), a lost or new node too (not counted); every agent stops its
// workers, re-joins, and starts them again. Stop signals are forwarded to the workers' process
// groups, then SIGKILL after --shutdown_timeout.

#include <optional>
#include <string>
#include <vector>

#include "fsdp/launcher/net.hpp"
#include "fsdp/launcher/options.hpp"

namespace fsdp::launcher {

// A worker that failed, as agents report it to each other (through the server) and to the user.
struct Failure {
  int rank = -1;
  int localRank = -1;
  std::string node;
  int pid = -1;
  int waitStatus = 0;
  double secondsAfterStart = 0;
  std::string time;         // wall-clock time of the failure, ISO 8601 (UTC)
  int restartCount = 0;     // TORCHELASTIC_RESTART_COUNT of the failed worker
  std::string error;        // from its TORCHELASTIC_ERROR_FILE, if it wrote one
  std::string stderrTail;   // its last stderr lines
  std::string hang;         // the hang report, when the job hung (the rank is its first lagging one)
  // A program without flight records that failed after a while: the states and stacks of the
  // node's other workers still running then.
  std::string peers;

  std::string toJson() const;
  // Throws ProtocolError when malformed.
  static Failure fromJson(const std::string& json);
};

struct AgentResult {
  int exitCode = 0;  // 0, 1 (the job failed), 2 (usage), 128+N (signal N)
  std::optional<Failure> failure;  // the failure that ended the job, when one did
  std::string message;             // why the job ended, when not plainly
  int restarts = 0;                // restarts after failures
};

// Where and how this node meets the others.
struct RendezvousPlan {
  bool embedded = false;   // a private loopback server (standalone / single node)
  Endpoint endpoint;       // where agents and workers reach the server (multi-node)
  bool mayHost = false;    // try to serve the endpoint here (bind; on EADDRINUSE join it)
  bool mustHost = false;   // --rdzv_conf is_host=true: failing to bind is an error
  std::string bindHost;    // address the hosted server binds
  int preferredRank = -1;  // --node_rank, or Slurm's node id
};
// Throws ConfigError for incomplete multi-node settings.
RendezvousPlan planRendezvous(const LaunchOptions& options);

// Runs this node's part of the job to completion. Blocks the signals it handles in the calling
// thread (call it from main before other threads exist). Throws ConfigError (exit 2) for an
// unreachable endpoint, a busy explicit port, a token that cannot be read.
AgentResult runAgent(const LaunchOptions& options, const std::vector<std::string>& command);

// torchrun's rule for OMP_NUM_THREADS: 1 for every worker when several share the node and the
// user set none (workerEnvironment applies it; fsdprun warns once, in torchrun's words).
bool setsOneOmpThread(const LaunchOptions& options, bool userSetOmp);

// The worker environment (torchrun's variables and ours) on top of `base`.
struct WorkerIdentity {
  int localRank = 0;
  int rank = 0;
  int worldSize = 1;
  int localWorldSize = 1;
  int groupRank = 0;
  int groupWorldSize = 1;
  int restartCount = 0;
  int round = 0;
};
struct WorkerContact {
  std::string masterAddr = "127.0.0.1";
  int masterPort = 0;
  bool agentStore = false;  // MASTER_ADDR:MASTER_PORT is the rendezvous server itself
  std::string storeHost = "127.0.0.1";
  int storePort = 0;
  std::string localAddress = "127.0.0.1";
  std::string tokenFile;
  std::string errorFile;
  std::string node;
  std::string snapshotSocket;  // the agent's snapshot keeper (empty: none)
  std::string snapshotPeer;    // its peer stream, host:port
};
// The folder that holds fsdprun's Python module (a `fsdprun/` package inside): FSDPRUN_PYTHON_DIR,
// else beside this binary (build/python in a build tree, <prefix>/lib/fsdprun/python installed);
// "" when there is none. Workers get it on their PYTHONPATH, after the user's entries.
std::string pythonModuleDir();
std::vector<std::string> workerEnvironment(const LaunchOptions& options, const WorkerIdentity& id,
                                           const WorkerContact& contact,
                                           std::vector<std::string> base);

// The report of the failure that ended a job, several lines: who, how, when, its error file
// or its last stderr lines.
std::string describeFailure(const Failure& failure, int maxRestarts);
// The failure as torchrun writes the root cause where its own TORCHELASTIC_ERROR_FILE points (a
// worker's error file, "errorCode" added: {"message": {"message", "extraInfo": {"py_callstack",
// "timestamp"}, "errorCode"}}); made from the report where the worker wrote no file. `now`: Unix s.
std::string torchrunErrorJson(const Failure& failure, long long now);

// The resolved configuration and where each value came from (--dry_run).
std::string describeConfiguration(const LaunchOptions& options,
                                  const std::vector<std::string>& command);

}  // namespace fsdp::launcher
