#include "fsdp/launcher/options.hpp"

#include <gtest/gtest.h>

#include "fsdp/common/error.hpp"
#include "fsdp/launcher/agent.hpp"
#include "fsdp/launcher/blas_check.hpp"

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
  const WorkerIdentity id{.localRank = 1, .rank = 1, .worldSize = 2, .localWorldSize = 2, .restartCount = 2};
  const auto env = workerEnvironment(o, id, "127.0.0.1", 1234, 5678, {"PATH=/bin", "RANK=9"});
  const auto has = [&env](const std::string& entry) {
    return std::find(env.begin(), env.end(), entry) != env.end();
  };
  for (const char* e : {"RANK=1", "LOCAL_RANK=1", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=0",
                        "GROUP_WORLD_SIZE=1", "ROLE_RANK=1", "ROLE_WORLD_SIZE=2", "ROLE_NAME=trainer",
                        "MASTER_PORT=5678", "TORCHELASTIC_RESTART_COUNT=2",
                        "TORCHELASTIC_MAX_RESTARTS=3", "OMP_NUM_THREADS=1", "FSDPRUN_STORE_PORT=1234",
                        "PATH=/bin"}) {
    EXPECT_TRUE(has(e)) << e;
  }
  EXPECT_FALSE(has("RANK=9"));
  const auto userOmp = workerEnvironment(o, id, "127.0.0.1", 1, 2, {"OMP_NUM_THREADS=4"});
  EXPECT_NE(std::find(userOmp.begin(), userOmp.end(), "OMP_NUM_THREADS=4"), userOmp.end());
  EXPECT_EQ(std::find(userOmp.begin(), userOmp.end(), "OMP_NUM_THREADS=1"), userOmp.end());
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
}

}  // namespace
}  // namespace fsdp::launcher
