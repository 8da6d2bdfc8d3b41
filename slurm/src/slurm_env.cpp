#include "fsdp/slurm/slurm_env.hpp"

#include <netdb.h>
#include <sys/socket.h>

#include <cerrno>
#include <initializer_list>
#include <limits>
#include <memory>

#include "fsdp/common/error.hpp"
#include "fsdp/slurm/hostlist.hpp"

namespace fsdp::slurm {
namespace {

// Step ids Slurm reserves for pseudo steps (batch script 0xfffffffe, extern 0xffffffff,
// interactive 0xfffffffa, pending 0xfffffffd, ...): not an srun step of the user.
constexpr long long kFirstPseudoStepId = 0xfffffff0LL;
constexpr char kNoSlurmHint[] = " (run with --no_slurm to ignore the SLURM_* environment)";

struct Found {
  std::string name;
  std::string value;
};

// The first of `names` that is set and non-empty.
std::optional<Found> firstSet(const EnvLookup& env, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (auto value = env(name); value && !value->empty()) return Found{name, std::move(*value)};
  }
  return std::nullopt;
}

[[noreturn]] void badVariable(const Found& var, const std::string& expected) {
  throw ConfigError("environment variable " + var.name + "='" + var.value + "': expected " +
                    expected + kNoSlurmHint);
}

long long integer(const Found& var, long long min, long long max, const std::string& expected) {
  const auto n = parseInt(var.value);
  if (!n || *n < min || *n > max) badVariable(var, expected);
  return *n;
}

int smallInt(const Found& var, int min, const std::string& expected) {
  return static_cast<int>(integer(var, min, std::numeric_limits<int>::max(), expected));
}

// Entries of a comma-separated GPU list ("0,1,3"; CUDA_VISIBLE_DEVICES may hold UUIDs).
int countGpuList(const std::string& list, bool cudaSemantics) {
  if (cudaSemantics && list == "NoDevFiles") return 0;  // what Slurm writes for no GPUs
  int count = 0;
  std::size_t start = 0;
  while (start <= list.size()) {
    const auto end = std::min(list.find(',', start), list.size());
    const std::string entry = list.substr(start, end - start);
    // CUDA stops at the first invalid entry; "-1" is the usual way to hide every device.
    if (cudaSemantics && (entry.empty() || entry.front() == '-')) break;
    if (!entry.empty()) ++count;
    start = end + 1;
  }
  return count;
}

std::optional<SlurmValue<int>> readGpus(const EnvLookup& env, bool inStep) {
  if (const auto v = firstSet(env, {"SLURM_GPUS_ON_NODE"})) {
    return SlurmValue<int>{smallInt(*v, 0, "a GPU count >= 0"), v->name};
  }
  // In a step the step's GPUs are the ones its processes may use.
  if (inStep) {
    if (const auto v = firstSet(env, {"SLURM_STEP_GPUS"})) {
      return SlurmValue<int>{countGpuList(v->value, false), v->name};
    }
  }
  if (const auto v = firstSet(env, {"SLURM_JOB_GPUS"})) {
    return SlurmValue<int>{countGpuList(v->value, false), v->name};
  }
  // Set but empty hides every GPU, so it is read even when empty.
  if (const auto v = env("CUDA_VISIBLE_DEVICES")) {
    return SlurmValue<int>{countGpuList(*v, true), "CUDA_VISIBLE_DEVICES"};
  }
  return std::nullopt;
}

std::optional<SlurmValue<int>> readTasksOnNode(const EnvLookup& env, bool inStep, int nodeIndex) {
  const auto v = inStep ? firstSet(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                         "SLURM_NTASKS_PER_NODE"})
                        : firstSet(env, {"SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"});
  if (!v) return std::nullopt;
  std::vector<int> perNode;
  try {
    perNode = expandTasksPerNode(v->value);
  } catch (const ConfigError&) {
    badVariable(*v, "task counts per node like '2(x3),1'");
  }
  if (perNode.size() == 1) return SlurmValue<int>{perNode.front(), v->name};
  if (nodeIndex >= 0 && static_cast<std::size_t>(nodeIndex) < perNode.size()) {
    return SlurmValue<int>{perNode[static_cast<std::size_t>(nodeIndex)], v->name};
  }
  return std::nullopt;  // a list that does not cover this node tells nothing about it
}

}  // namespace

