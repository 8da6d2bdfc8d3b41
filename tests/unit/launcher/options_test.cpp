#include "fsdp/launcher/options.hpp"

#include <gtest/gtest.h>

#include "fsdp/common/error.hpp"
#include "fsdp/launcher/agent.hpp"
#include "fsdp/launcher/blas_check.hpp"
#include "fsdp/launcher/net.hpp"

#include <signal.h>

namespace fsdp::launcher {
namespace {

ParseResult parse(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  std::vector<const char*> argv = {"fsdprun"};
  for (const auto& a : args) argv.push_back(a.c_str());
  return parseCommandLine(static_cast<int>(argv.size()), argv.data(), mapEnv(std::move(env)));
}

TEST(ParseCommandLine, AcceptsBothSpellingsAndStopsAtTheProgram) {
  const auto a = parse({"--standalone", "--nproc_per_node", "3", "prog", "--nproc_per_node", "9"});
  ASSERT_TRUE(a.options);
  EXPECT_EQ(a.options->nprocPerNode, 3);
  EXPECT_TRUE(a.options->standalone);
  EXPECT_EQ(a.options->command, std::vector<std::string>({"prog", "--nproc_per_node", "9"}));
  const auto b = parse({"--nproc-per-node", "2", "--max-restarts", "4", "prog"});
  EXPECT_EQ(b.options->nprocPerNode, 2);
  EXPECT_EQ(b.options->maxRestarts, 4);
}

TEST(ParseCommandLine, PetVariablesAreFallbacksThatFlagsOverride) {
  const auto a = parse({"prog"}, {{"PET_NPROC_PER_NODE", "5"}, {"PET_MAX_RESTARTS", "2"}});
  EXPECT_EQ(a.options->nprocPerNode, 5);
  EXPECT_EQ(a.options->maxRestarts, 2);
  const auto b = parse({"--nproc_per_node", "1", "prog"}, {{"PET_NPROC_PER_NODE", "5"}});
  EXPECT_EQ(b.options->nprocPerNode, 1);
}

TEST(ParseCommandLine, HelpAndVersionExitZero) {
  EXPECT_EQ(parse({"--help"}).exitCode, 0);
  EXPECT_NE(parse({"--help"}).message.find("--nproc_per_node"), std::string::npos);
  EXPECT_NE(parse({"--version"}).message.find("fsdprun"), std::string::npos);
}

TEST(ParseCommandLine, BadValuesNameTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nproc_per_node", "0", "p"}, "--nproc_per_node '0'"},
      {{"--nnodes", "2:1", "p"}, "--nnodes '2:1'"},
      {{"--master_port", "70000", "p"}, "--master_port '70000'"},
      {{"--shutdown_timeout", "-1", "p"}, "--shutdown_timeout"},
      {{"--rdzv_backend", "etcd", "p"}, "--rdzv_backend 'etcd'"},
      {{"--bogus", "p"}, "--bogus"},
      {{"--hang_timeout", "soon", "p"}, "--hang_timeout 'soon': expected 'auto', 0 (off) or a positive number"},
      {{"--hang_timeout", "-5", "p"}, "--hang_timeout '-5'"},
      {{"--hang_timeout", "nan", "p"}, "--hang_timeout 'nan'"},
      {{"--max_stalled_restarts", "x", "p"}, "--max_stalled_restarts 'x'"},
      {{"--metrics_port", "70000", "p"}, "--metrics_port '70000': expected a TCP port, 0 to 65535"},
      {{"--metrics-port", "-1", "p"}, "--metrics_port '-1'"},
      {{"--metrics_port", "web", "p"}, "--metrics_port 'web'"},
      {{"--metrics_addr", "", "--metrics_port", "9400", "p"}, "--metrics_addr ''"},
      {{}, "PROGRAM"},
  };
  for (const auto& [args, mention] : cases) {
    try {
      parse(args);
      ADD_FAILURE() << "no error for " << mention;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << e.what();
    }
  }
}

TEST(ParseCommandLine, MetricsAreOffByDefaultOnAPortOrAFreeOneAndHaveAPetVariable) {
  EXPECT_FALSE(parse({"p"}).options->metricsPort);
  EXPECT_EQ(parse({"--metrics_port", "9400", "p"}).options->metricsPort, 9400);
  EXPECT_EQ(parse({"--metrics-port", "0", "p"}).options->metricsPort, 0);
  EXPECT_EQ(parse({"p"}, {{"PET_METRICS_PORT", "9500"}}).options->metricsPort, 9500);
  EXPECT_EQ(parse({"p"}).options->metricsAddr, "0.0.0.0");
  EXPECT_EQ(parse({"--metrics_addr", "127.0.0.1", "p"}).options->metricsAddr, "127.0.0.1");
}

TEST(ParseCommandLine, HangTimeoutIsAutoSecondsOrOffAndHasAPetVariable) {
  EXPECT_FALSE(parse({"p"}).options->hangTimeout);  // auto
  EXPECT_EQ(parse({"--hang_timeout", "auto", "p"}).options->hangTimeout, std::nullopt);
  EXPECT_EQ(parse({"--hang-timeout", "2.5", "p"}).options->hangTimeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(parse({"--hang_timeout", "0", "p"}).options->hangTimeout, std::chrono::milliseconds(0));
  EXPECT_EQ(parse({"p"}, {{"PET_HANG_TIMEOUT", "7"}}).options->hangTimeout, std::chrono::milliseconds(7000));
  EXPECT_EQ(parse({"p"}).options->maxStalledRestarts, 3);
  EXPECT_EQ(parse({"p"}, {{"PET_MAX_STALLED_RESTARTS", "0"}}).options->maxStalledRestarts, 0);
}

TEST(ParseNnodes, ReadsNAndMinMax) {
  EXPECT_EQ(parseNnodes("2"), std::make_pair(2, 2));
  EXPECT_EQ(parseNnodes("1:4"), std::make_pair(1, 4));
  EXPECT_THROW(parseNnodes("0"), ConfigError);
  EXPECT_THROW(parseNnodes("a:b"), ConfigError);
}

TEST(ParseNprocPerNode, ResolvesAutoAndCpu) {
  EXPECT_EQ(parseNprocPerNode("cpu", 8, 0), 8);
  EXPECT_EQ(parseNprocPerNode("auto", 8, 0), 8);
  EXPECT_EQ(parseNprocPerNode("auto", 8, 2), 2);
  EXPECT_THROW(parseNprocPerNode("gpu", 8, 0), ConfigError);
  EXPECT_THROW(parseNprocPerNode("-1", 8, 0), ConfigError);
}

TEST(WorkerCommand, RunsPythonScriptsUnderPython3AndChecksPrograms) {
  LaunchOptions o;
  o.command = {"/bin/true", "x"};
  EXPECT_EQ(workerCommand(o, mapEnv({})), std::vector<std::string>({"/bin/true", "x"}));
  o.command = {"/nonexistent.py"};
  EXPECT_THROW(workerCommand(o, mapEnv({})), ConfigError);
  o.command = {"/nonexistent"};
  EXPECT_THROW(workerCommand(o, mapEnv({})), ConfigError);
}

TEST(WorkerEnvironment, SetsTheTorchrunVariablesAndKeepsAUserOmpSetting) {
  LaunchOptions o;
  o.role = "trainer";
  o.maxRestarts = 3;
  o.nprocPerNode = 2;  // several workers share the node: OMP_NUM_THREADS=1, as torchrun
  const WorkerIdentity id{.localRank = 1, .rank = 1, .worldSize = 2, .localWorldSize = 2, .restartCount = 2};
  const WorkerContact contact{.masterPort = 5678, .storePort = 1234, .errorFile = "/x/error.json"};
  const auto env = workerEnvironment(o, id, contact, {"PATH=/bin", "RANK=9", "FSDPRUN_TOKEN=s"});
  const auto has = [&env](const std::string& entry) {
    return std::find(env.begin(), env.end(), entry) != env.end();
  };
  for (const char* e : {"RANK=1", "LOCAL_RANK=1", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=0",
                        "GROUP_WORLD_SIZE=1", "ROLE_RANK=1", "ROLE_WORLD_SIZE=2", "ROLE_NAME=trainer",
                        "MASTER_PORT=5678", "TORCHELASTIC_RESTART_COUNT=2",
                        "TORCHELASTIC_MAX_RESTARTS=3", "OMP_NUM_THREADS=1", "FSDPRUN_STORE_PORT=1234",
                        "TORCHELASTIC_USE_AGENT_STORE=False", "TORCHELASTIC_ERROR_FILE=/x/error.json",
                        "GLIBC_TUNABLES=glibc.malloc.hugetlb=1", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                        "PATH=/bin"}) {
    EXPECT_TRUE(has(e)) << e;
  }
  EXPECT_FALSE(has("RANK=9"));
  EXPECT_FALSE(has("FSDPRUN_TOKEN=s"));
  LaunchOptions single = o;
  single.nprocPerNode = 1;  // one worker keeps LibTorch's default
  const auto alone = workerEnvironment(single, id, contact, {"PATH=/bin"});
  EXPECT_EQ(std::count_if(alone.begin(), alone.end(), [](const std::string& e) { return e.starts_with("OMP_NUM_THREADS="); }),
            0);
  const auto userOmp = workerEnvironment(o, id, contact, {"OMP_NUM_THREADS=4"});
  EXPECT_NE(std::find(userOmp.begin(), userOmp.end(), "OMP_NUM_THREADS=4"), userOmp.end());
  EXPECT_EQ(std::find(userOmp.begin(), userOmp.end(), "OMP_NUM_THREADS=1"), userOmp.end());
  const auto userNccl = workerEnvironment(o, id, contact, {"TORCH_NCCL_ASYNC_ERROR_HANDLING=0"});
  EXPECT_EQ(std::count_if(userNccl.begin(), userNccl.end(),
                          [](const std::string& e) { return e.starts_with("TORCH_NCCL_ASYNC_ERROR_HANDLING="); }),
            1);
  EXPECT_NE(std::find(userNccl.begin(), userNccl.end(), "TORCH_NCCL_ASYNC_ERROR_HANDLING=0"), userNccl.end());
  const auto userTunables = workerEnvironment(o, id, contact, {"GLIBC_TUNABLES=glibc.malloc.arena_max=2"});
  EXPECT_EQ(std::count_if(userTunables.begin(), userTunables.end(),
                          [](const std::string& e) { return e.starts_with("GLIBC_TUNABLES="); }),
            1);
  EXPECT_NE(std::find(userTunables.begin(), userTunables.end(), "GLIBC_TUNABLES=glibc.malloc.arena_max=2"),
            userTunables.end());
}

TEST(ParseCommandLine, RecordsWhereEachValueCameFrom) {
  const auto a = parse({"--nnodes", "2", "--rdzv_endpoint", "h:1", "--rdzv_backend", "c10d", "p"},
                       {{"PET_MAX_RESTARTS", "3"}});
  ASSERT_TRUE(a.options);
  EXPECT_EQ(a.options->sources.at("nnodes"), "flag");
  EXPECT_EQ(a.options->sources.at("max_restarts"), "environment PET_MAX_RESTARTS");
  EXPECT_EQ(a.options->sources.at("role"), "default");
  const auto text = describeConfiguration(*a.options, {"p"});
  EXPECT_NE(text.find("nnodes: 2  (flag)"), std::string::npos) << text;
  EXPECT_NE(text.find("max_restarts: 3  (environment PET_MAX_RESTARTS)"), std::string::npos) << text;
  EXPECT_NE(text.find("rdzv_endpoint: h:1  (flag)"), std::string::npos) << text;
}

TEST(ParseCommandLine, ReadsTheLoggingAndSignalFlags) {
  const auto a = parse({"-t", "3", "-r", "0:1,1:2", "--local_ranks_filter", "0,2",
                        "--signals_to_handle", "SIGTERM,SIGUSR1", "--log-dir", "/tmp/x", "p"});
  ASSERT_TRUE(a.options);
  EXPECT_EQ(a.options->tee.forRank(5), 3);
  EXPECT_EQ(a.options->redirects.forRank(0), kStdout);
  EXPECT_EQ(a.options->redirects.forRank(1), kStderr);
  EXPECT_EQ(a.options->redirects.forRank(2), 0);
  EXPECT_EQ(*a.options->localRanksFilter, std::set<int>({0, 2}));
  EXPECT_EQ(a.options->signalsToHandle, std::vector<int>({SIGTERM, SIGUSR1}));
  EXPECT_EQ(a.options->logDir, "/tmp/x");
  for (const auto& [args, mention] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"-r", "4", "p"}, "--redirects '4'"},
           {{"--tee", "x:1", "p"}, "--tee 'x:1'"},
           {{"--local_ranks_filter", "a", "p"}, "--local_ranks_filter 'a'"},
           {{"--signals_to_handle", "SIGKILL", "p"}, "'SIGKILL'"},
           {{"--start_method", "thread", "p"}, "--start_method 'thread'"},
           {{"--node_rank", "2", "--nnodes", "2", "p"}, "--node_rank '2'"},
           {{"--standalone", "--nnodes", "2", "p"}, "--standalone"},
           {{"--rdzv_conf", "join_timeout=x", "p"}, "join_timeout=x"},
       }) {
    try {
      parse(args);
      ADD_FAILURE() << "no error for " << mention;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(mention), std::string::npos) << e.what();
    }
  }
}

