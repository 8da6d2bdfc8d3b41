#pragma once
// The elastic agent's state (class Agent), private to the launcher: agent.cpp runs its rounds
// and workers; agent_rendezvous.cpp connects it to the rendezvous, joins rounds and moves the
// run to a successor when the server is lost.
//
// Thread-safety: none; one thread runs an Agent.

#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "agent_support.hpp"
#include "fsdp/common/deadline.hpp"
#include "fsdp/launcher/agent.hpp"
#include "fsdp/launcher/snapshot_keeper.hpp"
#include "fsdp/rendezvous/rdzv_client.hpp"
#include "fsdp/rendezvous/store_proxy.hpp"
#include "fsdp/rendezvous/store_server.hpp"
#include "../hang/agent_hooks.hpp"
#include "../metrics/agent_metrics.hpp"
#include "fsdp/common/metrics_http.hpp"
#include "../workers/guardian.hpp"
#include "../workers/numa_binding.hpp"
#include "../workers/worker_group.hpp"

struct pollfd;

namespace fsdp::launcher::detail {

using rendezvous::Assignment;
using Clock = Deadline::Clock;

// How a round ended for this node, once its workers are all gone.
struct Verdict {
  // kServerLost: the rendezvous connection failed; the run moves to a successor, if any.
  enum Kind { kRestart, kFinished, kFailed, kClosed, kServerLost } kind = kClosed;
  std::string reason;
  std::string failure;  // JSON, for kFailed (and kRestart after a failure)
};

// A stop signal arrived before any worker ran.
struct StopRequested {
  int sig;
};

class Agent {
 public:
  Agent(const LaunchOptions& options, std::vector<std::string> command)
      : options_(options),
        command_(std::move(command)),
        plan_(planRendezvous(options)),
        signals_(options.signalsToHandle),
        base_(currentEnvironment()),
        bindings_(numaBindings(options)) {
    for (const auto& arg : command_) program_ += (program_.empty() ? "" : " ") + arg;
  }

  AgentResult run();

 private:
  AgentResult rounds();
  void startRendezvous();
  // Connects to storeHost_:storePort_ (retrying until `deadline`); throws ConfigError naming the
  // endpoint when it cannot, StopRequested on a stop signal.
  void connect(const Deadline& deadline);
  // One connection attempt loop to storeHost_:storePort_ until `deadline`: true when connected.
  // Throws StopRequested, and ConfigError when something else answers there.
  bool tryConnect(const Deadline& deadline, std::string& error);
  // After the server was lost (lost_): the first of the last round's successors that serves
  // takes over; this agent starts serving when it is that successor. True when connected to a
  // server again (lost_ cleared), false when no successor answered.
  bool failover();
  // Whether successor `s` is this agent.
  bool isMe(const rendezvous::Successor& s) const;
  // The workers' way to the store after (re)connecting: this node's proxy, unless it serves.
  void startProxy();
  rendezvous::JoinRequest joinRequest() const;
  // Joins the next round; an assignment, or the job's end for this node.
  std::variant<Assignment, AgentResult> joinRound();
  std::optional<AgentResult> runRound(const Assignment& a);
  // Starts the spares of this node's workers for the restart after round `a` (--standby).
  void startStandby(const Assignment& a, const std::string& runDir, const detail::OutputOptions& output);
  std::vector<detail::WorkerSpec> workerSpecs(const Assignment& a, const std::string& attemptDir);
  // Polls the signalfd, the rendezvous connection and `extra` until something is ready or
  // `until`; heartbeats on the way.
  void waitForActivity(std::vector<pollfd>& fds, Clock::time_point until);
  std::optional<rendezvous::RendezvousEvent> takeEvent();
  AgentResult ended(int exitCode, std::string message, const std::string& failureJson = "");
  std::string endpointName() const {
    if (plan_.embedded) return "the embedded server";
    if (storeHost_ == plan_.endpoint.host && storePort_ == plan_.endpoint.port) return plan_.endpoint.str();
    return storeHost_ + ":" + std::to_string(storePort_);
  }

