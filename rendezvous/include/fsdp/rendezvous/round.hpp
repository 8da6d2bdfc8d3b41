#pragma once
// Server-side rendezvous rounds of one run, as a pure state machine: inputs are joins,
// leaves, heartbeats, restart requests and the clock; outputs are events addressed to
// agents. No I/O, no threads: the server drives it from its event loop, tests drive it with
// a fake clock.
//
// A round completes at max_nodes at once, or at min_nodes after the last-call wait; a round
// after a restart completes as soon as every member of the previous round that is still
// connected is back. Node ranks are deterministic: in a run's first round, agents with a
// preferred rank first (by that rank), then by node name. Later rounds keep every returning
// member's node rank (its ranks, and the snapshots its node holds, stay put): a newcomer takes
// the rank of a lost node; when fewer nodes come back, the members close ranks in their old
// order. A member that leaves (connection closed, heartbeats missed), asks to restart, or a new
// node waiting while a round runs (and the round is below max_nodes) ends the round for
// everyone at once.
//
// Spares: a node that joins while a round runs at max_nodes waits (told so by a SPARE event
// that also names the successors) with no join timeout; it becomes a member in the next round
// that has room, normally in place of a lost node.
//
// Failover: a join carries the last round, node rank and restart count its agent saw, so a
// server started by a successor (the first reachable member of `successors` in the last
// assignment) goes on with the run's numbering and restart count. A join whose program differs
// from the run's is refused.
//
// Restarts: a round ended by a worker failure (endRound with a failure) counts against the
// run's max_restarts; membership changes do not. The count is the server's, so every node
// sees the same TORCHELASTIC_RESTART_COUNT, and when it is exhausted every node is told at
// once (RUN_FAILED, with the failure that used the last restart). A run finishes
// (RUN_FINISHED) when every member of the running round reports that its workers succeeded.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::rendezvous {

using AgentId = std::uint64_t;
using Clock = std::chrono::steady_clock;

struct JoinRequest {
  std::string node;           // node name (host name, or anything unique per agent)
  std::string address;        // address the node's workers are reachable on
  int localWorldSize = 1;
  int preferredRank = -1;     // e.g. SLURM_NODEID; -1 = none
  int masterPort = 0;         // the port this node would use as MASTER_PORT if it is node 0
  int minNodes = 1;
  int maxNodes = 1;
  int maxRestarts = 0;        // failures the run survives (fixed by the run's first join)
  std::chrono::milliseconds lastCallTimeout{1000};
  std::chrono::milliseconds joinTimeout{600000};
  std::chrono::milliseconds heartbeatTimeout{15000};
  // What the agent saw of the run so far (a server that took over goes on from there).
  int lastRound = -1;         // the last round it was a member of; -1 = none
  int lastRank = -1;          // its node rank in that round
  int restarts = 0;           // the run's restart count in that round
  std::string program;        // the command its workers run; "" = not checked
  bool servesRendezvous = false;  // this agent hosts the server: never its own successor
  // Unique to the agent process (random, made at its start): several agents may share one host
  // name and one address (elasticity tried on one machine), so neither tells them apart.
  std::string agentId;        // "" = an agent that sends none
};

// A member that may serve the rendezvous when its host is lost. An agent recognises itself by
// its agent id (by node and address only when the id is empty).
struct Successor {
  std::string node;
  std::string address;
  std::string agentId;
};

struct Assignment {
  int round = 0;
  int nodeRank = 0;
  int rankOffset = 0;  // global rank of this node's local rank 0
  int worldSize = 0;   // sum of every member's local world size
  int nnodes = 0;
  std::string masterAddr;
  int masterPort = 0;
  int restartCount = 0;       // rounds ended by a worker failure so far
  bool pytorchStore = false;  // PyTorch's TCPStore clients may use the server for this run
  // The members that take over serving, in this order, should the server be lost: by node
  // rank, without the agent that serves it; at most kMaxSuccessors.
  std::vector<Successor> successors;
};

inline constexpr std::size_t kMaxSuccessors = 8;

