// fsdp-bench's store benchmarks and recovery at toy sizes: they run with only the flags a user
// gives, print one JSON line per size or case with every setup's figures, and a bad flag value is
// a usage error. (The figures themselves are the benchmark's business, not a test's, except
// recovery's steps redone: at most one with a snapshot every step is the feature's promise.)
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "run_command.hpp"

namespace {

using namespace std::chrono_literals;

const std::string kBench = std::string(FSDP_BIN_DIR) + "/fsdp-bench";

std::vector<nlohmann::json> jsonLines(const std::string& out) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.front() == '{') lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

TEST(FsdpBench, StoreInitRunsWithItsDefaultsAndReportsBothServers) {
  const auto r = fsdp::testing::runCommand(
      {kBench, "store_init", "--clients", "20", "--reps", "1", "--client", "libtorch"}, 60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto lines = jsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  const auto& line = lines.front();
  EXPECT_EQ(line.at("bench"), "store_init");
  EXPECT_EQ(line.at("clients"), 20);
  EXPECT_GT(line.at("fsdprun_s_median").get<double>(), 0.0) << line;
  EXPECT_GT(line.at("c10d_s_median").get<double>(), 0.0) << line;
  EXPECT_TRUE(line.contains("speedup")) << line;
  EXPECT_FALSE(line.contains("proxy_nodes")) << line;
}

TEST(FsdpBench, StoreInitThroughNodeProxiesAddsThatSetup) {
  const auto r = fsdp::testing::runCommand({kBench, "store_init", "--clients", "20", "--reps", "1",
                                            "--client", "libtorch", "--server", "ours", "--nodes", "2"},
                                           60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto lines = jsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_EQ(lines.front().at("proxy_nodes"), 2);
  EXPECT_GT(lines.front().at("fsdprun_proxy_s_median").get<double>(), 0.0) << lines.front();
  EXPECT_FALSE(lines.front().contains("c10d_s_median")) << lines.front();
}

TEST(FsdpBench, RdzvJoinReportsItsRound) {
  const auto r = fsdp::testing::runCommand({kBench, "rdzv_join", "--agents", "10"}, 60s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto lines = jsonLines(r.out);
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_EQ(lines.front().at("agents"), 10);
  EXPECT_GT(lines.front().at("first_join_to_last_assignment_s").get<double>(), 0.0);
}

TEST(FsdpBench, RecoveryResumesAKilledWorkerFromItsInMemorySnapshot) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  // gpt at its bench size: a step takes tens of milliseconds (DeepNet's second is the bench's).
  const auto r = fsdp::testing::runCommand({kBench, "recovery", "--models", "gpt", "--cases", "worker",
                                            "--torchrun", "0", "--steps", "15", "--seed", "7"},
                                           220s);
  ASSERT_EQ(r.exitCode, 0) << r.err;
  const auto lines = jsonLines(r.out);
  // Both restart modes on the same kill, their comparison, then the comparison of the medians
  // over the reps (one here).
  ASSERT_EQ(lines.size(), 4u) << r.out;
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& line = lines[i];
    const std::string mode = i == 0 ? "auto" : "process";
    EXPECT_EQ(line.value("restart_mode", ""), mode) << line;
    EXPECT_FALSE(line.contains("error")) << line;
    EXPECT_EQ(line.at("bench"), "recovery");
    EXPECT_EQ(line.at("system"), "fsdprun");
    EXPECT_EQ(line.at("model"), "gpt");
    EXPECT_EQ(line.at("layout"), "2x1");
    EXPECT_EQ(line.at("kill"), "worker");
    EXPECT_EQ(line.at("seed"), 7);
    EXPECT_EQ(line.at("finished"), true) << line;
    EXPECT_EQ(line.at("source"), "memory") << line;
    // A snapshot every step: the kill costs at most the step whose snapshot was being copied.
    EXPECT_GE(line.at("steps_redone").get<long long>(), 0) << line;
    EXPECT_LE(line.at("steps_redone").get<long long>(), 1) << line;
    EXPECT_GT(line.at("kill_to_restored_s").get<double>(), 0.0) << line;
    EXPECT_GE(line.at("kill_to_first_step_s").get<double>(), line.at("kill_to_restored_s").get<double>()) << line;
    EXPECT_GT(line.at("step_ms").get<double>(), 0.0) << line;
    EXPECT_TRUE(line.contains("recovery_overhead_s")) << line;
    // Rank 0 survived rank 1's kill: its process stays in auto mode, not in process mode.
    EXPECT_EQ(line.value("survivors", -1), 1) << line;
    EXPECT_EQ(line.value("survivors_kept_pid", -1), mode == "auto" ? 1 : 0) << line;
    EXPECT_EQ(line.value("recovery_path", ""), mode == "auto" ? "in_process" : "process") << line;
    EXPECT_EQ(line.contains("notice_to_reform_ms"), mode == "auto") << line;
  }
  // A ratio, or none where auto's overhead was not above zero (within one step's noise), saying so.
  for (const auto& compare : {lines[2], lines[3]}) {
    ASSERT_TRUE(compare.contains("ratio")) << compare;
    EXPECT_TRUE(compare.at("ratio").is_number() || compare.contains("note")) << compare;
    EXPECT_EQ(compare.at("overhead_s_auto"), lines[0].at("recovery_overhead_s")) << compare;
    EXPECT_EQ(compare.at("overhead_s_process"), lines[1].at("recovery_overhead_s")) << compare;
  }
  EXPECT_EQ(lines[3].at("reps"), 1) << lines[3];
  EXPECT_EQ(lines[3].at("overhead_s_auto_each").size(), 1u) << lines[3];
}

TEST(FsdpBench, ABadFlagValueIsAUsageErrorNamingTheFlag) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--nodes", "0"},
                                              {"--clients", "ten"},
                                              {"--client", "python"}}) {
    std::vector<std::string> argv = {kBench, "store_init"};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = fsdp::testing::runCommand(argv, 30s);
    EXPECT_EQ(r.exitCode, 2) << args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(args[0] + " '" + args[1] + "'"), std::string::npos) << r.err;
  }
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--cases", "node"},
                                              {"--restart_modes", "sometimes"},
                                              {"--models", "shallow"},
                                              {"--torchrun", "yes"}}) {
    std::vector<std::string> argv = {kBench, "recovery"};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = fsdp::testing::runCommand(argv, 30s);
    EXPECT_EQ(r.exitCode, 2) << args[0] << ": " << r.err;
    EXPECT_NE(r.err.find(args[0] + " '" + args[1] + "'"), std::string::npos) << r.err;
  }
}

}  // namespace
