#include "fsdp/slurm/slurm_env.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include "fsdp/common/error.hpp"

namespace fsdp::slurm {
namespace {

using Env = std::map<std::string, std::string>;

// What srun gives each task of `srun` in `sbatch --nodes=2` (Slurm 22.05, node 2 of 2).
Env stepEnv() {
  return {{"SLURM_JOB_ID", "41"},
          {"SLURM_JOBID", "41"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEPID", "0"},
          {"SLURM_JOB_NODELIST", "node[1-2]"},
          {"SLURM_NODELIST", "node[1-2]"},
          {"SLURM_STEP_NODELIST", "node[1-2]"},
          {"SLURM_NNODES", "2"},
          {"SLURM_JOB_NUM_NODES", "2"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_NODEID", "1"},
          {"SLURM_TASKS_PER_NODE", "1(x2)"},
          {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
          {"SLURM_CPUS_ON_NODE", "4"}};
}

// What the batch script of the same job sees (no step variables).
Env batchEnv() {
  return {{"SLURM_JOB_ID", "41"},     {"SLURM_JOB_NODELIST", "node[1-2]"},
          {"SLURM_NNODES", "2"},      {"SLURM_JOB_NUM_NODES", "2"},
          {"SLURM_NODEID", "0"},      {"SLURM_TASKS_PER_NODE", "1(x2)"},
          {"SLURM_CPUS_ON_NODE", "4"}};
}

SlurmJob read(const Env& env) {
  auto job = readSlurmJob(mapEnv(env));
  if (!job) throw std::logic_error("expected a Slurm job");
  return *job;
}

std::string errorOf(const Env& env) {
  try {
    readSlurmJob(mapEnv(env));
    return "no error";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

TEST(ReadSlurmJob, IsNulloptOutsideSlurm) {
  EXPECT_FALSE(readSlurmJob(mapEnv({})));
  EXPECT_FALSE(readSlurmJob(mapEnv({{"SLURM_JOB_ID", ""}, {"SLURM_NNODES", "2"}})));
  EXPECT_FALSE(readSlurmJob(mapEnv({{"CUDA_VISIBLE_DEVICES", "0,1"}})));
}

TEST(ReadSlurmJob, ReadsAnSrunStepWithTheVariableOfEveryField) {
  const SlurmJob job = read(stepEnv());
  EXPECT_EQ(job.jobId.value, 41);
  EXPECT_EQ(job.jobId.source, "SLURM_JOB_ID");
  ASSERT_TRUE(job.stepId);
  EXPECT_EQ(job.stepId->value, 0);
  EXPECT_EQ(job.stepId->source, "SLURM_STEP_ID");
  EXPECT_EQ(job.rdzvId.value, "41.0");
  EXPECT_EQ(job.rdzvId.source, "SLURM_JOB_ID.SLURM_STEP_ID");
  EXPECT_EQ(job.nodes.value, std::vector<std::string>({"node1", "node2"}));
  EXPECT_EQ(job.nodes.source, "SLURM_STEP_NODELIST");
  EXPECT_EQ(job.nodeListExpression, "node[1-2]");
  EXPECT_EQ(job.headNode.value, "node1");
  EXPECT_EQ(job.headNode.source, "first host of SLURM_STEP_NODELIST");
  EXPECT_EQ(job.numNodes.value, 2);
  EXPECT_EQ(job.numNodes.source, "SLURM_STEP_NUM_NODES");
  ASSERT_TRUE(job.nodeId);
  EXPECT_EQ(job.nodeId->value, 1);
  EXPECT_EQ(job.nodeId->source, "SLURM_NODEID");
  ASSERT_TRUE(job.tasksOnNode);
  EXPECT_EQ(job.tasksOnNode->value, 1);
  EXPECT_EQ(job.tasksOnNode->source, "SLURM_STEP_TASKS_PER_NODE");
  EXPECT_FALSE(job.gpusOnNode);
  ASSERT_TRUE(job.cpusOnNode);
  EXPECT_EQ(job.cpusOnNode->value, 4);
  EXPECT_EQ(job.cpusOnNode->source, "SLURM_CPUS_ON_NODE");
  EXPECT_FALSE(job.restartCount);
  EXPECT_EQ(job.rdzvPort.value, rdzvPortFor(41, 0));
  EXPECT_EQ(job.rdzvPort.source, "derived from SLURM_JOB_ID and SLURM_STEP_ID");
}

TEST(ReadSlurmJob, InTheBatchScriptReadsTheJobsVariables) {
  const SlurmJob job = read(batchEnv());
  EXPECT_FALSE(job.stepId);
  EXPECT_EQ(job.rdzvId.value, "41");
  EXPECT_EQ(job.rdzvId.source, "SLURM_JOB_ID");
  EXPECT_EQ(job.nodes.source, "SLURM_JOB_NODELIST");
  EXPECT_EQ(job.numNodes.source, "SLURM_NNODES");
  EXPECT_EQ(job.tasksOnNode->source, "SLURM_TASKS_PER_NODE");
  EXPECT_EQ(job.rdzvPort.value, rdzvPortFor(41, std::nullopt));
  EXPECT_EQ(job.rdzvPort.source, "derived from SLURM_JOB_ID");
}

TEST(ReadSlurmJob, AStepOnPartOfTheJobUsesTheStepsNodes) {
  // `srun -N1 -w node2` in a 2-node job: SLURM_NODEID is 0, relative to the step's list.
  Env env = stepEnv();
  env["SLURM_STEP_ID"] = "3";
  env["SLURM_STEP_NODELIST"] = "node2";
  env["SLURM_STEP_NUM_NODES"] = "1";
  env["SLURM_NNODES"] = "1";
  env["SLURM_NODEID"] = "0";
  env["SLURM_STEP_TASKS_PER_NODE"] = "1";
  const SlurmJob job = read(env);
  EXPECT_EQ(job.headNode.value, "node2");
  EXPECT_EQ(job.numNodes.value, 1);
  EXPECT_EQ(job.rdzvId.value, "41.3");
  EXPECT_EQ(job.rdzvPort.value, rdzvPortFor(41, 3));
}

TEST(ReadSlurmJob, FallsBackToOlderAndJobLevelNames) {
  const SlurmJob job = read({{"SLURM_JOBID", "7"},
                             {"SLURM_STEPID", "2"},
                             {"SLURM_NODELIST", "gpu[01-04]"},
                             {"SLURM_JOB_NUM_NODES", "4"},
                             {"SLURM_NODEID", "3"},
                             {"SLURM_NTASKS_PER_NODE", "1"}});
  EXPECT_EQ(job.jobId.source, "SLURM_JOBID");
  EXPECT_EQ(job.stepId->source, "SLURM_STEPID");
  EXPECT_EQ(job.rdzvId.value, "7.2");
  EXPECT_EQ(job.nodes.source, "SLURM_NODELIST");
  EXPECT_EQ(job.headNode.value, "gpu01");
  EXPECT_EQ(job.numNodes.source, "SLURM_JOB_NUM_NODES");
  EXPECT_EQ(job.tasksOnNode->source, "SLURM_NTASKS_PER_NODE");
  EXPECT_FALSE(job.cpusOnNode);
}

TEST(ReadSlurmJob, CountsNodesFromTheListWhenNoCountIsSet) {
  const SlurmJob job = read({{"SLURM_JOB_ID", "7"}, {"SLURM_JOB_NODELIST", "a,b[1-3]"}});
  EXPECT_EQ(job.numNodes.value, 4);
  EXPECT_EQ(job.numNodes.source, "number of hosts in SLURM_JOB_NODELIST");
  EXPECT_FALSE(job.nodeId);
  EXPECT_FALSE(job.tasksOnNode);
}

TEST(ReadSlurmJob, PseudoStepIdsAreNotSteps) {
  Env env = batchEnv();
  env["SLURM_STEP_ID"] = "4294967294";  // SLURM_BATCH_SCRIPT
  EXPECT_FALSE(read(env).stepId);
}

TEST(ReadSlurmJob, IndexesTasksPerNodeByNodeId) {
  Env env = stepEnv();
  env["SLURM_STEP_NODELIST"] = "n[1-4]";
  env["SLURM_STEP_NUM_NODES"] = "4";
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x3),1";
  env["SLURM_NODEID"] = "3";
  EXPECT_EQ(read(env).tasksOnNode->value, 1);
  env["SLURM_NODEID"] = "2";
  EXPECT_EQ(read(env).tasksOnNode->value, 2);
}

TEST(ReadSlurmJob, CountsGpusFromTheFirstVariableSet) {
  Env env = stepEnv();
  env["CUDA_VISIBLE_DEVICES"] = "0,1,2,3,4,5,6,7";
  env["SLURM_JOB_GPUS"] = "0,1,2,3";
  env["SLURM_STEP_GPUS"] = "2,3";
  env["SLURM_GPUS_ON_NODE"] = "2";
  auto gpus = [&env] { return read(env).gpusOnNode; };
  EXPECT_EQ(gpus()->value, 2);
  EXPECT_EQ(gpus()->source, "SLURM_GPUS_ON_NODE");
  env.erase("SLURM_GPUS_ON_NODE");
  EXPECT_EQ(gpus()->value, 2);
  EXPECT_EQ(gpus()->source, "SLURM_STEP_GPUS");
  env.erase("SLURM_STEP_GPUS");
  EXPECT_EQ(gpus()->value, 4);
  EXPECT_EQ(gpus()->source, "SLURM_JOB_GPUS");
  env.erase("SLURM_JOB_GPUS");
  EXPECT_EQ(gpus()->value, 8);
  EXPECT_EQ(gpus()->source, "CUDA_VISIBLE_DEVICES");
  env["CUDA_VISIBLE_DEVICES"] = "GPU-8d2a,GPU-77f1";
  EXPECT_EQ(gpus()->value, 2);
  for (const char* none : {"", "NoDevFiles", "-1", "-1,0"}) {
    env["CUDA_VISIBLE_DEVICES"] = none;
    EXPECT_EQ(gpus()->value, 0) << none;
  }
  env["CUDA_VISIBLE_DEVICES"] = "0,-1,1";  // CUDA stops at the first invalid entry
  EXPECT_EQ(gpus()->value, 1);
}

TEST(ReadSlurmJob, StepGpusCountOnlyInsideAStep) {
  Env env = batchEnv();
  env["SLURM_STEP_GPUS"] = "0,1";
  env["SLURM_JOB_GPUS"] = "0,1,2";
  EXPECT_EQ(read(env).gpusOnNode->source, "SLURM_JOB_GPUS");
}

TEST(ReadSlurmJob, ReadsTheRestartCountOfARequeuedJob) {
  Env env = stepEnv();
  env["SLURM_RESTART_COUNT"] = "2";
  EXPECT_EQ(read(env).restartCount->value, 2);
}

TEST(ReadSlurmJob, MalformedVariablesAreNamedWithTheirValue) {
  Env env = stepEnv();
  env["SLURM_JOB_ID"] = "abc";
  EXPECT_EQ(errorOf(env),
            "environment variable SLURM_JOB_ID='abc': expected a positive integer (a Slurm job id) "
            "(run with --no_slurm to ignore the SLURM_* environment)");
  env = stepEnv();
  env["SLURM_STEP_NUM_NODES"] = "two";
  EXPECT_NE(errorOf(env).find("SLURM_STEP_NUM_NODES='two': expected a node count"),
            std::string::npos);
  env = stepEnv();
  env["SLURM_STEP_NODELIST"] = "node[1-2";
  EXPECT_NE(errorOf(env).find("environment variable SLURM_STEP_NODELIST: invalid hostlist "
                              "'node[1-2': '[' is never closed"),
            std::string::npos);
  env = stepEnv();
  env["SLURM_STEP_TASKS_PER_NODE"] = "1(x";
  EXPECT_NE(errorOf(env).find("SLURM_STEP_TASKS_PER_NODE='1(x'"), std::string::npos);
  env = stepEnv();
  env["SLURM_CPUS_ON_NODE"] = "0";
  EXPECT_NE(errorOf(env).find("SLURM_CPUS_ON_NODE='0': expected a CPU count >= 1"),
            std::string::npos);
  env = stepEnv();
  env["SLURM_GPUS_ON_NODE"] = "-2";
  EXPECT_NE(errorOf(env).find("SLURM_GPUS_ON_NODE='-2'"), std::string::npos);
}

TEST(ReadSlurmJob, ContradictionsAreNamed) {
  Env env = stepEnv();
  env["SLURM_STEP_NUM_NODES"] = "3";
  EXPECT_NE(errorOf(env).find("SLURM_STEP_NUM_NODES=3 but SLURM_STEP_NODELIST=node[1-2] lists 2 "
                              "hosts"),
            std::string::npos);
  env = stepEnv();
  env["SLURM_NODEID"] = "2";
  EXPECT_NE(errorOf(env).find("SLURM_NODEID=2 but SLURM_STEP_NODELIST=node[1-2] lists only 2"),
            std::string::npos);
  env = stepEnv();
  env.erase("SLURM_JOB_NODELIST");
  env.erase("SLURM_NODELIST");
  env.erase("SLURM_STEP_NODELIST");
  EXPECT_NE(errorOf(env).find("SLURM_JOB_ID=41 is set but SLURM_JOB_NODELIST is not"),
            std::string::npos);
}

TEST(RdzvPort, IsDeterministicAndInItsRange) {
  EXPECT_EQ(rdzvPortFor(41, 0), rdzvPortFor(41, 0));
  EXPECT_EQ(rdzvPortFor(0, std::nullopt), kRdzvPortBase);
  EXPECT_EQ(rdzvPortFor(41, std::nullopt), rdzvPortFor(41, 0));
  EXPECT_EQ(rdzvPortFor(1, 1), 20017);
  for (long long job : {1LL, 624LL, 625LL, 123456789LL, 4294967295LL}) {
    for (long long step : {0LL, 15LL, 16LL, 4000LL}) {
      const int port = rdzvPortFor(job, step);
      EXPECT_GE(port, kRdzvPortBase);
      EXPECT_LT(port, kRdzvPortBase + kRdzvPortCount);
      EXPECT_LT(port, 32768);  // below Linux's ephemeral range
      EXPECT_GE(port, 1024);   // not a well-known port
    }
  }
}

TEST(RdzvPort, NearbyJobsAndTheirFirstStepsNeverShareAPort) {
  std::set<int> ports;
  for (long long job = 1000; job < 1000 + 625; ++job) {
    for (long long step = 0; step < 16; ++step) {
      EXPECT_TRUE(ports.insert(rdzvPortFor(job, step)).second) << job << "." << step;
    }
  }
  EXPECT_EQ(ports.size(), static_cast<std::size_t>(kRdzvPortCount));
}

TEST(AutoNprocPerNode, PrefersGpusThenSlurmsCpus) {
  Env env = stepEnv();
  EXPECT_EQ(autoNprocPerNode(read(env))->value, 4);
  EXPECT_EQ(autoNprocPerNode(read(env))->source, "SLURM_CPUS_ON_NODE");
  env["SLURM_GPUS_ON_NODE"] = "8";
  EXPECT_EQ(autoNprocPerNode(read(env))->value, 8);
  EXPECT_EQ(autoNprocPerNode(read(env))->source, "SLURM_GPUS_ON_NODE");
  env["SLURM_GPUS_ON_NODE"] = "0";
  EXPECT_EQ(autoNprocPerNode(read(env))->source, "SLURM_CPUS_ON_NODE");
  env.erase("SLURM_CPUS_ON_NODE");
  EXPECT_FALSE(autoNprocPerNode(read(env)));
}

TEST(CheckOneTaskPerNode, ExplainsTheFixWhenSrunStartsSeveralTasksOnANode) {
  EXPECT_NO_THROW(checkOneTaskPerNode(read(stepEnv())));
  Env env = stepEnv();
  env["SLURM_STEP_TASKS_PER_NODE"] = "4(x2)";
  env["SLURM_NTASKS_PER_NODE"] = "4";
  try {
    checkOneTaskPerNode(read(env));
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "SLURM_STEP_TASKS_PER_NODE says srun started 4 fsdprun tasks on node2: fsdprun "
                 "starts the workers of a node itself and must run once per node; use `srun "
                 "--ntasks-per-node=1 fsdprun --nproc_per_node 4 ...` or `#SBATCH "
                 "--ntasks-per-node=1` (and ask for the node's CPUs or GPUs with --cpus-per-task "
                 "or --gpus-per-node)");
  }
}

TEST(CheckOneTaskPerNode, IgnoresTheJobsTasksInTheBatchScript) {
  // `#SBATCH --ntasks-per-node=4` and fsdprun called in the script itself: one process.
  Env env = batchEnv();
  env["SLURM_TASKS_PER_NODE"] = "4(x2)";
  EXPECT_NO_THROW(checkOneTaskPerNode(read(env)));
}

TEST(CheckInsideStep, RefusesAMultiNodeJobOutsideSrun) {
  EXPECT_NO_THROW(checkInsideStep(read(stepEnv())));
  EXPECT_NO_THROW(checkInsideStep(read({{"SLURM_JOB_ID", "5"}, {"SLURM_JOB_NODELIST", "n1"}})));
  try {
    checkInsideStep(read(batchEnv()));
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("fsdprun runs outside srun in Slurm job 41, which has 2 "
                                         "nodes (SLURM_NNODES)"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("`srun fsdprun ...`"), std::string::npos);
  }
}

TEST(Describe, NamesEveryFieldsVariable) {
  Env env = stepEnv();
  env["SLURM_GPUS_ON_NODE"] = "2";
  const auto lines = describe(read(env));
  const std::vector<std::string> expected = {
      "job_id: 41 (SLURM_JOB_ID)",
      "step_id: 0 (SLURM_STEP_ID)",
      "rdzv_id: 41.0 (SLURM_JOB_ID.SLURM_STEP_ID)",
      "nodes: node[1-2] (SLURM_STEP_NODELIST)",
      "head_node: node1 (first host of SLURM_STEP_NODELIST)",
      "nnodes: 2 (SLURM_STEP_NUM_NODES)",
      "node_id: 1 (SLURM_NODEID)",
      "tasks_on_node: 1 (SLURM_STEP_TASKS_PER_NODE)",
      "gpus_on_node: 2 (SLURM_GPUS_ON_NODE)",
      "cpus_on_node: 4 (SLURM_CPUS_ON_NODE)",
      "rdzv_port: " + std::to_string(rdzvPortFor(41, 0)) +
          " (derived from SLURM_JOB_ID and SLURM_STEP_ID)",
  };
  EXPECT_EQ(lines, expected);
}

TEST(ResolveHeadNode, ReturnsTheFirstAddress) {
  const SlurmJob job = read(stepEnv());
  const HostResolver fake = [](const std::string& host) {
    EXPECT_EQ(host, "node1");
    return HostLookup{{"10.0.0.11", "fd00::11"}, ""};
  };
  EXPECT_EQ(resolveHeadNode(job, fake), "10.0.0.11");
}

TEST(ResolveHeadNode, NamesTheHostAndTheLookupError) {
  const SlurmJob job = read(stepEnv());
  const HostResolver fake = [](const std::string&) {
    return HostLookup{{}, "Name or service not known"};
  };
  try {
    resolveHeadNode(job, fake);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "Slurm head node 'node1' (first host of SLURM_STEP_NODELIST=node[1-2]) does not "
              "resolve: Name or service not known (getaddrinfo); fix the node's name resolution "
              "(/etc/hosts, DNS) or give the rendezvous host with --rdzv_endpoint HOST[:PORT]");
  }
}

TEST(SystemResolver, ResolvesLocalhostAndNumericAddresses) {
  const auto localhost = systemResolver()("localhost");
  ASSERT_FALSE(localhost.addresses.empty()) << localhost.error;
  const std::string first = localhost.addresses.front();
  EXPECT_TRUE(first == "127.0.0.1" || first == "::1") << first;
  EXPECT_EQ(systemResolver()("10.1.2.3").addresses, std::vector<std::string>({"10.1.2.3"}));
}

}  // namespace
}  // namespace fsdp::slurm