int rdzvPortFor(long long jobId, std::optional<long long> stepId) {
  constexpr long long kStepSlots = 16;
  constexpr long long kJobSlots = kRdzvPortCount / kStepSlots;  // 625
  const long long job = ((jobId % kJobSlots) + kJobSlots) % kJobSlots;
  const long long step = ((stepId.value_or(0) % kStepSlots) + kStepSlots) % kStepSlots;
  return kRdzvPortBase + static_cast<int>(job * kStepSlots + step);
}

std::optional<SlurmJob> readSlurmJob(const EnvLookup& env) {
  const auto jobVar = firstSet(env, {"SLURM_JOB_ID", "SLURM_JOBID"});
  if (!jobVar) return std::nullopt;
  SlurmJob job;
  job.jobId = {integer(*jobVar, 1, std::numeric_limits<long long>::max(),
                       "a positive integer (a Slurm job id)"),
               jobVar->name};

  if (const auto stepVar = firstSet(env, {"SLURM_STEP_ID", "SLURM_STEPID"})) {
    const long long step = integer(*stepVar, 0, std::numeric_limits<long long>::max(),
                                   "an integer >= 0 (a Slurm step id)");
    if (step < kFirstPseudoStepId) job.stepId = SlurmValue<long long>{step, stepVar->name};
  }
  const bool inStep = job.stepId.has_value();

  if (inStep) {
    job.rdzvId = {std::to_string(job.jobId.value) + "." + std::to_string(job.stepId->value),
                  job.jobId.source + "." + job.stepId->source};
    job.rdzvPort = {rdzvPortFor(job.jobId.value, job.stepId->value),
                    "derived from " + job.jobId.source + " and " + job.stepId->source};
  } else {
    job.rdzvId = {std::to_string(job.jobId.value), job.jobId.source};
    job.rdzvPort = {rdzvPortFor(job.jobId.value, std::nullopt), "derived from " + job.jobId.source};
  }

  const auto listVar =
      inStep ? firstSet(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})
             : firstSet(env, {"SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  if (!listVar) {
    throw ConfigError(jobVar->name + "=" + jobVar->value +
                      " is set but SLURM_JOB_NODELIST is not: cannot tell the job's nodes" +
                      kNoSlurmHint);
  }
  try {
    job.nodes = {expandHostlist(listVar->value), listVar->name};
  } catch (const ConfigError& e) {
    throw ConfigError("environment variable " + listVar->name + ": " + e.what() + kNoSlurmHint);
  }
  job.nodeListExpression = listVar->value;
  job.headNode = {job.nodes.value.front(), "first host of " + listVar->name};

  const int listed = static_cast<int>(job.nodes.value.size());
  const auto countVar =
      inStep ? firstSet(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"})
             : firstSet(env, {"SLURM_NNODES", "SLURM_JOB_NUM_NODES"});
  if (countVar) {
    job.numNodes = {smallInt(*countVar, 1, "a node count >= 1"), countVar->name};
    if (job.numNodes.value != listed) {
      throw ConfigError(countVar->name + "=" + countVar->value + " but " + listVar->name + "=" +
                        listVar->value + " lists " + std::to_string(listed) + " hosts" +
                        kNoSlurmHint);
    }
  } else {
    job.numNodes = {listed, "number of hosts in " + listVar->name};
  }

  if (const auto v = firstSet(env, {"SLURM_NODEID"})) {
    job.nodeId = SlurmValue<int>{smallInt(*v, 0, "a node index >= 0"), v->name};
    if (job.nodeId->value >= listed) {
      throw ConfigError("SLURM_NODEID=" + v->value + " but " + listVar->name + "=" +
                        listVar->value + " lists only " + std::to_string(listed) + " hosts" +
                        kNoSlurmHint);
    }
  }

  job.tasksOnNode = readTasksOnNode(env, inStep, job.nodeId ? job.nodeId->value : 0);
  job.gpusOnNode = readGpus(env, inStep);
  if (const auto v = firstSet(env, {"SLURM_CPUS_ON_NODE"})) {
    job.cpusOnNode = SlurmValue<int>{smallInt(*v, 1, "a CPU count >= 1"), v->name};
  }
  if (const auto v = firstSet(env, {"SLURM_RESTART_COUNT"})) {
    job.restartCount = SlurmValue<int>{smallInt(*v, 0, "a count >= 0"), v->name};
  }
  return job;
}

std::optional<SlurmValue<int>> autoNprocPerNode(const SlurmJob& job) {
  if (job.gpusOnNode && job.gpusOnNode->value > 0) return job.gpusOnNode;
  if (job.cpusOnNode) return job.cpusOnNode;
  return std::nullopt;
}

void checkOneTaskPerNode(const SlurmJob& job) {
  if (!job.stepId || !job.tasksOnNode || job.tasksOnNode->value <= 1) return;
  const int tasks = job.tasksOnNode->value;
  std::string node = "this node";
  if (job.nodeId) node = job.nodes.value[static_cast<std::size_t>(job.nodeId->value)];
  throw ConfigError(job.tasksOnNode->source + " says srun started " + std::to_string(tasks) +
                    " fsdprun tasks on " + node +
                    ": fsdprun starts the workers of a node itself and must run "
                    "once per node; use `srun --ntasks-per-node=1 fsdprun --nproc_per_node " +
                    std::to_string(tasks) +
                    " ...` or `#SBATCH --ntasks-per-node=1` (and ask for the node's "
                    "CPUs or GPUs with --cpus-per-task or --gpus-per-node)");
}

void checkInsideStep(const SlurmJob& job) {
  if (job.stepId || job.numNodes.value <= 1) return;
  throw ConfigError(
      "fsdprun runs outside srun in Slurm job " + std::to_string(job.jobId.value) + ", which has " +
      std::to_string(job.numNodes.value) + " nodes (" + job.numNodes.source + "): only this " +
      "node would join and the rendezvous would wait for the others forever; start it on every "
      "node with `srun fsdprun ...` in the batch script, or pass --nnodes 1 to train on this "
      "node alone");
}

std::vector<std::string> describe(const SlurmJob& job) {
  std::vector<std::string> lines;
  const auto add = [&lines](const std::string& name, const std::string& value,
                            const std::string& source) {
    lines.push_back(name + ": " + value + " (" + source + ")");
  };
  add("job_id", std::to_string(job.jobId.value), job.jobId.source);
  if (job.stepId) add("step_id", std::to_string(job.stepId->value), job.stepId->source);
  add("rdzv_id", job.rdzvId.value, job.rdzvId.source);
  add("nodes", job.nodeListExpression, job.nodes.source);
  add("head_node", job.headNode.value, job.headNode.source);
  add("nnodes", std::to_string(job.numNodes.value), job.numNodes.source);
  if (job.nodeId) add("node_id", std::to_string(job.nodeId->value), job.nodeId->source);
  if (job.tasksOnNode) {
    add("tasks_on_node", std::to_string(job.tasksOnNode->value), job.tasksOnNode->source);
  }
  if (job.gpusOnNode)
    add("gpus_on_node", std::to_string(job.gpusOnNode->value), job.gpusOnNode->source);
  if (job.cpusOnNode)
    add("cpus_on_node", std::to_string(job.cpusOnNode->value), job.cpusOnNode->source);
  if (job.restartCount) {
    add("restart_count", std::to_string(job.restartCount->value), job.restartCount->source);
  }
  add("rdzv_port", std::to_string(job.rdzvPort.value), job.rdzvPort.source);
  return lines;
}

HostResolver systemResolver() {
  return [](const std::string& host) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* raw = nullptr;
    HostLookup out;
    if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &raw); rc != 0) {
      out.error = ::gai_strerror(rc);
      if (rc == EAI_SYSTEM) out.error = errnoMessage(out.error, errno);
      return out;
    }
    const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(raw, &::freeaddrinfo);
    for (const addrinfo* a = list.get(); a != nullptr; a = a->ai_next) {
      char text[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof text, nullptr, 0, NI_NUMERICHOST) ==
          0) {
        out.addresses.emplace_back(text);
      }
    }
    if (out.addresses.empty()) out.error = "no address could be printed";
    return out;
  };
}

std::string resolveHeadNode(const SlurmJob& job, const HostResolver& resolve) {
  const HostLookup found = resolve(job.headNode.value);
  if (found.addresses.empty()) {
    throw ConfigError("Slurm head node '" + job.headNode.value + "' (" + job.headNode.source + "=" +
                      job.nodeListExpression + ") does not resolve: " + found.error +
                      " (getaddrinfo); fix the node's name resolution (/etc/hosts, DNS) or give "
                      "the rendezvous host with --rdzv_endpoint HOST[:PORT]");
  }
  return found.addresses.front();
}

}  // namespace fsdp::slurm