std::map<std::string, std::string> slurmStep(int nodeId) {
  return {{"SLURM_JOB_ID", "4242"},          {"SLURM_STEP_ID", "0"},
          {"SLURM_STEP_NODELIST", "tux[1-2]"}, {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_NODEID", std::to_string(nodeId)}, {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
          {"SLURM_CPUS_ON_NODE", "6"}};
}

TEST(SlurmDefaults, FillWhatTheUserLeftOutAndNameTheVariables) {
  const auto a = parse({"--nproc_per_node", "auto", "p"}, slurmStep(1));
  ASSERT_TRUE(a.options);
  EXPECT_EQ(a.options->minNodes, 2);
  EXPECT_EQ(a.options->nprocPerNode, 6);
  EXPECT_EQ(a.options->rdzvId, "4242.0");
  EXPECT_EQ(a.options->rdzvBackend, "c10d");
  EXPECT_EQ(a.options->nodeRank, 1);
  EXPECT_EQ(a.options->rdzvEndpoint.substr(0, 5), "tux1:");
  EXPECT_EQ(a.options->rdzvConf.isHost, false);
  EXPECT_EQ(a.options->sources.at("nnodes"), "Slurm SLURM_STEP_NUM_NODES");
  EXPECT_NE(a.options->sources.at("nproc_per_node").find("SLURM_CPUS_ON_NODE"), std::string::npos);
  // Node 0 serves the rendezvous.
  EXPECT_EQ(parse({"p"}, slurmStep(0)).options->rdzvConf.isHost, true);
  // What the user gives wins; --no_slurm ignores the job.
  const auto b = parse({"--nnodes", "1", "--rdzv_id", "mine", "p"}, slurmStep(1));
  EXPECT_EQ(b.options->maxNodes, 1);
  EXPECT_EQ(b.options->rdzvId, "mine");
  EXPECT_TRUE(b.options->rdzvEndpoint.empty());
  const auto c = parse({"--no_slurm", "p"}, slurmStep(1));
  EXPECT_EQ(c.options->maxNodes, 1);
  EXPECT_EQ(c.options->rdzvId, "none");
}

TEST(SlurmDefaults, MoreThanOneTaskPerNodeExplainsTheFix) {
  auto env = slurmStep(0);
  env["SLURM_STEP_TASKS_PER_NODE"] = "4(x2)";
  try {
    parse({"p"}, env);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--ntasks-per-node=1"), std::string::npos) << e.what();
  }
}

TEST(RdzvConf, ReadsSecondsAndTorchrunsKeepAliveKeys) {
  const auto c = RdzvConf::parse("join_timeout=2.5,last_call_timeout=0,is_host=false,"
                                 "read_timeout=60,token_file=/t");
  EXPECT_EQ(c.joinTimeout, std::chrono::milliseconds(2500));
  EXPECT_EQ(c.lastCallTimeout, std::chrono::milliseconds(0));
  EXPECT_EQ(c.isHost, false);
  EXPECT_EQ(c.tokenFile, "/t");
  const auto k = RdzvConf::parse("keep_alive_interval=2,keep_alive_max_attempt=4");
  EXPECT_EQ(k.heartbeatInterval, std::chrono::milliseconds(2000));
  EXPECT_EQ(k.heartbeatTimeout, std::chrono::milliseconds(8000));
  // torchrun carries unknown keys to custom handlers: accepted, each named for one warning.
  const auto unknown = RdzvConf::parse("bogus=1,timeout=5,join_timeout=7");
  ASSERT_EQ(unknown.ignored.size(), 2u);
  EXPECT_TRUE(unknown.ignored[0].starts_with("bogus=1: not a key fsdprun knows")) << unknown.ignored[0];
  EXPECT_TRUE(unknown.ignored[1].starts_with("timeout=5: torchrun's TCPStore setting")) << unknown.ignored[1];
  EXPECT_EQ(unknown.joinTimeout, std::chrono::milliseconds(7000));
  EXPECT_THROW(RdzvConf::parse("join_timeout=0"), ConfigError);
  EXPECT_THROW(RdzvConf::parse("heartbeat_interval=5,heartbeat_timeout=5"), ConfigError);
  EXPECT_THROW(RdzvConf::parse("is_host=maybe"), ConfigError);
}

TEST(ParseEndpoint, ReadsHostsPortsAndBracketedIpv6) {
  EXPECT_EQ(parseEndpoint("node1", 29400, "--f").str(), "node1:29400");
  EXPECT_EQ(parseEndpoint("node1:123", 29400, "--f").port, 123);
  EXPECT_EQ(parseEndpoint("[::1]:99", 29400, "--f").host, "::1");
  EXPECT_EQ(parseEndpoint("[::1]:99", 29400, "--f").str(), "[::1]:99");
  EXPECT_EQ(parseEndpoint("fe80::1", 7, "--f").port, 7);
  for (const char* bad : {"host:notaport", "host:0", "host:70000", "[::1", "host:", ":5", ""}) {
    try {
      parseEndpoint(bad, 1, "--rdzv_endpoint");
      ADD_FAILURE() << "no error for " << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("--rdzv_endpoint '") + bad + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(PlanRendezvous, SingleNodeIsEmbeddedAndMultiNodeNeedsAnEndpoint) {
  EXPECT_TRUE(planRendezvous(*parse({"p"}).options).embedded);
  EXPECT_TRUE(planRendezvous(*parse({"--standalone", "p"}).options).embedded);
  const auto c10d = planRendezvous(
      *parse({"--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.5", "p"}).options);
  EXPECT_FALSE(c10d.embedded);
  EXPECT_EQ(c10d.endpoint.port, 29400);
  EXPECT_TRUE(c10d.mayHost);  // a loopback address is this host
  EXPECT_EQ(c10d.bindHost, "127.0.0.5");
  const auto stat = planRendezvous(
      *parse({"--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "p"}).options);
  EXPECT_EQ(stat.endpoint.str(), "127.0.0.1:29500");
  EXPECT_EQ(stat.preferredRank, 1);
  const auto remote = planRendezvous(*parse({"--nnodes", "2", "--rdzv_backend", "c10d",
                                             "--rdzv_endpoint", "192.0.2.1:5",
                                             "--rdzv_conf", "is_host=0", "p"})
                                          .options);
  EXPECT_FALSE(remote.mayHost);
  EXPECT_THROW(planRendezvous(*parse({"--nnodes", "2", "--rdzv_backend", "c10d", "p"}).options),
               ConfigError);
  // torchrun's several single-node jobs on one machine: --rdzv_endpoint localhost:0, a free port.
  EXPECT_TRUE(planRendezvous(*parse({"--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "p"}).options)
                  .embedded);
  try {
    planRendezvous(*parse({"--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "p"}).options);
    ADD_FAILURE() << "port 0 for two nodes was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--rdzv_endpoint 'localhost:0': port 0 (a free port) works for one node only"),
              std::string::npos)
        << e.what();
  }
}

TEST(FailureReport, RoundTripsThroughJsonAndQuotesTheWorker) {
  const Failure f{.rank = 3, .localRank = 1, .node = "n2", .pid = 42, .waitStatus = 3 << 8,
                  .secondsAfterStart = 1.5, .time = "2026-01-01T00:00:00Z", .restartCount = 1,
                  .error = "ValueError: boom", .stderrTail = "line 1\nline 2\n"};
  const auto back = Failure::fromJson(f.toJson());
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.node, "n2");
  EXPECT_EQ(back.stderrTail, f.stderrTail);
  const auto text = describeFailure(back, 2);
  EXPECT_NE(text.find("rank 3 (local_rank 1 on n2, pid 42) failed first: exit code 3"), std::string::npos) << text;
  EXPECT_NE(text.find("ValueError: boom"), std::string::npos);
  EXPECT_NE(text.find("| line 2"), std::string::npos);
  EXPECT_NE(text.find("restart 1 of 2"), std::string::npos);
  EXPECT_THROW(Failure::fromJson("{}"), ProtocolError);
}

TEST(InspectBlas, TellsReferenceFromOpenBlas) {
  const std::string reference = "/usr/lib/x86_64-linux-gnu/blas/libblas.so.3";
  const std::string openblas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3";
  if (::access(reference.c_str(), R_OK) != 0 || ::access(openblas.c_str(), R_OK) != 0) {
    GTEST_SKIP() << "needs both libblas3 and libopenblas0-pthread";
  }
  EXPECT_EQ(inspectBlas(reference).kind, BlasKind::kReference);
  const auto info = inspectBlas(openblas);
  EXPECT_EQ(info.kind, BlasKind::kOptimized);
  EXPECT_NE(info.name.find("OpenBLAS"), std::string::npos);
  EXPECT_EQ(inspectBlas("/nonexistent/libblas.so").kind, BlasKind::kMissing);
  // Without loading anything: the path tells.
  EXPECT_EQ(classifyBlasPath(reference).kind, BlasKind::kReference);
  EXPECT_EQ(classifyBlasPath(openblas).kind, BlasKind::kOptimized);
  EXPECT_EQ(classifyBlasPath("/opt/x/libfoo.so").kind, BlasKind::kMissing);
  EXPECT_EQ(quickInspectBlas().kind, inspectBlas().kind);
}

}  // namespace
}  // namespace fsdp::launcher