enum class EventKind : std::uint8_t {
  kAssigned = 1,    // the answer to a join
  kRoundEnded = 2,  // re-join to continue
  kRunClosed = 3,   // final
  kJoinFailed = 4,  // a join that cannot be served (timeout, bad parameters)
  kDisconnect = 5,  // the server should close this agent's connection (missed heartbeats)
  kRunFinished = 6, // every member's workers succeeded; final
  kRunFailed = 7,   // a failure with no restart left; final
  kSpare = 8,       // the run is at max_nodes: this agent waits as a spare (successors set)
};

struct Event {
  AgentId agent = 0;
  EventKind kind = EventKind::kAssigned;
  Assignment assignment;  // kAssigned
  std::string reason;     // the others
  // kRoundEnded/kRunFailed after a worker failure: the failure as the reporting agent
  // described it (a JSON object, passed through unread); empty otherwise.
  std::string failure;
};

std::string encodeJoin(const JoinRequest& join);
// Throws ProtocolError on malformed or out-of-range input.
JoinRequest decodeJoin(const std::string& json);
std::string encodeAssignment(const Assignment& a);
Assignment decodeAssignment(const std::string& json);
// The wire form of an event's payload (assignment JSON, or reason and failure).
std::string encodeEventPayload(const Event& event);
// Fills event.assignment or event.reason/failure from a payload; throws ProtocolError.
void decodeEventPayload(const std::string& payload, Event& event);

class RoundState {
 public:
  std::vector<Event> join(AgentId agent, JoinRequest request, Clock::time_point now);
  // The agent's connection closed (or it is gone for another reason).
  std::vector<Event> leave(AgentId agent, const std::string& reason, Clock::time_point now);
  void heartbeat(AgentId agent, Clock::time_point now);
  // A member asks everyone to restart. With a `failure` (one of its workers failed) the
  // restart counts against max_restarts; past it the run fails for everyone.
  std::vector<Event> endRound(AgentId agent, const std::string& reason, Clock::time_point now,
                              const std::string& failure = "");
  // Every worker of the member's node exited 0. The run finishes when all members said so.
  std::vector<Event> succeeded(AgentId agent);
  // Final: everyone (members, waiters, later joiners) is told `reason`.
  std::vector<Event> close(const std::string& reason);
  // Last-call expiry, join timeouts, missed heartbeats.
  std::vector<Event> tick(Clock::time_point now);
  // When tick() next has something to do; nullopt when nothing is pending.
  std::optional<Clock::time_point> nextDeadline() const;

  int round() const { return round_; }
  int restartCount() const { return failures_; }
  bool running() const { return !members_.empty(); }
  bool closed() const { return closed_; }
  std::size_t waitingCount() const { return waiting_.size(); }
  std::size_t memberCount() const { return members_.size(); }

 private:
  struct Waiter {
    JoinRequest request;
    Clock::time_point joinedAt;
    std::uint64_t order;
  };
  struct Member {
    JoinRequest request;
    Clock::time_point lastSeen;
    bool succeeded = false;
  };
  std::vector<Event> endRunningRound(Clock::time_point now, const std::string& reason,
                                     const std::string& failure = "");
  Event spareEvent(AgentId agent, const std::string& node) const;
  std::vector<Successor> successorsOf(const std::vector<std::pair<AgentId, const JoinRequest*>>& ranked) const;
  std::vector<Event> finish(EventKind kind, const std::string& reason, const std::string& failure);
  std::vector<Event> tryComplete(Clock::time_point now, bool lastCallExpired);
  void armLastCall(Clock::time_point now);

  std::map<AgentId, Waiter> waiting_;
  std::map<AgentId, Member> members_;
  std::optional<Clock::time_point> lastCallAt_;
  // When the last round ended: waiters' join timeouts count from then (spares wait untimed).
  Clock::time_point idleSince_{};
  std::vector<Successor> successors_;  // of the running round
  int round_ = -1;  // number of the last completed round
  int failures_ = 0;  // rounds ended by a worker failure
  // Members of the round that ended last and are still connected: once all of them are
  // back, the next round completes without the last-call wait.
  std::vector<AgentId> previous_;
  bool closed_ = false;
  std::string closeReason_;
  std::uint64_t joinOrder_ = 0;
  // Parameters of the run, fixed by its first join.
  std::optional<JoinRequest> params_;
};

}  // namespace fsdp::rendezvous
