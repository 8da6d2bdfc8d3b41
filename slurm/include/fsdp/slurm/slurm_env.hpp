#pragma once
// What a Slurm job tells fsdprun through its SLURM_* environment: the nodes, this node's place
// among them, its GPUs and CPUs, and a rendezvous id and port derived from the job id, each
// with the name of the variable it came from (for `fsdprun --dry_run`: "nnodes: 2 (Slurm:
// SLURM_STEP_NUM_NODES)").
//
// Which variables, and why (checked against Slurm 22.05 with `env` in sbatch and srun):
// - Inside an srun step (SLURM_STEP_ID set) every per-node value describes the step:
//   SLURM_NODEID is the node's index in SLURM_STEP_NODELIST, not in SLURM_JOB_NODELIST
//   (`srun -N1 -w node2` in a 2-node job gives SLURM_NODEID=0), and the agents of fsdprun run
//   exactly on the step's nodes. So the node list, the node count and the tasks per node are
//   the step's (SLURM_STEP_NODELIST, SLURM_STEP_NUM_NODES, SLURM_STEP_TASKS_PER_NODE), and
//   the head node - the one that serves the rendezvous - is a node that runs an agent.
// - In the batch script (no SLURM_STEP_ID) they are the job's: SLURM_JOB_NODELIST,
//   SLURM_NNODES / SLURM_JOB_NUM_NODES, SLURM_TASKS_PER_NODE. fsdprun run there, without
//   srun, is one process on the first node: checkInsideStep() refuses a multi-node job then.
//
// Pure functions of an EnvLookup (thread-safe), except resolveHeadNode's lookup. Malformed
// values throw ConfigError naming the variable, its value and what was expected.

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/env.hpp"

namespace fsdp::slurm {

// A value read from (or derived from) the environment, with the variable(s) it came from,
// e.g. {2, "SLURM_STEP_NUM_NODES"} or {"41.0", "SLURM_JOB_ID.SLURM_STEP_ID"}.
template <typename T>
struct SlurmValue {
  T value{};
  std::string source;
};

// The first and last port of the range rendezvous ports are derived in (see rdzvPortFor).
constexpr int kRdzvPortBase = 20000;
constexpr int kRdzvPortCount = 10000;

struct SlurmJob {
  SlurmValue<long long> jobId;                  // SLURM_JOB_ID (or the older SLURM_JOBID)
  std::optional<SlurmValue<long long>> stepId;  // SLURM_STEP_ID / SLURM_STEPID; unset outside srun
  SlurmValue<std::string> rdzvId;               // "<job>" or "<job>.<step>"
  SlurmValue<std::vector<std::string>> nodes;   // expanded, in Slurm's order
  std::string nodeListExpression;               // as Slurm wrote it, e.g. "node[1-2]"
  SlurmValue<std::string> headNode;             // nodes.value.front()
  SlurmValue<int> numNodes;                     // equals nodes.value.size()
  std::optional<SlurmValue<int>> nodeId;        // SLURM_NODEID: index into nodes
  std::optional<SlurmValue<int>> tasksOnNode;   // fsdprun tasks Slurm started on this node
  std::optional<SlurmValue<int>> gpusOnNode;    // GPUs of this job (step) on this node
  std::optional<SlurmValue<int>> cpusOnNode;    // SLURM_CPUS_ON_NODE
  std::optional<SlurmValue<int>> restartCount;  // SLURM_RESTART_COUNT (requeued jobs)
  SlurmValue<int> rdzvPort;                     // rdzvPortFor(jobId, stepId)
};

// Reads the job from `env`. nullopt when SLURM_JOB_ID (and SLURM_JOBID) is unset or empty:
// not under Slurm. Throws ConfigError when a variable is malformed (naming it and its value)
// or the variables contradict each other (node count vs. node list, SLURM_NODEID out of
// range); the message suggests `--no_slurm` for an environment that only looks like Slurm.
std::optional<SlurmJob> readSlurmJob(const EnvLookup& env);

// The rendezvous port of a job step: kRdzvPortBase + (job % 625) * 16 + (step % 16), i.e.
// 20000..29999 - below Linux's ephemeral range (32768-60999, where connect() picks local
// ports) and far from the well-known ports. Jobs whose ids differ by less than 625 never share
// a port (consecutive jobs sharing a node do not clash), nor do steps 0..15 of one job. No step
// (the batch script) counts as step 0.
int rdzvPortFor(long long jobId, std::optional<long long> stepId);

// Workers per node for `--nproc_per_node auto` under Slurm: this node's GPUs when the job
// has any, else its CPUs (SLURM_CPUS_ON_NODE). nullopt when Slurm tells neither; the launcher
// then counts the node's own devices and CPUs.
std::optional<SlurmValue<int>> autoNprocPerNode(const SlurmJob& job);

// Sanity check: fsdprun starts the workers of a node itself, so inside an srun step it must
// run once per node. Throws ConfigError explaining the fix (srun --ntasks-per-node=1,
// --nproc_per_node N) when the step has more than one task on this node.
void checkOneTaskPerNode(const SlurmJob& job);

// Sanity check for taking the node count from Slurm: a multi-node job's batch script (or an
// salloc shell) is one process on one node, so fsdprun started there without srun would wait
// forever for the other nodes. Throws ConfigError explaining `srun fsdprun ...` then.
void checkInsideStep(const SlurmJob& job);

// One line per field, "nnodes: 2 (SLURM_STEP_NUM_NODES)", for logs and --dry_run.
std::vector<std::string> describe(const SlurmJob& job);

// Name resolution behind a seam, for tests.
struct HostLookup {
  std::vector<std::string> addresses;  // numeric, in getaddrinfo's order; empty on error
  std::string error;                   // gai_strerror text when the lookup failed
};
using HostResolver = std::function<HostLookup(const std::string& host)>;

// getaddrinfo(host, AF_UNSPEC, SOCK_STREAM).
HostResolver systemResolver();

// Resolves the head node to its first address. Throws ConfigError naming the host, the
// variable it came from and the resolver's error ("Slurm head node 'node1' (first host of
// SLURM_STEP_NODELIST=node[1-2]) does not resolve: Name or service not known").
std::string resolveHeadNode(const SlurmJob& job, const HostResolver& resolve = systemResolver());

}  // namespace fsdp::slurm