  const LaunchOptions& options_;
  const std::vector<std::string> command_;
  const RendezvousPlan plan_;
  SignalFd signals_;  // before any thread starts, so that every thread inherits the mask
  detail::Guardian guardian_;  // forked before any thread starts too
  const std::vector<std::string> base_;
  const std::vector<detail::Binding> bindings_;  // --numa_binding's, by local rank; empty: none
  ScratchDir scratch_;
  std::string token_;
  std::string tokenFile_;
  std::unique_ptr<rendezvous::StoreServer> server_;
  std::unique_ptr<rendezvous::RendezvousClient> client_;
  std::string storeHost_;
  int storePort_ = 0;
  // When set, this node's workers reach the store through it (on loopback), not directly.
  std::unique_ptr<rendezvous::StoreProxy> proxy_;
  // Holds this node's in-memory snapshots across worker restarts (with --max_restarts > 0).
  std::unique_ptr<SnapshotKeeper> keeper_;
  void startSnapshotKeeper();
  // --standby: the workers of the next restart, waiting in fsdp::init() (after guardian_, so
  // that they are stopped before it goes).
  std::unique_ptr<detail::WorkerGroup> standby_;
  // Logs, at warning level, each spare that exited while it waited (how, and its last words): a
  // restart then starts a new process instead, without it, and nothing else would say why.
  void noteSpareExits();
  // --restart_mode auto: the workers kept alive across the round that just ended, waiting in
  // their re-formation for the next one (agent_reform.cpp), and their local ranks.
  std::unique_ptr<detail::WorkerGroup> kept_;
  std::set<int> keptRanks_;
  bool reformMode() const { return options_.restartMode == "auto"; }
  // The workers of round `a`: the kept ones re-formed in process and the others started anew,
  // or nullptr (kept_ then gone) when the round does not let them keep their ranks.
  std::unique_ptr<detail::WorkerGroup> reformKept(const Assignment& a, const std::vector<detail::WorkerSpec>& specs,
                                                  const std::string& attemptDir);
  // The round ends with a failure elsewhere: which local workers go on in process (told to abort
  // their communicators); the others are to be stopped. None outside auto mode.
  std::set<int> keepSurvivors(detail::WorkerGroup& group, const std::string& why, const std::set<int>& stuck);
  std::string address_;  // this node's address for the others
  std::string node_;
  // This agent, among agents that may share node_ and address_ (agent_support.hpp).
  const std::string agentId_ = newAgentId();
  // After the rendezvous moved (failover), until the next round forms: who this agent waits for
  // (the last round's other members), and for how long at most (joinRequest()'s join timeout).
  std::optional<std::chrono::milliseconds> failoverWait_;
  std::string failoverWaitedFor_;
  int masterPort_ = 0;   // the MASTER_PORT this node offers, should it be node 0
  int restarts_ = 0;
  detail::StallCounter stalls_{options_.maxStalledRestarts};  // --max_stalled_restarts
  Clock::time_point nextHeartbeat_ = Clock::now();
  std::optional<std::string> lost_;  // the rendezvous connection failed: why
  std::optional<Assignment> last_;   // the last round this node was a member of
  std::vector<rendezvous::Successor> successors_;  // who serves should the server be lost
  std::string program_;  // the workers' command, as the server compares it between nodes
  // --metrics_port: last, so that the endpoint (whose scrapes read the server, the keeper and the
  // workers' rings through metrics_) goes first.
  std::unique_ptr<AgentMetrics> metrics_;
  std::unique_ptr<MetricsHttpServer> metricsHttp_;
  void startMetrics();
  // Tells the endpoint which rendezvous server this agent serves (nullptr: none) before the one
  // it served goes.
  void serving(const rendezvous::StoreServer* server) {
    if (metrics_) metrics_->setServer(server);
  }
};

}  // namespace fsdp::launcher::detail
